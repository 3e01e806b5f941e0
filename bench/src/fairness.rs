//! Fairness between the outboxes of one relay: one process relays two outboxes of one database
//! (`tenant_a.outbox`, `tenant_b.outbox`, a dispatcher and a RabbitMQ connection each, as
//! `actix-outbox run --outbox tenant_a --outbox tenant_b` makes them; `--shared-sink` puts both
//! on one connection), a consumer draining the queue. `--backlog` rows wait in
//! tenant_a's; while its dispatcher drains them, single rows are committed to tenant_b's one
//! at a time, `--probe-interval` apart, and each one's commit → done (the database clock:
//! `done_at - created_at`, so claim, publish with its confirm, and the fenced finalize) is
//! printed beside the same probes with tenant_a idle, split into its three steps: commit → the
//! publish called (the wakeup and the claim), the publish (its confirm), and the publish's answer
//! → done (the finalize).
//!
//! ```text
//! cargo run --release -p actix-outbox-bench --bin fairness -- --backlog 200000
//! ```
//!
//! It creates a database of its own (`<DATABASE_URL's name>_fair_<pid>`) and an exchange and a
//! classic queue of its own, and drops them at the end.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::{PublishFuture, QueueKind, RabbitConfig, RabbitSink, SinkState};
use actix_outbox::{
    ConnectionString, DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, PoolConfig, Publisher,
};
use clap::Parser;
use diesel::sql_types::Double;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

type BoxError = Box<dyn std::error::Error>;

#[derive(Parser)]
#[command(about = "One row's latency in an outbox beside a backlog in another, relayed by one process")]
struct Opts {
    /// Rows waiting in tenant_a's outbox.
    #[arg(long, default_value_t = 200_000)]
    backlog: usize,
    /// Single rows committed to tenant_b's outbox during the drain (and again while idle).
    #[arg(long, default_value_t = 100)]
    probes: usize,
    /// Pause between two probes.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    probe_interval: Duration,
    /// One broker connection for both outboxes, rather than one each as `actix-outbox run`
    /// makes them.
    #[arg(long)]
    shared_sink: bool,
    /// Pace tenant_a's drain at this many messages a second (`run --max-rate`, which applies
    /// to each outbox); default: unpaced.
    #[arg(long)]
    backlog_max_rate: Option<f64>,
    /// tenant_a's workers (default: the dispatcher's default).
    #[arg(long)]
    backlog_workers: Option<usize>,
    /// tenant_a's claim batch (default: the dispatcher's default).
    #[arg(long)]
    backlog_batch: Option<usize>,
    /// tenant_a's in-flight window per worker (default: the dispatcher's default).
    #[arg(long)]
    backlog_max_in_flight: Option<usize>,
    /// Server and name prefix of the database (`_fair_<pid>` is appended).
    #[arg(long, env = "DATABASE_URL", default_value = "postgres://root@127.0.0.1:5432/actix_outbox_bench")]
    database_url: String,
    /// The RabbitMQ broker.
    #[arg(long, env = "AMQP_URL", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp_url: String,
}

fn main() -> std::process::ExitCode {
    let opts = Opts::parse();
    match actix::System::new().block_on(run(opts)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fairness: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(opts: Opts) -> Result<(), BoxError> {
    let server = ConnectionString::parse(&opts.database_url)?;
    let name = format!("{}_fair_{}", server.database().unwrap_or("actix_outbox_bench"), std::process::id());
    let url = server.with_database(&name);
    actix_outbox::admin::ensure_database(url.expose()).await?;
    let exchange = format!("outbox_fair_{}", std::process::id());
    let result = measure(&opts, &url, &exchange).await;
    let mut admin = actix_outbox::admin::connect(server.with_database("postgres").expose()).await?;
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).await?;
    let broker = lapin::Connection::connect(&opts.amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = broker.create_channel().await?;
    channel.queue_delete(exchange.as_str().into(), Default::default()).await?;
    channel.exchange_delete(exchange.as_str().into(), Default::default()).await?;
    result
}

async fn measure(opts: &Opts, url: &ConnectionString, exchange: &str) -> Result<(), BoxError> {
    let tenants = ["tenant_a", "tenant_b"].map(|t| url.in_schema(t));
    let [a, b] = [tenants[0].clone()?, tenants[1].clone()?];
    for (schema, tenant) in [("tenant_a", &a), ("tenant_b", &b)] {
        actix_outbox::admin::ensure_schema(url.expose(), schema).await?;
        actix_outbox::migrate(tenant.expose()).await?;
    }
    let mut conn = actix_outbox::admin::connect(url.expose()).await?;
    let pad = "x".repeat(232);
    conn.batch_execute(&format!(
        "INSERT INTO tenant_a.outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'tenant', (n % 1000)::text, 'bench.event', jsonb_build_object('n', n, 'pad', '{pad}')
         FROM generate_series(1, {}) n",
        opts.backlog
    ))
    .await?;
    conn.batch_execute("VACUUM ANALYZE tenant_a.outbox").await?;
    let sink_config =
        RabbitConfig::new(opts.amqp_url.clone()).exchange(exchange).bind_queue_with(exchange, "#", QueueKind::Classic);
    let mut relay = Vec::new();
    let mut sinks = Vec::new();
    let marks = Marks::default();
    for (name, tenant) in [("tenant_a.outbox", &a), ("tenant_b.outbox", &b)] {
        if sinks.is_empty() || !opts.shared_sink {
            sinks.push(RabbitSink::connect(sink_config.clone()).await?);
        }
        let pool = PoolConfig::new(tenant.expose()).size(6).connect().await?;
        let sink = sinks.last().expect("a sink").clone();
        let mut config = DispatcherConfig::default().name(name);
        if name == "tenant_a.outbox" {
            if let Some(rate) = opts.backlog_max_rate {
                config = config.max_rate(rate);
            }
            if let Some(workers) = opts.backlog_workers {
                config = config.workers(workers);
            }
            if let Some(batch) = opts.backlog_batch {
                config = config.batch(batch);
            }
            if let Some(window) = opts.backlog_max_in_flight {
                config = config.max_in_flight(window);
            }
            relay.push(OutboxSupervisor::start(config, pool, sink)?);
        } else {
            relay.push(OutboxSupervisor::start(config, pool, Timed { inner: sink, marks: marks.clone() })?);
        }
    }
    // A consumer drains the queue, as a service would.
    let broker = lapin::Connection::connect(&opts.amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = broker.create_channel().await?;
    let options = lapin::options::BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut consumer = channel.basic_consume(exchange.into(), "fairness".into(), options, Default::default()).await?;
    let consuming = actix::spawn(async move {
        use futures_util::StreamExt;
        while let Some(Ok(_)) = consumer.next().await {}
    });
    let mut producer = actix_outbox::admin::connect(b.expose()).await?;
    let busy = probe(opts, &mut producer, &mut conn, &marks, "busy", opts.backlog).await?;
    while pending(&mut conn, "tenant_a").await? > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idle = probe(opts, &mut producer, &mut conn, &marks, "idle", 0).await?;
    let drain =
        value(&mut conn, "SELECT extract(epoch FROM max(done_at) - min(done_at))::float8 AS v FROM tenant_a.outbox")
            .await?;
    for dispatcher in &relay {
        dispatcher.send(Shutdown).await?;
    }
    for sink in sinks {
        sink.close().await;
    }
    consuming.abort();
    let _ = broker.close(200, "done".into()).await;
    println!("tenant_a: {} rows drained in {drain:.1} s ({:.0} rows/s)", opts.backlog, opts.backlog as f64 / drain);
    println!(
        "tenant_b: {} single rows, {:?} apart, commit -> done (database clock):",
        opts.probes, opts.probe_interval
    );
    println!("| tenant_a | p50 | p99 | max | tenant_a rows pending at the last probe |");
    println!("| --- | --- | --- | --- | --- |");
    for (what, probed) in [("draining", &busy), ("idle", &idle)] {
        let lat = probed.column(|s| s.total);
        println!(
            "| {what} | {:.1} ms | {:.1} ms | {:.1} ms | {} |",
            pct(&lat, 0.50),
            pct(&lat, 0.99),
            pct(&lat, 1.0),
            probed.left
        );
    }
    println!("each step, p50 / p99 / max in ms:");
    println!("| tenant_a | commit -> publish called | publish (confirm) | answer -> done |");
    println!("| --- | --- | --- | --- |");
    for (what, probed) in [("draining", &busy), ("idle", &idle)] {
        let step = |f: fn(&Steps) -> f64| {
            let v = probed.column(f);
            format!("{:.1} / {:.1} / {:.1}", pct(&v, 0.50), pct(&v, 0.99), pct(&v, 1.0))
        };
        println!("| {what} | {} | {} | {} |", step(|s| s.claim), step(|s| s.publish), step(|s| s.finalize));
    }
    Ok(())
}

/// When each of tenant_b's publishes was called and answered, by row id (the last attempt's).
type Marks = Arc<Mutex<HashMap<i64, (SystemTime, SystemTime)>>>;

/// tenant_b's sink, noting when each publish was called and answered.
#[derive(Debug)]
struct Timed {
    inner: RabbitSink,
    marks: Marks,
}

impl Publisher for Timed {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let (id, called, marks) = (message.id, SystemTime::now(), self.marks.clone());
        let publish = self.inner.publish(message);
        Box::pin(async move {
            let answer = publish.await;
            marks.lock().expect("marks").insert(id, (called, SystemTime::now()));
            answer
        })
    }

    fn state(&self) -> SinkState {
        self.inner.state()
    }
}

/// One probe's commit → done and its steps, in milliseconds.
struct Steps {
    total: f64,
    claim: f64,
    publish: f64,
    finalize: f64,
}

/// The probes of one phase, and tenant_a's pending rows at the last.
struct Probed {
    steps: Vec<Steps>,
    left: i64,
}

impl Probed {
    /// One figure of every probe, sorted.
    fn column(&self, f: fn(&Steps) -> f64) -> Vec<f64> {
        let mut v: Vec<f64> = self.steps.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    }
}

/// Commits `opts.probes` single rows to tenant_b (tagged `tag`) and returns each one's commit →
/// done and its steps once all are done, with tenant_a's pending rows at the last probe.
async fn probe(
    opts: &Opts,
    producer: &mut AsyncPgConnection,
    conn: &mut AsyncPgConnection,
    marks: &Marks,
    tag: &str,
    wait_for_drain: usize,
) -> Result<Probed, BoxError> {
    // Under way: a tenth of the backlog done before the first probe.
    while wait_for_drain > 0 && pending(conn, "tenant_a").await? as usize > wait_for_drain * 9 / 10 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for i in 0..opts.probes {
        let event = NewEvent::new("probe", tag, "bench.probe", serde_json::json!({ "n": i }));
        actix_outbox::enqueue(producer, &event).await?;
        tokio::time::sleep(opts.probe_interval).await;
    }
    let left = pending(conn, "tenant_a").await?;
    let query =
        format!("SELECT count(*)::float8 AS v FROM tenant_b.outbox WHERE aggregate_id = '{tag}' AND status <> 'done'");
    while value(conn, &query).await? > 0.0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
        #[diesel(sql_type = Double)]
        created: f64,
        #[diesel(sql_type = Double)]
        done: f64,
    }
    let rows: Vec<Row> = diesel::sql_query(format!(
        "SELECT id, extract(epoch FROM created_at)::float8 AS created, extract(epoch FROM done_at)::float8 AS done
         FROM tenant_b.outbox WHERE aggregate_id = '{tag}'"
    ))
    .load(conn)
    .await?;
    let marks = marks.lock().expect("marks");
    let epoch = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    let steps = rows
        .iter()
        .map(|row| {
            let (called, answered) = marks.get(&row.id).map_or((f64::NAN, f64::NAN), |&(c, a)| (epoch(c), epoch(a)));
            Steps {
                total: (row.done - row.created) * 1000.0,
                claim: (called - row.created) * 1000.0,
                publish: (answered - called) * 1000.0,
                finalize: (row.done - answered) * 1000.0,
            }
        })
        .collect();
    Ok(Probed { steps, left })
}

async fn pending(conn: &mut AsyncPgConnection, schema: &str) -> Result<i64, BoxError> {
    let sql = format!("SELECT count(*)::float8 AS v FROM {schema}.outbox WHERE status <> 'done'");
    Ok(value(conn, &sql).await? as i64)
}

/// The one value `v` of `sql`'s one row, as a float.
async fn value(conn: &mut AsyncPgConnection, sql: &str) -> Result<f64, BoxError> {
    #[derive(diesel::QueryableByName)]
    struct V {
        #[diesel(sql_type = Double)]
        v: f64,
    }
    Ok(diesel::sql_query(sql).get_result::<V>(conn).await?.v)
}

/// The `q` quantile of sorted `v` (nearest rank).
fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
}
