//! `actix-outbox purge`: delete old `done` rows without locking the table for long.

use clap::Args;

use crate::{CliError, DatabaseArgs, connect};

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Delete `done` rows whose done_at is older than --older-than (database clock), walking the \
    table by id --batch rows per statement so that no statement holds many row locks for long, and \
    say how many were deleted. Pending, processing and dead rows are never touched. `run` prunes \
    done rows by itself (--retention); this is for one-off use.";

/// Arguments of `actix-outbox purge`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Example:\n  actix-outbox purge --older-than 7d\n  purged 48213 done rows older than 7days")]
pub struct PurgeArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Age of the done rows to delete, e.g. 500ms, 60s, 5m, 7d
    #[arg(long, value_name = "DURATION")]
    pub older_than: humantime::Duration,
    /// Rows read (and their expired done rows deleted) per statement
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
    pub batch: i64,
}

pub(super) async fn purge(args: PurgeArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let mut conn = connect(&url).await?;
    // A batch a statement, each within --query-timeout: a long purge is many short statements.
    let mut deleted = 0;
    let mut after = 0;
    loop {
        let batch = actix_outbox::admin::purge_done_batch(&mut conn, args.older_than.into(), after, args.batch);
        let stretch = args.database.answered(&url, batch).await?.map_err(|e| CliError::store(&url, e))?;
        deleted += stretch.deleted;
        match stretch.next {
            Some(next) => after = next,
            None => break,
        }
    }
    println!("purged {deleted} done rows older than {}", args.older_than);
    Ok(())
}
