//! `actix-outbox erase`: remove one aggregate's data, for a request to erase a person's data.
//!
//! The outbox's `done` and `dead` rows of the aggregate are deleted ([`actix_outbox::admin::erase`]),
//! and, where the database also holds the inbox's tables, the aggregate's strings are blanked
//! there and its ordered-consumer marks deleted ([`actix_outbox::inbox::erase_aggregate`]); both
//! in one transaction, so an erasure is all or nothing.

use std::time::{Duration, Instant};

use clap::Args;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use serde::Serialize;

use crate::{CliError, DatabaseArgs, connect};
use actix_outbox::admin::{EraseError, Erasure};
use actix_outbox::inbox::InboxErasure;

/// How long `--wait` sleeps between two tries.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Erase one aggregate's data (a request to erase a person's data): delete its done and dead \
    outbox rows, and, if the database also has the inbox's tables, blank its aggregate type and id \
    in the inbox (the message keys stay, so redelivered copies are still duplicates) and delete its \
    ordered-consumer marks. All in one transaction.\n\n\
    Rows are deleted, not redacted: a redacted row still carries the aggregate id, headers and \
    last_error, and a dead row's only use, repair, would publish the data again.\n\n\
    While any row of the aggregate is pending or processing, nothing is erased and the command \
    exits 1 with the counts: wait until the rows are done (under the FIFO gate a dead head holds \
    later rows back: retry or skip it first), or pass --wait to try again every 500ms for that long.\n\n\
    It cannot reach messages already in queues or dead-letter queues, consumers' own tables, \
    backups, WAL archives, replicas, or logs.\n\n\
    --json prints one object: {\"aggregate_type\": text, \"aggregate_id\": text, \"done\": n, \"dead\": n, \
    \"inbox\": {\"anonymised\": n, \"marks_deleted\": n} or null when there is no inbox, \
    \"reason\": text or null}";

/// Arguments of `actix-outbox erase`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Example:\n  actix-outbox erase --aggregate order/42 --reason 'erasure request 2026-118'\n  \
                  erased order/42: 3 done rows, 1 dead row deleted; inbox: 2 rows anonymised, 1 order mark deleted\n  \
                  reason: erasure request 2026-118")]
pub struct EraseArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The aggregate to erase, as TYPE/ID (split at the first '/')
    #[arg(long, value_name = "TYPE/ID", value_parser = parse_aggregate)]
    pub aggregate: Aggregate,
    /// Why it is erased (printed with the result, for the operator's records)
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
    /// While rows are in flight, try again every 500ms for this long, e.g. 30s, 5m
    #[arg(long, value_name = "DURATION")]
    pub wait: Option<humantime::Duration>,
    /// Print one JSON object instead of a sentence
    #[arg(long)]
    pub json: bool,
}

/// An aggregate, `TYPE/ID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aggregate {
    /// The aggregate type (before the first '/').
    pub aggregate_type: String,
    /// The aggregate id (after it; may contain '/').
    pub aggregate_id: String,
}

fn parse_aggregate(s: &str) -> Result<Aggregate, String> {
    match s.split_once('/') {
        Some((t, id)) if !t.is_empty() && !id.is_empty() => {
            Ok(Aggregate { aggregate_type: t.to_owned(), aggregate_id: id.to_owned() })
        }
        _ => Err(format!("expected TYPE/ID with neither part empty, e.g. order/42, got {s:?}")),
    }
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Report<'a> {
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    done: u64,
    dead: u64,
    inbox: Option<InboxErasure>,
    reason: Option<&'a str>,
}

pub(super) async fn erase(args: EraseArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    let Aggregate { aggregate_type, aggregate_id } = &args.aggregate;
    let deadline = args.wait.map(|w| Instant::now() + Duration::from(w));
    let (outbox, inbox) = loop {
        match args.database.answered(&url, erase_once(&mut conn, aggregate_type, aggregate_id)).await? {
            Ok(done) => break done,
            Err(e @ EraseError::InFlight { .. }) => match deadline {
                Some(deadline) if Instant::now() + RETRY_EVERY <= deadline => tokio::time::sleep(RETRY_EVERY).await,
                Some(_) => {
                    let waited = args.wait.expect("a deadline comes from --wait");
                    return Err(CliError::Failed(format!(
                        "{aggregate_type}/{aggregate_id}: after waiting {waited}: {e}"
                    )));
                }
                None => return Err(CliError::Failed(format!("{aggregate_type}/{aggregate_id}: {e}"))),
            },
            Err(EraseError::Store(e)) => return Err(CliError::store(&url, e)),
            Err(e) => return Err(CliError::Failed(e.to_string())),
        }
    };
    if args.json {
        let report = Report {
            aggregate_type,
            aggregate_id,
            done: outbox.done,
            dead: outbox.dead,
            inbox,
            reason: args.reason.as_deref(),
        };
        println!("{}", serde_json::to_string(&report).expect("erasure serializes"));
    } else {
        println!("{}", render(&args.aggregate, &outbox, inbox.as_ref()));
        if let Some(reason) = &args.reason {
            println!("reason: {reason}");
        }
    }
    Ok(())
}

/// One try, in one transaction: the outbox, then the inbox if the database has one.
async fn erase_once(
    conn: &mut AsyncPgConnection,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<(Erasure, Option<InboxErasure>), EraseError> {
    conn.transaction(async |c| {
        let outbox = actix_outbox::admin::erase(c, aggregate_type, aggregate_id).await?;
        let inbox = if actix_outbox::inbox::has_inbox_tables(c).await? {
            Some(actix_outbox::inbox::erase_aggregate(c, aggregate_type, aggregate_id).await?)
        } else {
            None
        };
        Ok((outbox, inbox))
    })
    .await
}

/// `erased order/42: 3 done rows, 1 dead row deleted; inbox: 2 rows anonymised, 1 order mark deleted`.
fn render(aggregate: &Aggregate, outbox: &Erasure, inbox: Option<&InboxErasure>) -> String {
    let plural = |n: u64, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    let mut out = format!(
        "erased {}/{}: {}, {} deleted",
        aggregate.aggregate_type,
        aggregate.aggregate_id,
        plural(outbox.done, "done row", "done rows"),
        plural(outbox.dead, "dead row", "dead rows"),
    );
    if let Some(inbox) = inbox {
        out += &format!(
            "; inbox: {} anonymised, {} deleted",
            plural(inbox.anonymised, "row", "rows"),
            plural(inbox.marks_deleted, "order mark", "order marks"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregates_split_at_the_first_slash_and_need_both_parts() {
        let agg = parse_aggregate("order/42/a").unwrap();
        assert_eq!((agg.aggregate_type.as_str(), agg.aggregate_id.as_str()), ("order", "42/a"));
        for bad in ["order", "/42", "order/", "/", ""] {
            assert!(parse_aggregate(bad).is_err(), "{bad:?}");
        }
    }
}
