//! `actix-outbox stats`: what the outbox looks like right now.

use std::time::Duration;

use clap::Args;

use super::{CliError, DatabaseArgs, connect};
use crate::model::Status;
use crate::store::{self, Stats};

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Show rows by status, the age of the oldest unfinished (pending or processing) row, \
    processing rows whose lease has expired (a worker died or stalled), and how many attempts \
    the unfinished rows have spent. All times come from the database clock.\n\n\
    --json prints one object: {\"by_status\": {\"pending\": n, \"processing\": n, \"done\": n, \
    \"dead\": n}, \"oldest_unfinished_age_s\": number or null, \"expired_leases\": n, \
    \"attempts\": {\"1\": n, ...}}";

/// Arguments of `actix-outbox stats`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  actix-outbox stats\n  actix-outbox stats --json | jq .by_status.dead")]
pub struct StatsArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Print one JSON object instead of a table
    #[arg(long)]
    pub json: bool,
}

pub(super) async fn stats(args: StatsArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    let stats = store::stats(&mut conn).await.map_err(|e| CliError::store(&url, e))?;
    if args.json {
        println!("{}", serde_json::to_string(&stats).expect("stats serialize"));
    } else {
        print!("{}", render(&stats));
    }
    Ok(())
}

/// The human form: one fact a line, numbers aligned.
fn render(stats: &Stats) -> String {
    let mut out = String::from("rows by status\n");
    // Lifecycle order, not the map's alphabetical one.
    for status in Status::ALL.map(Status::as_str) {
        let n = stats.by_status.get(status).copied().unwrap_or(0);
        out += &format!("  {status:<12}{n:>10}\n");
    }
    let oldest = match stats.oldest_unfinished_age_s {
        Some(secs) => format!("{} ago", humantime::format_duration(Duration::from_secs(secs.max(0.0) as u64))),
        None => "none (nothing pending or processing)".to_owned(),
    };
    out += &format!("oldest unfinished row   {oldest}\n");
    out += &format!("expired leases          {}\n", stats.expired_leases);
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
