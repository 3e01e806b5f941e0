//! The store: the schema's SQL and nothing else. It knows no actor and no sink.
//!
//! Every statement is a typed Diesel query or hand-written SQL with typed binds; values are
//! never spliced into SQL text. Each function takes a connection, so callers decide whether it
//! runs on a pooled connection or inside their own transaction.
//!
//! The claim and the finalizes stay prepared on their connection, so they are meant for
//! connections of a [`PgPool`] (see [`connect_pool`] for why): on another connection,
//! PostgreSQL may switch them to a generic plan after their fifth run.

mod admin;
// The claim and the fenced writes are the dispatcher's; they are public only through the
// `test-util` feature's `testing` module.
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub, dead_code))]
mod claim;
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub, dead_code))]
mod cursor;
mod deadline;
mod fence;
mod fifo;
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub, dead_code))]
mod finalize;
mod harness;
mod io;
mod pool;
mod prepared;
mod producer;
mod sql;
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub, dead_code))]
mod sweep;

use std::time::Duration;

use diesel::connection::CacheSize;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

pub use admin::{
    Erasure, Overview, PurgeStretch, SKIPPED_PREFIX, Stats, dead_available_at, dead_list, dead_retry, dead_retry_all,
    dead_skip, erase, outbox_source, overview, purge_done, purge_done_batch, stats,
};
pub(crate) use admin::{Sample, prune_step, sample_unfinished};
#[cfg(feature = "testkit")]
pub(crate) use admin::{Unsettled, unsettled};
#[cfg_attr(not(feature = "test-util"), allow(unused_imports))]
pub use claim::{AggregateKey, Claim, ClaimParams, HeadsScan, claim, claim_plan, explain_claim, release_unanswered};
#[cfg_attr(not(feature = "test-util"), allow(unused_imports))]
pub use cursor::{BadSnapshot, Cursor, Position, Snapshot, Taken};
#[cfg_attr(not(feature = "inbox"), allow(unused_imports))]
pub(crate) use deadline::abandon;
pub(crate) use deadline::within;
pub(crate) use fifo::fifo_index_valid;
pub use fifo::{BlockedAggregate, blocked_aggregates, blocked_aggregates_count, ensure_fifo_index};
#[cfg_attr(not(feature = "test-util"), allow(unused_imports))]
pub use finalize::{
    Bury, Reschedule, Rescheduled, delete_done, extend_leases, mark_dead, mark_done, reschedule, settled,
};
#[cfg_attr(not(feature = "inbox"), allow(unused_imports))]
pub(crate) use pool::in_transaction;
#[cfg_attr(not(feature = "inbox"), allow(unused_imports))]
pub(crate) use pool::in_transaction_idle;
pub use pool::{PgPool, PoolConfig, Pooler, connect_pool};
pub use producer::{enqueue, enqueue_many, enqueue_ordered, lock_aggregate};
#[cfg(feature = "testkit")]
pub(crate) use sql::{SERVER_SECONDS_SQL, STALE_TEST_DATABASES_SQL};
#[cfg_attr(not(feature = "test-util"), allow(unused_imports))]
pub use sweep::{SweepParams, Swept, horizon, sweep};

use crate::error::StoreError;
use crate::url::ConnectionString;

/// The migrations of `migrations/`, compiled into the crate.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/outbox");

/// The `application_name` of the connections this crate opens, unless the connection string
/// names one.
const APPLICATION_NAME: &str = "actix-outbox";

/// How long one connection attempt may take when the connection string sets no
/// `connect_timeout`.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP keepalives of the connections this crate opens, unless the connection string sets its
/// own: a probe after this much silence...
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// ...then one every this often...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// ...and the connection is closed after this many unanswered: a peer that is gone (its host
/// died, a firewall dropped the connection) is noticed within about 30 s of idleness.
const KEEPALIVE_RETRIES: u32 = 3;
/// How long sent bytes may stay unacknowledged before the kernel closes the connection
/// (`TCP_USER_TIMEOUT`, Linux), unless the connection string sets `tcp_user_timeout`.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Opens one connection to `database_url` (a URL or `key=value` pairs, see
/// [`ConnectionString`]), every option of the string applied. Without a `connect_timeout` in
/// the string, an attempt that gets no answer within 10 s fails; without
/// an `application_name`, the connection is named `actix-outbox`. Unless the string sets its
/// own, TCP keepalives probe after 15 s of silence, every 5 s, 3 times, and sent bytes may stay
/// unacknowledged for 30 s (`tcp_user_timeout`, Linux): a server that is gone is noticed
/// within about half a minute. They cannot see a link whose other end still acknowledges but
/// never answers: the pool's query timeout ([`PoolConfig::query_timeout`]) does.
///
/// A failure is [`StoreError::Connect`] whose source is the driver's error, with its own cause
/// ("Connection refused") and, when the server answered, its SQLSTATE.
///
/// The connection keeps no prepared statement (each statement is prepared and closed where it
/// runs), and the operator functions of [`admin`](crate::admin) each run in a transaction of
/// their own, so such a connection works through a transaction pooler as well as straight to
/// the server.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let mut conn = actix_outbox::admin::connect("host=db user=app dbname=app").await?;
/// let stats = actix_outbox::admin::stats(&mut conn).await?;
/// # Ok(()) }
/// ```
pub async fn connect(database_url: &str) -> Result<AsyncPgConnection, StoreError> {
    open_uncached(&ConnectionString::parse(database_url)?).await.map_err(StoreError::Connect)
}

/// [`open`], the connection keeping no prepared statement: what [`connect`], the migrations and
/// [`ensure_database`] use, so that they work through a transaction pooler.
async fn open_uncached(
    target: &ConnectionString,
) -> Result<AsyncPgConnection, Box<dyn std::error::Error + Send + Sync>> {
    let mut conn = open(target).await?;
    conn.set_prepared_statement_cache_size(CacheSize::Disabled);
    Ok(conn)
}

/// [`connect`] for a parsed string, the cause kept whole.
pub(crate) async fn open(
    target: &ConnectionString,
) -> Result<AsyncPgConnection, Box<dyn std::error::Error + Send + Sync>> {
    let mut config = target.config().clone();
    if config.get_application_name().is_none() {
        config.application_name(APPLICATION_NAME);
    }
    set_keepalives(&mut config);
    let per_host = *config.get_connect_timeout().unwrap_or(&DEFAULT_CONNECT_TIMEOUT);
    config.connect_timeout(per_host);
    // The driver's timeout covers opening the socket; this one also covers a server that
    // accepts it and never answers.
    let hosts = config.get_hosts().len().max(config.get_hostaddrs().len()).max(1) as u32;
    // Opened, and driven, on the crate's own runtime: see `io`.
    let connecting = async {
        io::on_connection_runtime(async move {
            let (client, mut connection) = config.connect(tokio_postgres::NoTls).await?;
            // diesel-async sets the connection up with two statements of its own (`SET TIME
            // ZONE`, `SET CLIENT_ENCODING`), each parsed, run and closed in separate protocol
            // steps: through a transaction pooler, those steps outside a transaction go to
            // whichever server is free, and under concurrent connects one finds another's
            // statement name taken or its own gone. Opened in a transaction, the setup stays on
            // one server; the socket is driven here until BEGIN answers, then handed on.
            tokio::select! {
                begun = client.batch_execute("BEGIN") => begun?,
                ended = &mut connection => {
                    ended?;
                    return Err("the server closed the connection during its setup".into());
                }
            }
            let mut conn = AsyncPgConnection::try_from_client_and_connection(client, connection).await?;
            conn.batch_execute("COMMIT").await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(conn)
        })
        .await?
    };
    match tokio::time::timeout(per_host * hosts, connecting).await {
        Ok(connected) => connected,
        Err(_) => Err(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {}", humantime::format_duration(per_host * hosts)),
        ))),
    }
}

/// Sets the crate's TCP keepalives and user timeout on `config`, where the connection string
/// left them at the driver's defaults (keepalives on, first probe after two hours, the
/// system's interval and count; no user timeout). A string that turns keepalives off
/// (`keepalives=0`) keeps them off.
fn set_keepalives(config: &mut tokio_postgres::Config) {
    if config.get_keepalives() && config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle(KEEPALIVE_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
}

/// Checks out one connection and runs `SELECT 1`.
pub async fn check_connection(pool: &PgPool) -> Result<(), StoreError> {
    pool.run(async |conn| {
        diesel::sql_query("SELECT 1").execute(conn).await?;
        Ok(())
    })
    .await
}

/// Applies the pending migrations to `database_url` and returns the versions it applied.
///
/// Connects as [`connect`] does, then runs the synchronous migration harness on a blocking
/// thread, so it is safe to await from an actix or tokio runtime (diesel's async harness is
/// not, under actix's current-thread runtime). It creates no database: on one that does not
/// exist it fails with [`StoreError::NoDatabase`]; [`ensure_database`] creates it. A URL that
/// names no database is refused ([`StoreError::BadUrl`], see
/// [`ConnectionString::require_database`]) rather than migrating the database named after the
/// user.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let applied = actix_outbox::migrate("postgres://localhost/app").await?;
/// println!("applied {applied:?}");
/// # Ok(()) }
/// ```
pub async fn migrate(database_url: &str) -> Result<Vec<String>, StoreError> {
    drop_failed_index_builds(database_url).await?;
    apply_migrations(database_url, MIGRATIONS).await
}

/// Drops what a migration that builds an index concurrently left behind when it failed midway
/// (an invalid index, which `CREATE INDEX CONCURRENTLY IF NOT EXISTS` would take for done), so
/// that the run builds it again. Only the migrations' own indexes, by name.
async fn drop_failed_index_builds(database_url: &str) -> Result<(), StoreError> {
    #[derive(diesel::QueryableByName)]
    struct Invalid {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    ConnectionString::parse(database_url)?.require_database()?;
    // A database that cannot be reached is the migrations' to report, in their words.
    let Ok(mut conn) = connect(database_url).await else { return Ok(()) };
    // In a transaction of its own: a transaction pooler keeps the statement it prepares on one
    // server connection only that long.
    let invalid: Vec<Invalid> =
        pool::in_transaction(&mut conn, async |c| diesel::sql_query(sql::INVALID_MIGRATION_INDEXES_SQL).load(c).await)
            .await?;
    for index in invalid {
        // One of the names in the statement above, never input.
        conn.batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {}", index.name)).await?;
        tracing::info!(index = %index.name, "dropped an index a failed migration left invalid; building it again");
    }
    Ok(())
}

/// Applies the pending migrations of `set` (the outbox's or the inbox's) and returns the
/// versions it applied.
pub(crate) async fn apply_migrations(
    database_url: &str,
    set: impl diesel::migration::MigrationSource<diesel::pg::Pg> + Send + 'static,
) -> Result<Vec<String>, StoreError> {
    let target = ConnectionString::parse(database_url)?;
    let name = target.require_database()?;
    // A missing database is the first thing a new deployment hits: say how to create it rather
    // than hand over the server's refusal.
    let conn = open_uncached(&target).await.map_err(|e| {
        if is_missing_database(e.as_ref()) {
            StoreError::NoDatabase { database: name.to_owned() }
        } else {
            StoreError::Connect(e)
        }
    })?;
    with_harness(conn, move |harness| {
        let applied = harness.run_pending_migrations(set).map_err(StoreError::Migration)?;
        Ok(applied.into_iter().map(|v| v.to_string()).collect())
    })
    .await
}

/// Runs `f` (a migration) on a runtime of its own, for callers outside any async runtime.
pub(crate) fn block_on<T>(f: impl std::future::Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| StoreError::Migration(Box::new(e)))?;
    runtime.block_on(f)
}

/// [`migrate`] for callers outside any async runtime (a `main` before the actix system starts).
pub fn migrate_blocking(database_url: &str) -> Result<Vec<String>, StoreError> {
    block_on(migrate(database_url))
}

/// The embedded migrations not yet applied to `database_url`, by name (empty when the schema is
/// up to date). A dispatcher started on an unmigrated database would log a failed claim every
/// poll; check this first and say what to do.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let pending = actix_outbox::admin::pending_migrations("postgres://localhost/app").await?;
/// assert!(pending.is_empty(), "run `actix-outbox migrate` first: {pending:?}");
/// # Ok(()) }
/// ```
pub async fn pending_migrations(database_url: &str) -> Result<Vec<String>, StoreError> {
    pending_in(database_url, MIGRATIONS).await
}

/// The migrations of `set` not yet applied to `database_url`, by name.
pub(crate) async fn pending_in(database_url: &str, set: EmbeddedMigrations) -> Result<Vec<String>, StoreError> {
    use diesel::migration::Migration;
    ConnectionString::parse(database_url)?.require_database()?;
    let conn = connect(database_url).await?;
    with_harness(conn, move |harness| {
        let pending = harness.pending_migrations(set).map_err(StoreError::Migration)?;
        Ok(pending.iter().map(|m| m.name().to_string()).collect())
    })
    .await
}

/// Runs `f` with `conn` (opened by [`open_uncached`]) as diesel's synchronous migration harness,
/// on a blocking thread of the current runtime (the one `conn` was opened on, which keeps
/// driving it). Each migration runs in a transaction of its own (and so on one server
/// connection behind a transaction pooler), but for those that build an index without blocking
/// writers (`CREATE INDEX CONCURRENTLY`, which no transaction may hold), each a single statement:
/// a run that fails keeps the migrations before the failed one, and the next run goes on from
/// there.
async fn with_harness<T: Send + 'static>(
    conn: AsyncPgConnection,
    f: impl FnOnce(&mut harness::Harness) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(move || {
        let mut harness = harness::Harness::from(conn);
        f(&mut harness)
    })
    .await
    .map_err(|e| StoreError::Migration(Box::new(e)))?
}

/// Creates the database named in `database_url` when it does not exist yet, through the
/// `postgres` maintenance database of the same server, reached with every other option of the
/// string (host, port, user, password, `sslmode`, socket directory...). Returns whether it
/// created it. Any failure but a missing database (refused, authentication) is returned as it
/// is. A URL that names no database is refused ([`StoreError::BadUrl`], see
/// [`ConnectionString::require_database`]) rather than creating the database named after the
/// user.
pub async fn ensure_database(database_url: &str) -> Result<bool, StoreError> {
    let target = ConnectionString::parse(database_url)?;
    let name = target.require_database()?;
    match open_uncached(&target).await {
        Ok(_) => return Ok(false),
        Err(e) if is_missing_database(e.as_ref()) => {}
        Err(e) => return Err(StoreError::Connect(e)),
    }
    let mut admin = open_uncached(&target.with_database("postgres")).await.map_err(StoreError::Connect)?;
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let exists = diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS exists")
        .bind::<diesel::sql_types::Text, _>(name);
    let found: Exists =
        pool::in_transaction(&mut admin, async |c| Ok::<_, StoreError>(exists.get_result(c).await?)).await?;
    if found.exists {
        return Ok(false);
    }
    // CREATE DATABASE takes no bind parameters: quote the identifier instead.
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    admin.batch_execute(&format!("CREATE DATABASE {quoted}")).await?;
    Ok(true)
}

/// Creates the schema `schema` in the database of `database_url` when it does not exist yet,
/// for an outbox of its own there ([`ConnectionString::in_schema`] then reaches it, and
/// [`migrate`] on that string creates the tables in it). Returns whether it created it.
/// `schema` must be a lowercase unquoted identifier, as `in_schema` wants.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::ConnectionString;
/// let url = ConnectionString::parse("postgres://app@db/app").unwrap();
/// actix_outbox::admin::ensure_schema(url.expose(), "tenant_a").await?;
/// actix_outbox::migrate(url.in_schema("tenant_a")?.expose()).await?;
/// # Ok(()) }
/// ```
pub async fn ensure_schema(database_url: &str, schema: &str) -> Result<bool, StoreError> {
    let target = ConnectionString::parse(database_url)?;
    // A plain identifier may stand unquoted below; `in_schema` says why another is refused.
    if !crate::url::is_plain_identifier(schema) {
        target.in_schema(schema)?;
    }
    let mut conn = open_uncached(&target).await.map_err(StoreError::Connect)?;
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    pool::in_transaction(&mut conn, async |c| {
        let found: Exists =
            diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1) AS exists")
                .bind::<diesel::sql_types::Text, _>(schema)
                .get_result(c)
                .await?;
        if !found.exists {
            c.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}")).await?;
        }
        Ok::<_, StoreError>(!found.exists)
    })
    .await
}

/// The schemas of the database of `database_url` whose name is `LIKE pattern` and that hold
/// an `outbox` table, by name: the outboxes of a multi-tenant database (`tenant_%`), for a
/// relay that serves them all. Only names that are plain lowercase identifiers (as
/// [`ConnectionString::in_schema`] takes) are listed.
pub async fn outbox_schemas(conn: &mut AsyncPgConnection, pattern: &str) -> Result<Vec<String>, StoreError> {
    #[derive(diesel::QueryableByName)]
    struct Schema {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    let found: Vec<Schema> = pool::in_transaction(conn, async |c| {
        diesel::sql_query(sql::OUTBOX_SCHEMAS_SQL).bind::<diesel::sql_types::Text, _>(pattern).load(c).await
    })
    .await?;
    Ok(found.into_iter().map(|s| s.name).filter(|name| crate::url::is_plain_identifier(name)).collect())
}

/// Whether the server answered that the database does not exist (SQLSTATE 3D000).
fn is_missing_database(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<tokio_postgres::Error>()
        .is_some_and(|e| e.code() == Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME))
}
