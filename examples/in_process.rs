//! The dispatcher with an in-process sink: no broker needed.
//!
//! ```text
//! cargo run --example in_process
//! ```
//!
//! Creates (if missing) and migrates `DATABASE_URL` (default
//! `postgres://root@127.0.0.1:5432/actix_outbox_in_process`), writes 20 events, one in three
//! failing on its first attempt, and prints each publish as it happens, then the counters.

use std::time::Duration;

use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{ChannelSink, SinkAction};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor, PublishError};
use diesel_async::AsyncConnection;

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal, and not under NO_COLOR.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/actix_outbox_in_process".into());
    // Its `Display` masks the password.
    let shown = actix_outbox::ConnectionString::parse(&url)?;
    if let Err(e) = actix_outbox::admin::ensure_database(&url).await {
        eprintln!(
            "PostgreSQL at {shown} is unreachable ({e}); start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
        );
        std::process::exit(1);
    }
    actix_outbox::migrate(&url).await?;
    let pool = actix_outbox::connect_pool(&url, 8).await?;

    let mut conn = pool.get().await?;
    let ids = conn
        .transaction(async |tx| {
            let events: Vec<_> = (0..20)
                .map(|i| NewEvent::new("order", format!("o-{}", i % 5), "order.updated", serde_json::json!({"seq": i})))
                .collect();
            actix_outbox::enqueue_many(tx, &events).await
        })
        .await?;
    drop(conn);
    println!("enqueued ids {}..={}", ids[0], ids[ids.len() - 1]);

    let (sink, mut published) = ChannelSink::new();
    let sink = sink.with_script(|m| {
        if m.id % 3 == 0 && m.attempts == 1 {
            SinkAction::Fail(PublishError::Retryable("simulated broker hiccup".into()))
        } else {
            SinkAction::Deliver
        }
    });
    let config = DispatcherConfig::default()
        .poll_interval(Duration::from_millis(100))
        .backoff_base(Duration::from_millis(50))
        .backoff_cap(Duration::from_millis(200));
    let dispatcher = OutboxSupervisor::start(config, pool, sink)?;

    let mut seen = 0;
    while seen < ids.len() {
        let m = tokio::time::timeout(Duration::from_secs(30), published.recv()).await?.expect("sink alive");
        if ids.contains(&m.id) {
            seen += 1;
            println!(
                "published id={} type={} aggregate={}/{} attempt={}",
                m.id, m.event_type, m.aggregate_type, m.aggregate_id, m.attempts
            );
        }
    }
    dispatcher.send(Shutdown).await?;
    println!("{:?}", dispatcher.send(GetMetrics).await?);
    Ok(())
}
