//! `actix-outbox dead list|retry|skip`: inspect dead rows and send them on their way.
//!
//! `retry` and `skip` are all or nothing: they run in one transaction and roll back when any id
//! given is not a dead row, so a typo never half-applies a repair.

use clap::{Args, Subcommand};
use diesel_async::AsyncConnection;
use serde::Serialize;

use super::{CliError, DatabaseArgs, DatabaseUrl, connect, distinct, id_list};
use crate::error::StoreError;
use crate::model::OutboxRow;
use crate::store;

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
    let mut rows = store::dead_list(&mut conn, args.limit + 1).await.map_err(|e| CliError::store(&url, e))?;
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
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            [
                r.id.to_string(),
                format!("{}/{}", r.aggregate_type, r.aggregate_id),
                r.event_type.clone(),
                r.attempts.to_string(),
                r.created_at.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string(),
                r.last_error.as_deref().unwrap_or("").replace(['\n', '\r'], " "),
            ]
        })
        .collect();
    let header = ["ID", "AGGREGATE", "EVENT TYPE", "ATTEMPTS", "CREATED AT", "LAST ERROR"];
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut s = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i == 5 {
                s += cell;
            } else if i == 0 || i == 3 {
                s += &format!("{cell:>w$}  ", w = widths[i]);
            } else {
                s += &format!("{cell:<w$}  ", w = widths[i]);
            }
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in &cells {
        out += &line([&row[0], &row[1], &row[2], &row[3], &row[4], &row[5]]);
    }
    out
}

pub(super) async fn retry(args: DeadRetryArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    if args.all {
        let ids = store::dead_retry_all(&mut conn).await.map_err(|e| CliError::store(&url, e))?;
        println!("retried {} (now pending, attempts reset)", rows(ids.len()));
        return Ok(());
    }
    let ids = distinct(&args.ids);
    let changed = all_or_nothing(&mut conn, &url, &ids, Repair::Retry).await?;
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
    let ids = distinct(&args.ids);
    let changed = all_or_nothing(&mut conn, &url, &ids, Repair::Skip { reason }).await?;
    println!("skipped {} (now done): {}", rows(changed.len()), id_list(&changed));
    Ok(())
}

/// Why an all-or-nothing repair rolled back.
enum Rollback {
    NotDead(Vec<i64>),
    Store(StoreError),
}

impl From<diesel::result::Error> for Rollback {
    fn from(e: diesel::result::Error) -> Self {
        Rollback::Store(StoreError::Query(e))
    }
}

/// What an all-or-nothing repair does to each dead row.
#[derive(Clone, Copy)]
enum Repair<'a> {
    /// Back to pending.
    Retry,
    /// Done without publishing.
    Skip { reason: &'a str },
}

/// Applies `repair` to `ids` in one transaction, and rolls it back unless every one of them was
/// a dead row (the store's repairs touch dead rows only and return the ids they changed).
async fn all_or_nothing(
    conn: &mut diesel_async::AsyncPgConnection,
    url: &DatabaseUrl,
    ids: &[i64],
    repair: Repair<'_>,
) -> Result<Vec<i64>, CliError> {
    let outcome = conn
        .transaction(async |tx| {
            let changed = match repair {
                Repair::Retry => store::dead_retry(tx, ids).await,
                Repair::Skip { reason } => store::dead_skip(tx, ids, reason).await,
            };
            let mut changed = changed.map_err(Rollback::Store)?;
            changed.sort_unstable();
            let not_dead: Vec<i64> = ids.iter().copied().filter(|id| changed.binary_search(id).is_err()).collect();
            if not_dead.is_empty() { Ok(changed) } else { Err(Rollback::NotDead(not_dead)) }
        })
        .await;
    match outcome {
        Ok(changed) => Ok(changed),
        Err(Rollback::NotDead(ids)) => Err(CliError::BadInput(format!(
            "not a dead row: {} (no row changed; `actix-outbox dead list` shows the dead ones)",
            id_list(&ids)
        ))),
        Err(Rollback::Store(e)) => Err(CliError::store(url, e)),
    }
}

/// `1 dead row`, `2 dead rows`.
fn rows(n: usize) -> String {
    if n == 1 { "1 dead row".to_owned() } else { format!("{n} dead rows") }
}
