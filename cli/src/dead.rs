//! `actix-outbox dead list|retry|skip|blocked`: inspect dead rows, send them on their way, and
//! see which aggregates they hold back under the FIFO gate.
//!
//! `retry` and `skip` are all or nothing: they run in one transaction and roll back when any id
//! given is not a dead row, so a typo never half-applies a repair.

use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{CliError, DatabaseArgs, FifoArgs, connect, id_list, table, truncate};
use actix_outbox::ConnectionString;
use actix_outbox::Fifo;
use actix_outbox::admin::{BlockedAggregate, OutboxRow};
use actix_outbox_console::repair::{Repair, RepairError};
use actix_outbox_console::report::BlockedView;

/// `--help` text.
pub(super) const LIST_LONG_ABOUT: &str = "List dead rows, oldest first: id, aggregate (type/id), event type, attempts, created_at and \
    last_error. A dead row is one the dispatcher gave up on (attempts exhausted, a permanent \
    failure, or a lease that expired on the last attempt); with FIFO on, it also blocks the rest \
    of its aggregate until it is retried or skipped.\n\n\
    --json prints one array of objects with the keys id, aggregate_type, aggregate_id, \
    event_type, attempts, last_error, created_at and payload.";

/// `--help` text.
pub(super) const RETRY_LONG_ABOUT: &str = "Send dead rows back to pending with their attempts reset to 0, claimable at once. Either list \
    the ids or pass --all. With ids, all of them must be dead rows: if any is not, nothing is \
    changed and the command exits 2 naming the ids at fault.";

/// `--help` text.
pub(super) const SKIP_LONG_ABOUT: &str = "Mark dead rows done without publishing them. last_error records `skipped by operator: <reason>` \
    followed by the error that killed the row. All ids must be dead rows: if any is not, nothing is \
    changed and the command exits 2 naming the ids at fault.";

/// `--help` text.
pub(super) const BLOCKED_LONG_ABOUT: &str = "List the aggregates the per-aggregate FIFO gate holds back, oldest dead head first: the \
    aggregate (type/id), its dead head (the dead row to retry or skip: id, event type, attempts, \
    created_at, last_error) and how many unfinished rows wait behind it.\n\n\
    Whether a dead row blocks anything depends on the gate the dispatchers run with, which this \
    command cannot know: pass the same --fifo as `actix-outbox run`. Without --fifo every event \
    type is taken as gated (as `run --fifo`); with --fifo TYPES only dead rows of those types \
    block, and only rows of those types wait.\n\n\
    Unblock an aggregate with `actix-outbox dead retry DEAD_ID` (the head goes back to pending \
    and is published again, then the rows behind it) or `actix-outbox dead skip DEAD_ID --reason \
    TEXT` (the head is marked done without publishing; the next row becomes the head).\n\n\
    --json prints one array of objects with the keys aggregate_type, aggregate_id, dead_id, \
    event_type, last_error, attempts, created_at and waiting.";

/// What `dead blocked` and `stats --fifo` tell an operator to do about a blocked aggregate.
const UNBLOCK_HINT: &str = "unblock an aggregate with `actix-outbox dead retry DEAD_ID` (publish its head again) or \
    `actix-outbox dead skip DEAD_ID --reason TEXT` (give the head up); the rows waiting behind it then follow in order";

/// `actix-outbox dead ...`.
#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// List dead rows, oldest first.
    #[command(long_about = LIST_LONG_ABOUT)]
    List(DeadListArgs),
    /// Send dead rows back to pending: attempts reset, claimable now.
    #[command(long_about = RETRY_LONG_ABOUT)]
    Retry(DeadRetryArgs),
    /// Mark dead rows done without publishing them, recording why.
    #[command(long_about = SKIP_LONG_ABOUT)]
    Skip(DeadSkipArgs),
    /// List the aggregates a dead head holds back under the FIFO gate.
    #[command(long_about = BLOCKED_LONG_ABOUT)]
    Blocked(DeadBlockedArgs),
}

/// Arguments of `actix-outbox dead list`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Examples:\n  actix-outbox dead list\n  actix-outbox dead list --json --limit 1000 | jq '.[].id'"
)]
pub struct DeadListArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
    /// Show at most N rows
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
    pub limit: i64,
}

/// Arguments of `actix-outbox dead retry`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Examples:\n  actix-outbox dead retry 41 42\n  retried 2 dead rows (now pending, attempts reset): 41, 42\n  \
                  actix-outbox dead retry --all"
)]
pub struct DeadRetryArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Ids of the dead rows to retry
    #[arg(value_name = "ID", required_unless_present = "all", conflicts_with = "all")]
    pub ids: Vec<i64>,
    /// Retry every dead row
    #[arg(long)]
    pub all: bool,
}

/// Arguments of `actix-outbox dead skip`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Example:\n  actix-outbox dead skip 41 --reason 'order 42 was cancelled by hand, see INC-1234'\n  \
                  skipped 1 dead row (now done): 41"
)]
pub struct DeadSkipArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Ids of the dead rows to skip
    #[arg(value_name = "ID", required = true)]
    pub ids: Vec<i64>,
    /// Why they are skipped (kept in last_error)
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
}

/// Arguments of `actix-outbox dead blocked`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Examples:\n  actix-outbox dead blocked --fifo\n  \
                  actix-outbox dead blocked --fifo order.created,order.paid --json | jq '.[].dead_id'",
    mut_arg("fifo", |a| a.required(true).help(
        "The gate the dispatchers run with: the listed event types (comma-separated), or all event types \
         when none is listed. Required: a dispatcher without --fifo blocks nothing"
    ))
)]
pub struct DeadBlockedArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The FIFO gate to look under.
    #[command(flatten)]
    pub fifo: FifoArgs,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
    /// Show at most N aggregates
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
    pub limit: i64,
}

/// One dead row as `dead list --json` prints it.
#[derive(Serialize)]
struct DeadRow<'a> {
    id: i64,
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_type: &'a str,
    attempts: i32,
    last_error: Option<&'a str>,
    created_at: chrono::DateTime<chrono::Utc>,
    payload: &'a serde_json::Value,
}

impl<'a> From<&'a OutboxRow> for DeadRow<'a> {
    fn from(r: &'a OutboxRow) -> Self {
        DeadRow {
            id: r.id,
            aggregate_type: &r.aggregate_type,
            aggregate_id: &r.aggregate_id,
            event_type: &r.event_type,
            attempts: r.attempts,
            last_error: r.last_error.as_deref(),
            created_at: r.created_at,
            payload: &r.payload,
        }
    }
}

pub(super) async fn list(args: DeadListArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    // One row more than asked tells whether the list was cut.
    let mut rows = args
        .database
        .answered(&url, actix_outbox::admin::dead_list(&mut conn, args.limit + 1))
        .await?
        .map_err(|e| CliError::store(&url, e))?;
    let more = rows.len() as i64 > args.limit;
    rows.truncate(args.limit as usize);
    if args.json {
        let rows: Vec<DeadRow<'_>> = rows.iter().map(DeadRow::from).collect();
        println!("{}", serde_json::to_string(&rows).expect("rows serialize"));
        return Ok(());
    }
    if rows.is_empty() {
        println!("no dead rows");
        return Ok(());
    }
    print!("{}", render(&rows));
    if more {
        println!("(first {} dead rows shown; there are more: raise --limit)", args.limit);
    }
    Ok(())
}

/// A table whose last column, the error, is as long as it needs to be (on one line).
fn render(rows: &[OutboxRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.id.to_string(),
                format!("{}/{}", r.aggregate_type, r.aggregate_id),
                r.event_type.clone(),
                r.attempts.to_string(),
                timestamp(r.created_at),
                r.last_error.as_deref().unwrap_or("").replace(['\n', '\r'], " "),
            ]
        })
        .collect();
    table("", &["ID", "AGGREGATE", "EVENT TYPE", "ATTEMPTS", "CREATED AT", "LAST ERROR"], &cells, &[0, 3])
}

/// A time in the tables: UTC, to the millisecond.
fn timestamp(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

pub(super) async fn blocked(args: DeadBlockedArgs) -> Result<(), CliError> {
    let fifo = args.fifo.fifo()?;
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    let view = args
        .database
        .answered(&url, BlockedView::read(&mut conn, &fifo, args.limit))
        .await?
        .map_err(|e| CliError::store(&url, e))?;
    if args.json {
        println!("{}", serde_json::to_string(&view.blocked_aggregates).expect("blocked aggregates serialize"));
        return Ok(());
    }
    if view.blocked_aggregates.is_empty() {
        println!("no blocked aggregates (FIFO on {fifo})");
        return Ok(());
    }
    let n = view.blocked_aggregates_total;
    println!(
        "{n} {} by a dead head (FIFO on {fifo}), oldest first:",
        if n == 1 { "aggregate blocked" } else { "aggregates blocked" }
    );
    print!("{}", render_blocked(&view.blocked_aggregates));
    if n > view.blocked_aggregates.len() as i64 {
        println!("(first {} shown; raise --limit for the rest)", view.blocked_aggregates.len());
    }
    println!("{UNBLOCK_HINT}");
    Ok(())
}

/// `dead blocked`'s table: every detail of the head, the error whole (on one line).
fn render_blocked(blocked: &[BlockedAggregate]) -> String {
    let cells: Vec<Vec<String>> = blocked
        .iter()
        .map(|b| {
            vec![
                format!("{}/{}", b.aggregate_type, b.aggregate_id),
                b.dead_id.to_string(),
                b.event_type.clone(),
                b.waiting.to_string(),
                b.attempts.to_string(),
                timestamp(b.created_at),
                b.last_error.as_deref().unwrap_or("").replace(['\n', '\r'], " "),
            ]
        })
        .collect();
    let header = ["AGGREGATE", "DEAD ID", "EVENT TYPE", "WAITING", "ATTEMPTS", "CREATED AT", "LAST ERROR"];
    table("", &header, &cells, &[1, 3, 4])
}

/// The blocked-aggregates section of the `stats` table: the first few, the error cut short,
/// and what to do about them.
pub(super) fn render_blocked_summary(view: &BlockedView, fifo: &Fifo, error_width: usize) -> String {
    let total = view.blocked_aggregates_total;
    let mut out = format!("{:<24}{total} (FIFO on {fifo})\n", "blocked aggregates");
    if view.blocked_aggregates.is_empty() {
        return out;
    }
    let cells: Vec<Vec<String>> = view
        .blocked_aggregates
        .iter()
        .map(|b| {
            vec![
                format!("{}/{}", b.aggregate_type, b.aggregate_id),
                b.dead_id.to_string(),
                b.event_type.clone(),
                b.waiting.to_string(),
                truncate(b.last_error.as_deref().unwrap_or(""), error_width),
            ]
        })
        .collect();
    out += &table("  ", &["AGGREGATE", "DEAD ID", "EVENT TYPE", "WAITING", "LAST ERROR"], &cells, &[1, 3]);
    let shown = view.blocked_aggregates.len();
    if total > shown as i64 {
        out += &format!(
            "  (first {shown} shown; `actix-outbox dead blocked --limit N` with the same --fifo lists more)\n"
        );
    }
    out += &format!("  {UNBLOCK_HINT}\n");
    out
}

pub(super) async fn retry(args: DeadRetryArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    if args.all {
        let ids = args
            .database
            .answered(&url, actix_outbox::admin::dead_retry_all(&mut conn))
            .await?
            .map_err(|e| CliError::store(&url, e))?;
        println!("retried {} (now pending, attempts reset)", rows(ids.len()));
        return Ok(());
    }
    let changed = args.database.answered(&url, all_or_nothing(&mut conn, &url, &args.ids, Repair::Retry)).await??;
    println!("retried {} (now pending, attempts reset): {}", rows(changed.len()), id_list(&changed));
    Ok(())
}

pub(super) async fn skip(args: DeadSkipArgs) -> Result<(), CliError> {
    let reason = args.reason.trim();
    if reason.is_empty() {
        return Err(CliError::BadInput("--reason must not be empty: say why the rows are skipped".into()));
    }
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    let changed =
        args.database.answered(&url, all_or_nothing(&mut conn, &url, &args.ids, Repair::Skip { reason })).await??;
    println!("skipped {} (now done): {}", rows(changed.len()), id_list(&changed));
    Ok(())
}

/// Applies `repair` to `ids`, all or nothing ([`actix_outbox_console::repair::all_or_nothing`],
/// which the web console's repair forms run too).
async fn all_or_nothing(
    conn: &mut diesel_async::AsyncPgConnection,
    url: &ConnectionString,
    ids: &[i64],
    repair: Repair<'_>,
) -> Result<Vec<i64>, CliError> {
    match actix_outbox_console::repair::all_or_nothing(conn, ids, repair).await {
        Ok(changed) => Ok(changed),
        Err(RepairError::NotDead(ids)) => Err(CliError::BadInput(format!(
            "not a dead row: {} (no row changed; `actix-outbox dead list` shows the dead ones)",
            id_list(&ids)
        ))),
        Err(RepairError::Store(e)) => Err(CliError::store(url, e)),
        Err(e) => Err(CliError::Failed(e.to_string())),
    }
}

/// `1 dead row`, `2 dead rows`.
fn rows(n: usize) -> String {
    if n == 1 { "1 dead row".to_owned() } else { format!("{n} dead rows") }
}
