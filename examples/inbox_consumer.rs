//! An inbox consumer: applies each message of a RabbitMQ queue exactly once to PostgreSQL.
//!
//! ```text
//! cargo run --example inbox_consumer -- --database-url URL --amqp-url URL --queue NAME
//! ```
//!
//! - `--database-url` (or `DATABASE_URL`; default
//!   `postgres://root@127.0.0.1:5432/actix_outbox_inbox_example`): created if missing; the inbox
//!   is migrated there, and the example adds a table of its own, `received_events`.
//! - `--amqp-url` (or `AMQP_URL`; default `amqp://guest:guest@127.0.0.1:5672/%2f`); several,
//!   comma-separated, for the nodes of a cluster (`InboxConfig::cluster`), tried in turn.
//! - `--quorum`: the queue and its dead-letter queue are declared as quorum queues (a cluster's
//!   replicated queues; a queue's type cannot change once it exists).
//! - `--queue` (default `actix-outbox.inbox-example`): declared durable and bound to the
//!   `outbox` topic exchange (the one the dispatcher's RabbitMQ sink publishes to) for the
//!   events it applies, `order.*` (the events of the other examples); `--exchange`,
//!   `--binding-key` and `--no-bind` change that. The queue outlives the example and keeps
//!   collecting those events while it is stopped: `--delete-queue` removes it (and its
//!   dead-letter queue) and exits.
//!
//! For each new message, the handler inserts a `received_events` row (keyed by the producing
//! outbox, `x-outbox-source`, and the message id, unique together across producer databases)
//! in the same transaction as the inbox row, and prints the message; a copy of a message
//! already applied is acknowledged without a second row. A message that says it is JSON and is
//! not is dead-lettered with the reason, never recorded with an invented payload. Failures go to `<queue>.dlq`. SIGINT or SIGTERM stops consuming, lets
//! the deliveries in hand commit and be acknowledged, and exits 0. A service that cannot be
//! reached at start makes it print one line and exit 1. Logs go to stderr (`RUST_LOG`).
//!
//! Try it with the dispatcher feeding it:
//!
//! ```text
//! cargo run --example inbox_consumer &
//! cargo run -p actix-outbox-cli -- migrate --database-url postgres://root@127.0.0.1:5432/app
//! cargo run -p actix-outbox-cli -- enqueue --database-url postgres://root@127.0.0.1:5432/app \
//!     --aggregate-type order --aggregate-id 42 --event-type order.created --payload '{"total": 10}'
//! cargo run -p actix-outbox-cli -- run --database-url postgres://root@127.0.0.1:5432/app
//! ```

use std::process::ExitCode;

use actix_outbox::inbox::{
    self, BoxFuture, GetMetrics, HandlerError, InboxConfig, InboxHandler, InboxMessage, InboxSupervisor,
};
use actix_outbox::sink::QueueKind;
use clap::Parser;
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};

const DEFAULT_DATABASE_URL: &str = "postgres://root@127.0.0.1:5432/actix_outbox_inbox_example";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Log filter unless `RUST_LOG` says otherwise: the consumer's lifecycle, and warnings.
const QUIET_LOGS: &str = "warn,actix_outbox=info,lapin=off";

type BoxError = Box<dyn std::error::Error>;

/// Consume a queue into PostgreSQL, applying each message exactly once.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL [default: DATABASE_URL, else postgres://root@127.0.0.1:5432/actix_outbox_inbox_example]
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
    /// AMQP URL, or several comma-separated for a cluster's nodes [default: AMQP_URL, else
    /// amqp://guest:guest@127.0.0.1:5672/%2f]
    #[arg(long, value_name = "URL")]
    amqp_url: Option<String>,
    /// Declare the queue and its dead-letter queue as quorum queues (for a cluster)
    #[arg(long)]
    quorum: bool,
    /// The queue to consume (declared durable)
    #[arg(long, value_name = "NAME", default_value = "actix-outbox.inbox-example")]
    queue: String,
    /// The consumer's name: the inbox's key is (consumer, message id)
    #[arg(long, value_name = "NAME", default_value = "inbox-consumer-example")]
    consumer: String,
    /// The topic exchange the queue is bound to (declared durable, as the outbox's sink does)
    #[arg(long, value_name = "NAME", default_value = "outbox")]
    exchange: String,
    /// The binding's routing key: the events this consumer applies
    #[arg(long, value_name = "KEY", default_value = "order.*")]
    binding_key: String,
    /// Declare the queue only; leave exchanges and bindings alone
    #[arg(long)]
    no_bind: bool,
    /// Delete the queue and its dead-letter queue (with the messages they hold), then exit
    #[arg(long)]
    delete_queue: bool,
    /// Deliveries the broker sends ahead of their acknowledgements
    #[arg(long, value_name = "N", default_value_t = InboxConfig::new("", "", "").prefetch)]
    prefetch: u16,
}

diesel::table! {
    received_events (source, message_id) {
        source -> Text,
        message_id -> Int8,
        event_type -> Text,
        payload -> Nullable<Jsonb>,
        received_at -> Timestamptz,
    }
}

/// The example's own table: one row per event applied, keyed like the inbox. Upgrades the
/// table an earlier version of the example made (keyed by message id alone).
const RECEIVED_EVENTS_DDL: &str = "
CREATE TABLE IF NOT EXISTS received_events (
    source      text        NOT NULL DEFAULT '',
    message_id  bigint      NOT NULL,
    event_type  text        NOT NULL,
    payload     jsonb,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, message_id)
);
ALTER TABLE received_events ADD COLUMN IF NOT EXISTS source text NOT NULL DEFAULT '';
ALTER TABLE received_events ALTER COLUMN payload DROP NOT NULL;
DO $$ BEGIN
    IF (SELECT count(*) FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
        WHERE i.indrelid = 'received_events'::regclass AND i.indisprimary) = 1 THEN
        ALTER TABLE received_events DROP CONSTRAINT received_events_pkey;
        ALTER TABLE received_events ADD PRIMARY KEY (source, message_id);
    END IF;
END $$;";

/// Inserts one `received_events` row per new message, in the inbox's transaction.
struct RecordEvent;

impl InboxHandler for RecordEvent {
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        message: &'a InboxMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            diesel::insert_into(received_events::table)
                .values((
                    received_events::source.eq(&message.source),
                    received_events::message_id.eq(message.message_id),
                    received_events::event_type.eq(&message.event_type),
                    received_events::payload.eq(&message.payload),
                ))
                .execute(conn)
                .await?;
            println!(
                "received {}#{} {} ({}/{}, attempt {}{})",
                if message.source.is_empty() { "(no source)" } else { &message.source },
                message.message_id,
                message.event_type,
                message.aggregate_type,
                message.aggregate_id,
                message.attempt,
                if message.redelivered { ", redelivered" } else { "" }
            );
            Ok(())
        })
    }
}

#[actix::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal, and not under NO_COLOR.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| QUIET_LOGS.into()))
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inbox_consumer failed: {}", one_line(&*e));
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), BoxError> {
    let database_url = args
        .database_url
        .clone()
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| DEFAULT_DATABASE_URL.into());
    let amqp_urls =
        args.amqp_url.clone().or_else(|| std::env::var("AMQP_URL").ok()).unwrap_or_else(|| DEFAULT_AMQP_URL.into());
    let nodes: Vec<String> = amqp_urls.split(',').map(|u| u.trim().to_owned()).filter(|u| !u.is_empty()).collect();
    // The example's own connections (declaring, deleting) go to the first node.
    let amqp_url = <[String]>::first(&nodes).cloned().unwrap_or_else(|| DEFAULT_AMQP_URL.into());
    // Its `Display` masks the password.
    let masked = actix_outbox::ConnectionString::parse(&database_url)?;
    if args.delete_queue {
        return delete_queues(&args.queue, &amqp_url).await;
    }

    // The database: created if missing, the inbox migrated, the example's own table.
    actix_outbox::admin::ensure_database(&database_url)
        .await
        .map_err(|e| format!("PostgreSQL at {masked}: {}", one_line(&e)))?;
    for version in inbox::migrate_inbox(&database_url).await? {
        eprintln!("applied inbox migration {version}");
    }
    let pool = actix_outbox::connect_pool(&database_url, 8).await?;
    pool.get().await.map_err(|e| format!("PostgreSQL at {masked}: {e}"))?.batch_execute(RECEIVED_EVENTS_DDL).await?;

    // The queue and its binding, on a short-lived connection of the example's own (this is the
    // System's arbiter, which lives as long as the program).
    declare_topology(&args, &amqp_url).await.map_err(|e| format!("RabbitMQ (declaring the queue): {e}"))?;

    let mut config = InboxConfig::new(&args.consumer, &amqp_url, &args.queue).cluster(nodes).prefetch(args.prefetch);
    if args.quorum {
        config = config.dead_letter_queue_kind(QueueKind::Quorum);
    }
    let consumer = InboxSupervisor::start(config, pool, RecordEvent)?;
    eprintln!(
        "consuming {:?} as {:?} into {masked}; SIGINT or SIGTERM stops after the deliveries in hand",
        args.queue, args.consumer
    );
    if !args.no_bind {
        eprintln!(
            "the queue is bound to {:?} for {:?} and keeps collecting those events while this example is stopped; \
             `--delete-queue` removes it",
            args.exchange, args.binding_key
        );
    }

    wait_for_signal().await?;
    eprintln!("stopping: finishing the deliveries in hand");
    consumer.send(inbox::Shutdown).await?;
    let m = consumer.send(GetMetrics).await?;
    eprintln!(
        "stopped: {} received, {} applied, {} duplicates, {} retried, {} dead-lettered",
        m.received, m.handled, m.duplicates, m.retried, m.dead_lettered
    );
    Ok(())
}

async fn declare_topology(args: &Args, amqp_url: &str) -> Result<(), lapin::Error> {
    let properties = ConnectionProperties::default().with_connection_name("actix-outbox inbox example setup".into());
    let conn = Connection::connect(amqp_url, properties).await?;
    let channel = conn.create_channel().await?;
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    let mut arguments = FieldTable::default();
    if args.quorum {
        arguments.insert("x-queue-type".into(), lapin::types::AMQPValue::LongString("quorum".into()));
    }
    channel.queue_declare(args.queue.as_str().into(), durable, arguments).await?;
    if !args.no_bind {
        let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        channel
            .exchange_declare(args.exchange.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
            .await?;
        channel
            .queue_bind(
                args.queue.as_str().into(),
                args.exchange.as_str().into(),
                args.binding_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    conn.close(200, "set up".into()).await
}

/// `--delete-queue`: the queue and its dead-letter queue, gone.
async fn delete_queues(queue: &str, amqp_url: &str) -> Result<(), BoxError> {
    let properties = ConnectionProperties::default().with_connection_name("actix-outbox inbox example cleanup".into());
    let conn = Connection::connect(amqp_url, properties).await?;
    let channel = conn.create_channel().await?;
    for name in [queue.to_owned(), format!("{queue}.dlq")] {
        let dropped = channel.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await?;
        eprintln!("deleted queue {name:?} ({dropped} messages dropped)");
    }
    conn.close(200, "cleaned up".into()).await?;
    Ok(())
}

/// Resolves on the first SIGINT or SIGTERM.
async fn wait_for_signal() -> std::io::Result<()> {
    use actix_rt::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::select! {
        interrupted = actix_rt::signal::ctrl_c() => interrupted,
        _ = terminate.recv() => Ok(()),
    }
}

fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}
