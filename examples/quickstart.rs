//! The quick start: business changes and their events committed together in PostgreSQL,
//! dispatched to RabbitMQ with publisher confirms, consumed back.
//!
//! ```text
//! cargo run --example quickstart
//! ```
//!
//! - `DATABASE_URL` (default `postgres://root@127.0.0.1:5432/actix_outbox_quickstart`) is
//!   created if missing and migrated; the example adds a small `orders` table of its own.
//! - `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`): the sink declares the
//!   `outbox` topic exchange; the example binds a private queue to it for `order.#`.
//!
//! Each order is written with its outbox event in one transaction; the dispatcher publishes the
//! events; the consumer prints each one (deduplicating on `message_id`, as every consumer of an
//! at-least-once stream should), then everything shuts down and the example exits 0. When
//! PostgreSQL or RabbitMQ is down it prints one line per missing service, saying where it looked
//! and how to start it, and exits 1. Logs go to stderr (`RUST_LOG` tunes them).

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::Duration;

use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::{RabbitConfig, RabbitError, RabbitSink};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

const DEFAULT_DATABASE_URL: &str = "postgres://root@127.0.0.1:5432/actix_outbox_quickstart";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// How long the example waits for its events to come back before giving up.
const DEADLINE: Duration = Duration::from_secs(30);

/// Log filter unless `RUST_LOG` says otherwise: the dispatcher's lifecycle, and warnings. lapin's
/// own logs are off: the sink reports link changes itself (`RUST_LOG=lapin=warn` brings them back).
const QUIET_LOGS: &str = "warn,actix_outbox=info,lapin=off";

type BoxError = Box<dyn std::error::Error>;

#[actix::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal, and not under NO_COLOR.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| QUIET_LOGS.into()))
        .init();
    match run().await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("quickstart failed: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<ExitCode, BoxError> {
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let amqp_url = std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.into());

    // Both services first, so that one run names every one that is missing. (A
    // `ConnectionString` shows the URL with its password masked.)
    let shown = actix_outbox::ConnectionString::parse(&database_url)?;
    let database = actix_outbox::admin::ensure_database(&database_url).await;
    let sink = RabbitSink::connect(RabbitConfig::new(&amqp_url).connection_name("actix-outbox quickstart")).await;
    let mut down = Vec::new();
    if let Err(e) = &database {
        down.push(format!(
            "PostgreSQL is not reachable at {shown} ({}). Start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
            one_line(e)
        ));
    }
    match &sink {
        Err(RabbitError::Unreachable { url, reason }) => down.push(format!(
            "RabbitMQ is not reachable at {url} ({}). Start it with: rabbitmq-server -detached",
            one_line(reason)
        )),
        Err(e) => down.push(one_line(e)),
        Ok(_) => {}
    }
    if !down.is_empty() {
        for line in down {
            eprintln!("{line}");
        }
        return Ok(ExitCode::FAILURE);
    }
    let sink = sink?;
    if database? {
        println!("created database {shown}");
    }
    actix_outbox::migrate(&database_url).await?;
    let pool = actix_outbox::connect_pool(&database_url, 4).await?;
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 customer    text   NOT NULL,
                 total_cents bigint NOT NULL,
                 paid        boolean NOT NULL DEFAULT false
             )",
        )
        .await?;

    // The consumer: a private queue bound to the sink's exchange before anything is published,
    // so that no event of this run is unroutable.
    let consumer_conn = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = consumer_conn.create_channel().await?;
    let queue = channel
        .queue_declare("".into(), QueueDeclareOptions { exclusive: true, ..Default::default() }, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            queue.name().clone(),
            sink.exchange().into(),
            "order.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut deliveries = channel
        .basic_consume(queue.name().clone(), "quickstart".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await?;

    let config = DispatcherConfig::default().workers(2).poll_interval(Duration::from_millis(100));
    let dispatcher = OutboxSupervisor::start(config, pool.clone(), sink.clone())?;

    // The business changes, each committed together with its event.
    let mut conn = pool.get().await?;
    let mut expected = HashSet::new();
    for (customer, total_cents) in [("ada", 1250_i64), ("grace", 990), ("linus", 4200)] {
        let (order_id, event_id) = conn
            .transaction(async |tx| {
                #[derive(diesel::QueryableByName)]
                struct Inserted {
                    #[diesel(sql_type = BigInt)]
                    id: i64,
                }
                let order: Inserted =
                    diesel::sql_query("INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id")
                        .bind::<Text, _>(customer)
                        .bind::<BigInt, _>(total_cents)
                        .get_result(tx)
                        .await?;
                let event = NewEvent::new(
                    "order",
                    order.id.to_string(),
                    "order.created",
                    serde_json::json!({ "order_id": order.id, "customer": customer, "total_cents": total_cents }),
                );
                let event_id = actix_outbox::enqueue(tx, &event).await?;
                Ok::<_, actix_outbox::StoreError>((order.id, event_id))
            })
            .await?;
        println!("wrote order {order_id} for {customer} with outbox event {event_id}");
        expected.insert(event_id);
        if customer == "grace" {
            let event_id = conn
                .transaction(async |tx| {
                    diesel::sql_query("UPDATE orders SET paid = true WHERE id = $1")
                        .bind::<BigInt, _>(order_id)
                        .execute(tx)
                        .await?;
                    let event = NewEvent::new(
                        "order",
                        order_id.to_string(),
                        "order.paid",
                        serde_json::json!({ "order_id": order_id }),
                    );
                    actix_outbox::enqueue(tx, &event).await
                })
                .await?;
            println!("paid order {order_id} with outbox event {event_id}");
            expected.insert(event_id);
        }
    }
    drop(conn);

    // Consume until every event of this run has arrived. Duplicates are possible (at-least-once)
    // and carry the same message_id: skip them.
    let mut seen = HashSet::new();
    let consumed = tokio::time::timeout(DEADLINE, async {
        while !expected.is_subset(&seen) {
            let Some(delivery) = deliveries.next().await else { return Err::<(), BoxError>("consumer closed".into()) };
            let delivery = delivery?;
            let p = &delivery.properties;
            let id: i64 = p.message_id().as_ref().ok_or("message without message_id")?.as_str().parse()?;
            let header = |name: &str| p.headers().as_ref().and_then(|h| h.inner().get(name).cloned());
            let text = |v: Option<AMQPValue>| match v {
                Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                other => format!("{other:?}"),
            };
            let attempt = match header("x-attempt") {
                Some(AMQPValue::LongInt(n)) => n.to_string(),
                other => format!("{other:?}"),
            };
            if seen.insert(id) {
                println!(
                    "received id={id} type={} aggregate={}/{} attempt={attempt} payload={}",
                    p.kind().as_ref().map_or("", |k| k.as_str()),
                    text(header("x-aggregate-type")),
                    text(header("x-aggregate-id")),
                    String::from_utf8_lossy(&delivery.data),
                );
            } else {
                println!("duplicate id={id} skipped");
            }
            delivery.ack(BasicAckOptions::default()).await?;
        }
        Ok(())
    })
    .await;

    dispatcher.send(Shutdown).await?;
    sink.close().await;
    let _ = consumer_conn.close(200, "bye".into()).await;
    match consumed {
        Ok(result) => result?,
        Err(_) => {
            let missing: Vec<_> = expected.difference(&seen).collect();
            return Err(format!("events {missing:?} did not arrive within {}s", DEADLINE.as_secs()).into());
        }
    }
    println!("all {} events delivered; dispatcher stopped", expected.len());
    Ok(ExitCode::SUCCESS)
}

/// `e` on one line, for a message that must stay one line.
fn one_line(e: &impl std::fmt::Display) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}
