//! `actix-outbox enqueue`: insert one event, for demos and scripts.

use clap::Args;

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{CliError, DatabaseArgs, connect, parse_json};
use actix_outbox::{NewEvent, StoreError};
use diesel::IntoSql;
use diesel::sql_types::Timestamptz;
use diesel_async::{AsyncConnection, RunQueryDsl};

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Insert one event into the outbox, as a producer would, and print its id (only the id, so that \
    scripts can capture it). A payload that is not JSON is refused and nothing is inserted.\n\n\
    --not-before TIME or --delay DURATION schedules it: no dispatcher publishes it before then (the \
    database's clock). Until then `stats` counts it as scheduled, not as backlog. Under the FIFO gate \
    it holds its aggregate's later events back until it is published.";

/// Arguments of `actix-outbox enqueue`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  actix-outbox enqueue --aggregate-type order --aggregate-id 42 \\\n      \
                  --event-type order.created --payload '{\"total\": 10}'\n  17\n  \
                  actix-outbox enqueue --aggregate-type order --aggregate-id 42 \\\n      \
                  --event-type order.payment_reminder --payload '{}' --delay 30m\n  18")]
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
    /// Publish it no earlier than this time, RFC 3339 (2026-12-24T18:00:00Z, or with an offset)
    #[arg(long, value_name = "TIME", value_parser = parse_time, conflicts_with = "delay")]
    pub not_before: Option<DateTime<Utc>>,
    /// Publish it no earlier than this long from now, by the database's clock (90s, 30m, 2h, 1day)
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub delay: Option<Duration>,
}

/// Parses `--not-before`.
fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("not an RFC 3339 time ({e}); e.g. 2026-12-24T18:00:00Z or 2026-12-24T19:00:00+01:00"))
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
    if let Some(at) = args.not_before {
        event = event.not_before(at);
    }
    let delay = match args.delay.map(chrono::Duration::from_std).transpose() {
        Ok(delay) => delay,
        Err(_) => return Err(CliError::BadInput("--delay is too long".into())),
    };
    // In a transaction, as a producer's insert is, so that it works through a transaction pooler.
    let transaction = conn.transaction::<_, StoreError, _>(async |tx| {
        let event = match delay {
            Some(delay) => {
                // The database's clock, which the claim compares `available_at` with.
                let now: DateTime<Utc> =
                    diesel::select(diesel::dsl::now.into_sql::<Timestamptz>()).get_result(tx).await?;
                let at = now
                    .checked_add_signed(delay)
                    .ok_or_else(|| StoreError::InvalidEvent("--delay reaches past the latest time there is".into()))?;
                event.clone().not_before(at)
            }
            None => event.clone(),
        };
        actix_outbox::enqueue(tx, &event).await
    });
    let id = args.database.answered(&url, transaction).await?.map_err(|e| CliError::store(&url, e))?;
    println!("{id}");
    Ok(())
}
