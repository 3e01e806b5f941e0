//! The dispatcher process: the library's supervisor over the benchmark's database, with the
//! RabbitMQ sink (end to end, latency) or with one that does nothing (the database ceiling),
//! straight to the server or through a transaction pooler (`--direct-url`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{PublishFuture, RabbitSink};
use actix_outbox::{MetricsSnapshot, OutboxMessage, OutboxSupervisor, PoolConfig, Pooler, Publisher};
use diesel_async::SimpleAsyncConnection;
use serde::Serialize;

use super::{commands, emit, wait_for};
use crate::message::rabbit_config;
use crate::procstat::{own_cpu_seconds, peak_rss_kib};
use crate::{BoxError, DispatcherChild, Opts, REPORT_PERIOD};

/// A sink that does nothing: the database ceiling.
#[derive(Debug)]
struct NullSink;

impl Publisher for NullSink {
    fn publish(&self, _: Arc<OutboxMessage>) -> PublishFuture {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Reports the instant each publish was confirmed (latency phase).
#[derive(Debug)]
struct Timed<P>(P);

impl<P: Publisher> Publisher for Timed<P> {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let id = message.id;
        let publish = self.0.publish(message);
        Box::pin(async move {
            let result = publish.await;
            if result.is_ok() {
                emit(&format!("confirm {id} {}", unix_nanos(SystemTime::now())));
            }
            result
        })
    }
}

#[derive(Serialize)]
struct Final {
    peak_rss_kib: u64,
    /// CPU time this process spent from `go` to `stop`, in seconds.
    cpu_seconds: Option<f64>,
    metrics: Option<MetricsSnapshot>,
}

/// Runs one dispatcher from `go` to `stop`, reporting its `done` counter as it goes, then its
/// peak RSS, CPU time and metrics.
pub(crate) async fn dispatcher(role: DispatcherChild, opts: Opts) -> Result<(), BoxError> {
    let mut commands = commands();
    let config = opts.dispatcher_config();
    let pool_size = config.workers + 2;
    let pool = match &role.direct_url {
        None => actix_outbox::connect_pool(&role.db, pool_size as u32).await?,
        Some(direct) => {
            PoolConfig::new(&role.db)
                .size(pool_size as u32)
                .pooler(Pooler::Transaction)
                .direct_url(direct)
                .connect()
                .await?
        }
    };
    // Open every connection now, so that start-up is not timed.
    let warm = futures_util::future::join_all((0..pool_size).map(|_| pool.get())).await;
    let mut warm = warm.into_iter().collect::<Result<Vec<_>, _>>()?;
    if role.direct_url.is_some() {
        // A pooler opens its server connections on a client's first transaction: one
        // statement on every connection at once has it open as many as the pool may use.
        let opened = futures_util::future::join_all(warm.iter_mut().map(|c| c.batch_execute("SELECT 1"))).await;
        opened.into_iter().collect::<Result<Vec<_>, _>>()?;
    }
    drop(warm);
    let rabbit = match role.sink.as_str() {
        "null" => None,
        "rabbit" => Some(RabbitSink::connect(rabbit_config(&opts, &role.exchange)).await?),
        other => return Err(format!("unknown sink {other:?}").into()),
    };
    emit("ready");
    let deadline = opts.phase_timeout + Duration::from_secs(60);
    if !wait_for(&mut commands, "go", deadline).await {
        return Ok(());
    }
    let cpu_at_go = own_cpu_seconds();
    let supervisor = match (&rabbit, role.report_confirms) {
        (None, _) => OutboxSupervisor::start(config, pool, NullSink)?,
        (Some(sink), false) => OutboxSupervisor::start(config, pool, sink.clone())?,
        (Some(sink), true) => OutboxSupervisor::start(config, pool, Timed(sink.clone()))?,
    };
    let mut reported = u64::MAX;
    let mut tick = tokio::time::interval(REPORT_PERIOD);
    let stop_at = tokio::time::Instant::now() + deadline;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let done = supervisor.send(GetMetrics).await?.done;
                if done != reported {
                    emit(&format!("done {done}"));
                    reported = done;
                }
            }
            line = commands.recv() => if matches!(line.as_deref(), None | Some("stop")) { break },
            () = tokio::time::sleep_until(stop_at) => break,
        }
    }
    let cpu_seconds = cpu_at_go.zip(own_cpu_seconds()).map(|(go, stop)| stop - go);
    supervisor.send(Shutdown).await?;
    let metrics = supervisor.send(GetMetrics).await.ok();
    if let Some(sink) = &rabbit {
        sink.close().await;
    }
    let report = Final { peak_rss_kib: peak_rss_kib(), cpu_seconds, metrics };
    emit(&format!("final {}", serde_json::to_string(&report)?));
    Ok(())
}

fn unix_nanos(t: SystemTime) -> i128 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128)
}
