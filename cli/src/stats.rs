//! `actix-outbox stats`: what the outbox looks like right now.
//!
//! With `--fifo`, also the aggregates a dead head holds back under that gate (the first
//! [`BLOCKED_SHOWN`] and their total). The JSON is [`StatsReport`], which the web console's
//! `/api/stats` answers too. Without it they are left out, JSON keys included: the
//! gate is a setting of the dispatchers (`run --fifo`), not of the table, so `stats` cannot
//! know it; and under no gate a dead row blocks nothing, so an empty list would be a claim
//! `stats` cannot make either.

use std::time::Duration;

use clap::Args;

use crate::dead::render_blocked_summary;
use crate::{CliError, DatabaseArgs, FifoArgs, connect};
use actix_outbox::admin::{Stats, Status};
#[cfg(doc)]
use actix_outbox_console::report::BLOCKED_SHOWN;
use actix_outbox_console::report::StatsReport;
/// Characters of a blocked head's last error the `stats` table keeps.
const ERROR_WIDTH: usize = 60;

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Show rows by status, the age of the oldest unfinished (pending or processing) row, \
    processing rows whose lease has expired (a worker died or stalled), and how many attempts \
    the unfinished rows have spent. All times come from the database clock.\n\n\
    Scheduled rows (pending rows a producer scheduled for later, `enqueue --not-before` or \
    `--delay`, not yet due) are counted apart: they are part of pending, but neither backlog nor \
    in the oldest unfinished row's age, which counts from when a row became due.\n\n\
    --json prints one object: {\"by_status\": {\"pending\": n, \"processing\": n, \"done\": n, \
    \"dead\": n}, \"scheduled\": n, \"oldest_unfinished_age_s\": number or null, \"expired_leases\": n, \
    \"attempts\": {\"1\": n, ...}, \"source\": \"SYSTEM_ID/DATABASE/SCHEMA.outbox\" or null}\n\n\
    --fifo [TYPES] adds the aggregates a dead head holds back under that FIFO gate (pass the \
    --fifo the dispatchers run with): the first 20, oldest dead head first, and their total; in \
    JSON the keys \"blocked_aggregates\" (objects as `actix-outbox dead blocked --json` prints \
    them) and \"blocked_aggregates_total\". Without --fifo they are left out: the gate is a \
    setting of the dispatchers, which stats cannot know.";

/// Arguments of `actix-outbox stats`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Examples:\n  actix-outbox stats\n  actix-outbox stats --json | jq .by_status.dead\n  \
                  actix-outbox stats --fifo order.created,order.paid --json | jq .blocked_aggregates_total",
    mut_arg("fifo", |a| a.help(
        "Also show the aggregates blocked under this FIFO gate (the dispatchers' --fifo: the listed event \
         types, or all when none is listed)"
    ))
)]
pub struct StatsArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,
    /// The FIFO gate under which to report blocked aggregates; none reported without it.
    #[command(flatten)]
    pub fifo: FifoArgs,
}

pub(super) async fn stats(args: StatsArgs) -> Result<(), CliError> {
    let fifo = args.fifo.fifo()?;
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    let report = args
        .database
        .answered(&url, StatsReport::read(&mut conn, &fifo))
        .await?
        .map_err(|e| CliError::store(&url, e))?;
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("stats serialize"));
    } else {
        print!("{}", render(&report.stats));
        if let Some(blocked) = &report.blocked {
            print!("{}", render_blocked_summary(blocked, &fifo, ERROR_WIDTH));
        }
    }
    Ok(())
}

/// The human form: one fact a line, numbers aligned.
fn render(stats: &Stats) -> String {
    let mut out = String::from("rows by status\n");
    // Lifecycle order, not the map's alphabetical one.
    for status in Status::ALL {
        let n = stats.by_status.get(status.as_str()).copied().unwrap_or(0);
        out += &format!("  {:<12}{n:>10}\n", status.as_str());
        if *status == Status::Pending {
            // A part of pending, indented under it: not a status of its own.
            out += &format!("    {:<10}{:>10}  (not due yet: not backlog)\n", "scheduled", stats.scheduled);
        }
    }
    let oldest = match stats.oldest_unfinished_age_s {
        Some(secs) => format!("{} ago", humantime::format_duration(Duration::from_secs(secs.max(0.0) as u64))),
        None => "none (nothing due is pending or processing)".to_owned(),
    };
    out += &format!("oldest unfinished row   {oldest}\n");
    out += &format!("expired leases          {}\n", stats.expired_leases);
    let source = stats.source.as_deref().unwrap_or("unknown (the role may not read the system identifier)");
    out += &format!("source                  {source}\n");
    out += "attempts of unfinished rows\n";
    if stats.attempts.is_empty() {
        out += "  (none)\n";
    }
    let mut attempts: Vec<_> = stats.attempts.iter().collect();
    // Keys are decimal strings: order them as numbers, not as text ("10" after "9").
    attempts.sort_by_key(|(a, _)| a.parse::<i64>().unwrap_or(i64::MAX));
    for (attempt, n) in attempts {
        out += &format!("  {attempt:<12}{n:>10}\n");
    }
    out
}
