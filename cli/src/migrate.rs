//! `actix-outbox migrate`: create the database if it is missing, apply pending migrations.

use clap::Args;

use crate::{CliError, DatabaseArgs};

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Create the database named in the URL if it does not exist (through the server's `postgres` \
    database), then apply the migrations this binary carries that are not applied yet, and say \
    what was done. Safe to run again: with nothing pending it changes nothing.";

/// Arguments of `actix-outbox migrate`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Example:\n  actix-outbox migrate --database-url postgres://app:secret@db:5432/app\n  \
                  applied migration 00000000000001")]
pub struct MigrateArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
}

pub(super) async fn migrate(args: MigrateArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let database = url.database().unwrap_or_default().to_owned();
    if actix_outbox::ensure_database(url.expose()).await.map_err(|e| CliError::store(&url, e))? {
        println!("created database {database}");
    }
    let applied = actix_outbox::migrate(url.expose()).await.map_err(|e| CliError::store(&url, e))?;
    if applied.is_empty() {
        println!("database {database} is up to date: no pending migrations");
    }
    for version in applied {
        println!("applied migration {version}");
    }
    Ok(())
}
