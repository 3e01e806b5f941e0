//! `actix-outbox enqueue`: insert one event, for demos and scripts.

use clap::Args;

use crate::{CliError, DatabaseArgs, connect, parse_json};
use actix_outbox::NewEvent;
use diesel_async::AsyncConnection;

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Insert one event into the outbox, as a producer would, and print its id (only the id, so that \
    scripts can capture it). A payload that is not JSON is refused and nothing is inserted.";

/// Arguments of `actix-outbox enqueue`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Example:\n  actix-outbox enqueue --aggregate-type order --aggregate-id 42 \\\n      \
                  --event-type order.created --payload '{\"total\": 10}'\n  17")]
pub struct EnqueueArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Kind of aggregate, e.g. order
    #[arg(long, value_name = "T")]
    pub aggregate_type: String,
    /// The aggregate instance, e.g. 42
    #[arg(long, value_name = "A")]
    pub aggregate_id: String,
    /// The event type, e.g. order.created (the default routing key)
    #[arg(long, value_name = "E")]
    pub event_type: String,
    /// The event body, a JSON document
    #[arg(long, value_name = "JSON", value_parser = parse_json)]
    pub payload: serde_json::Value,
    /// Publish it with this routing key instead of the dispatcher's (at most 255 bytes)
    #[arg(long, value_name = "KEY")]
    pub routing_key: Option<String>,
    /// Publish it to this exchange instead of the dispatcher's (it must exist; until it does,
    /// the event is retried)
    #[arg(long, value_name = "NAME")]
    pub exchange: Option<String>,
}

pub(super) async fn enqueue(args: EnqueueArgs) -> Result<(), CliError> {
    for (flag, value) in [
        ("--aggregate-type", &args.aggregate_type),
        ("--aggregate-id", &args.aggregate_id),
        ("--event-type", &args.event_type),
    ] {
        if value.trim().is_empty() {
            return Err(CliError::BadInput(format!("{flag} must not be empty")));
        }
    }
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    let mut event = NewEvent::new(args.aggregate_type, args.aggregate_id, args.event_type, args.payload);
    if let Some(key) = args.routing_key {
        event = event.routing_key(key);
    }
    if let Some(name) = args.exchange {
        event = event.exchange(name);
    }
    // In a transaction, as a producer's insert is, so that it works through a transaction pooler.
    let id = args
        .database
        .answered(&url, conn.transaction(async |tx| actix_outbox::enqueue(tx, &event).await))
        .await?
        .map_err(|e| CliError::store(&url, e))?;
    println!("{id}");
    Ok(())
}
