//! Starting the dispatcher of one outbox: [`prepare`] checks it and opens its pool,
//! [`start_one`] starts its supervisor on a broker connection; [`Running`] is the outbox
//! being relayed.

use tracing::info;

use crate::{CliError, DatabaseArgs, connect, serve};
use actix_outbox::sink::RabbitSink;
use actix_outbox::{DispatcherConfig, OutboxSupervisor};

/// Database connections beyond one per worker: the finalizer's and a spare.
const EXTRA_CONNECTIONS: usize = 2;

/// One outbox ready to relay: checked, its source known, its pool open.
pub(super) struct Prepared {
    /// `SCHEMA.outbox` when the process relays several, else `None`.
    pub(super) name: Option<String>,
    pub(super) database: DatabaseArgs,
    pub(super) config: DispatcherConfig,
    pub(super) pool: actix_outbox::PgPool,
}

/// Checks the outbox `database` reaches (migrated), derives its source unless configured, and
/// opens its pool.
pub(super) async fn prepare(
    database: DatabaseArgs,
    config: &DispatcherConfig,
    name: Option<String>,
) -> Result<Prepared, CliError> {
    let url = database.url()?;
    let mut conn = connect(&url).await?;
    let pending = database
        .answered(&url, actix_outbox::admin::pending_migrations(url.expose()))
        .await?
        .map_err(|e| CliError::store(&url, e))?;
    if !pending.is_empty() {
        let schema = database.schema.as_deref().map(|s| format!(" --schema {s}")).unwrap_or_default();
        return Err(CliError::Failed(format!(
            "the database at {url} is not migrated ({} pending: {}); run `actix-outbox migrate{schema}` first",
            pending.len(),
            pending.join(", ")
        )));
    }
    let mut config = config.clone();
    if config.source.is_none() {
        let source = database.answered(&url, actix_outbox::admin::outbox_source(&mut conn)).await?;
        config.source = Some(source.map_err(|e| CliError::store(&url, e))?);
    }
    drop(conn);
    if let Some(name) = &name {
        config = config.name(name.clone());
    }
    let pool = database.pool((config.workers + EXTRA_CONNECTIONS) as u32).await?;
    Ok(Prepared { name, database, config, pool })
}

/// One outbox being relayed: where it lives, its dispatcher, and its own connection to the
/// broker.
pub(super) struct Running {
    /// Where it lives (`--schema` its schema, for `--outbox` and `--outbox-schemas`).
    pub(super) database: DatabaseArgs,
    pub(super) relayed: serve::Relayed,
    pub(super) sink: RabbitSink,
}

impl Running {
    /// Its name: `SCHEMA.outbox` when the process relays several, else the table's own.
    pub(super) fn name(&self) -> String {
        self.relayed.name.clone().unwrap_or_else(|| "outbox".to_owned())
    }
}

/// Starts the dispatcher of `outbox` on `sink`, registered in `relayed`.
pub(super) fn start_one(
    outbox: Prepared,
    sink: RabbitSink,
    relayed: &serve::SupervisorSlot,
) -> Result<Running, CliError> {
    let Prepared { name, database, config, pool } = outbox;
    let source = config.source.clone().unwrap_or_default();
    info!(outbox = name.as_deref(), database = %database.url()?, pooler = %database.pooler, source = %source,
        fifo = %config.fifo, "starting the dispatcher; SIGINT or SIGTERM stops it gracefully");
    let supervisor = OutboxSupervisor::start(config, pool.clone(), sink.clone())
        .map_err(|e| CliError::BadInput(format!("cannot start the dispatcher: {e}")))?;
    let one = serve::Relayed { name, supervisor, pool, source };
    relayed.lock().unwrap_or_else(|e| e.into_inner()).push(one.clone());
    Ok(Running { database, relayed: one, sink })
}
