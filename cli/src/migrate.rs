//! `actix-outbox migrate`: create the database if it is missing, apply pending migrations (the
//! outbox's, or with `--inbox` the consumer-side inbox's).

use clap::Args;

use crate::{CliError, DatabaseArgs};

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Create the database named in the URL if it does not exist (through the server's `postgres` \
    database), then apply the migrations this binary carries that are not applied yet, and say \
    what was done. Safe to run again: with nothing pending it changes nothing.\n\n\
    By default it installs the outbox (the producer's tables). With --inbox it installs only the \
    inbox instead: the tables of the consumer side (`inbox` and `inbox_aggregates`), for the \
    database of a service that consumes the messages. The two sets have distinct versions in the \
    one migrations table, so either can be applied first, and a database can hold both.\n\n\
    With --schema NAME it creates the schema if it is missing and installs the tables (and the \
    migrations table) in it: one outbox a schema, e.g. one a tenant, for a relay that serves \
    several (`run --outbox`).";

/// Arguments of `actix-outbox migrate`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  actix-outbox migrate --database-url postgres://app:secret@db:5432/app\n  \
                  applied migration 20261130000001\n  ...\n  \
                  actix-outbox migrate --inbox --database-url postgres://billing:secret@db:5432/billing\n  \
                  applied migration 20261201900001\n  \
                  actix-outbox migrate --fifo --database-url postgres://app:secret@db:5432/app\n  \
                  database app is up to date: no pending migrations\n  \
                  built the FIFO gate's index outbox_fifo_gate\n  \
                  actix-outbox migrate --schema tenant_a --database-url postgres://app:secret@db:5432/app\n  \
                  created schema tenant_a\n  applied migration 20261130000001\n  ...")]
pub struct MigrateArgs {
    /// Where the outbox (or, with --inbox, the inbox) lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Install only the consumer side's inbox tables (for a consuming service's database), not the outbox
    #[arg(long, conflicts_with = "fifo")]
    pub inbox: bool,
    /// Also build the FIFO gate's index (for dispatchers that run with --fifo)
    #[arg(long)]
    pub fifo: bool,
}

pub(super) async fn migrate(args: MigrateArgs) -> Result<(), CliError> {
    let url = args.database.url()?;
    let database = url.database().unwrap_or_default().to_owned();
    if actix_outbox::admin::ensure_database(url.expose()).await.map_err(|e| CliError::store(&url, e))? {
        println!("created database {database}");
    }
    if let Some(schema) = &args.database.schema {
        let created = actix_outbox::admin::ensure_schema(url.expose(), schema).await;
        if created.map_err(|e| CliError::store(&url, e))? {
            println!("created schema {schema}");
        }
    }
    let applied = if args.inbox {
        actix_outbox::inbox::migrate_inbox(url.expose()).await
    } else {
        actix_outbox::migrate(url.expose()).await
    };
    let applied = applied.map_err(|e| CliError::store(&url, e))?;
    if applied.is_empty() {
        let which = if args.inbox { "inbox " } else { "" };
        println!("database {database} is up to date: no pending {which}migrations");
    }
    for version in applied {
        println!("applied migration {version}");
    }
    if args.fifo {
        let Some(url) = args.database.session_url()? else {
            return Err(CliError::BadInput(
                "--fifo behind a transaction pooler needs --direct-url: the index build holds a session of its own \
                 (a session lock, CREATE INDEX CONCURRENTLY); the migrations were applied"
                    .into(),
            ));
        };
        let mut conn = actix_outbox::admin::connect(url.expose()).await.map_err(|e| CliError::store(&url, e))?;
        let built = actix_outbox::admin::ensure_fifo_index(&mut conn).await.map_err(|e| CliError::store(&url, e))?;
        println!(
            "{}",
            if built { "built the FIFO gate's index outbox_fifo_gate" } else { "the FIFO gate's index is there" }
        );
    }
    Ok(())
}
