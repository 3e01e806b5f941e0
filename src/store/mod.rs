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
mod fence;
mod fifo;
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub, dead_code))]
mod finalize;
mod io;
mod prepared;
mod producer;
mod sql;

use std::time::Duration;

use diesel::ConnectionError;
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

pub(crate) use admin::sample_unfinished;
pub use admin::{
    SKIPPED_PREFIX, Stats, dead_list, dead_retry, dead_retry_all, dead_skip, outbox_source, purge_done, stats,
};
#[cfg_attr(not(feature = "test-util"), allow(unused_imports))]
pub use claim::{AggregateKey, Claim, ClaimParams, HeadsScan, ReadyPosition, claim, explain_claim, release_unanswered};
pub use fifo::{BlockedAggregate, blocked_aggregates, blocked_aggregates_count, ensure_fifo_index};
#[cfg_attr(not(feature = "test-util"), allow(unused_imports))]
pub use finalize::{
    Bury, Reschedule, Rescheduled, delete_done, extend_leases, mark_dead, mark_done, reschedule, settled,
};
pub use producer::{enqueue, enqueue_many, enqueue_ordered, lock_aggregate};

use crate::error::StoreError;
use crate::url::{ConnectionString, InvalidConnectionString, with_causes};

/// The migrations of `migrations/`, compiled into the crate.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/outbox");

/// A bb8 pool of diesel-async PostgreSQL connections, each set up for the dispatcher; made by
/// [`connect_pool`] and nothing else, so the dispatcher never runs on a connection that lacks
/// the setup. It dereferences to the bb8 pool: `pool.get().await` checks a connection out.
#[derive(Clone)]
pub struct PgPool(Pool<AsyncPgConnection>);

impl std::ops::Deref for PgPool {
    type Target = Pool<AsyncPgConnection>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::fmt::Debug for PgPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.0.state();
        f.debug_struct("PgPool")
            .field("connections", &state.connections)
            .field("idle", &state.idle_connections)
            .finish()
    }
}

/// Session settings applied to every pooled connection.
///
/// `plan_cache_mode = force_custom_plan`: the claim and the finalizes stay prepared, and after
/// five runs PostgreSQL may switch a prepared statement to a generic plan. The batched finalize
/// binds arrays, and its generic plan can assume ten elements and nest a loop over every
/// processing row, several times slower; the claim's plan depends on its `LIMIT` and
/// resume position. Custom plans see the real values on every run.
const SESSION_SETUP: &str = "SET plan_cache_mode = force_custom_plan";

/// How long a checkout waits for a connection (see [`connect_pool`]).
const CHECKOUT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The `application_name` of the connections this crate opens, unless the connection string
/// names one.
const APPLICATION_NAME: &str = "actix-outbox";

/// How long one connection attempt may take when the connection string sets no
/// `connect_timeout`.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens one connection to `database_url` (a URL or `key=value` pairs, see
/// [`ConnectionString`]), every option of the string applied. Without a `connect_timeout` in
/// the string, an attempt that gets no answer within 10 s fails; without
/// an `application_name`, the connection is named `actix-outbox`.
///
/// A failure is [`StoreError::Connect`] whose source is the driver's error, with its own cause
/// ("Connection refused") and, when the server answered, its SQLSTATE.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let mut conn = actix_outbox::admin::connect("host=db user=app dbname=app").await?;
/// let stats = actix_outbox::admin::stats(&mut conn).await?;
/// # Ok(()) }
/// ```
pub async fn connect(database_url: &str) -> Result<AsyncPgConnection, StoreError> {
    open(&ConnectionString::parse(database_url)?).await.map_err(StoreError::Connect)
}

/// [`connect`] for a parsed string, the cause kept whole.
async fn open(target: &ConnectionString) -> Result<AsyncPgConnection, Box<dyn std::error::Error + Send + Sync>> {
    let mut config = target.config().clone();
    if config.get_application_name().is_none() {
        config.application_name(APPLICATION_NAME);
    }
    let per_host = *config.get_connect_timeout().unwrap_or(&DEFAULT_CONNECT_TIMEOUT);
    config.connect_timeout(per_host);
    // The driver's timeout covers opening the socket; this one also covers a server that
    // accepts it and never answers.
    let hosts = config.get_hosts().len().max(config.get_hostaddrs().len()).max(1) as u32;
    // Opened, and driven, on the crate's own runtime: see `io`.
    let connecting = async {
        io::on_connection_runtime(async move {
            let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                AsyncPgConnection::try_from_client_and_connection(client, connection).await?,
            )
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

/// Opens a pool of `size` connections to `database_url` (a URL or `key=value` pairs, see
/// [`ConnectionString`]), each opened as [`connect`] does and set up for the dispatcher.
/// Connections are made lazily, so this fails only on a malformed connection string;
/// [`check_connection`] proves the database is reachable.
///
/// The pool may be shared by any runtimes (an actix-web app's workers and the dispatcher): each
/// connection's socket is driven on a thread of the crate's own, not by the runtime that
/// happened to open it, so it keeps working after that runtime stops.
pub async fn connect_pool(database_url: &str, size: u32) -> Result<PgPool, StoreError> {
    let target = ConnectionString::parse(database_url)?;
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    let setup_target = target.clone();
    config.custom_setup = Box::new(move |_| {
        let target = setup_target.clone();
        Box::pin(async move {
            // The pool wants a diesel error: keep the whole chain in its message.
            let mut conn = open(&target).await.map_err(|e| ConnectionError::BadConnection(with_causes(e.as_ref())))?;
            conn.batch_execute(SESSION_SETUP).await.map_err(ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        })
    });
    // A checkout does not ping: a `SELECT 1` before every claim and every finalize flush was a
    // round trip of its own. A connection whose socket closed is still dropped (bb8 asks
    // `is_broken` on return), and a statement on a connection that died unnoticed fails like
    // any other transient error: the claim actor polls again, the finalizer retries.
    config.recycling_method = RecyclingMethod::Fast;
    let manager = AsyncDieselConnectionManager::new_with_config(target.expose(), config);
    let pool = Pool::builder()
        .max_size(size.max(1))
        // While the database is away, bb8 keeps trying to connect for a checkout, pausing up
        // to half this timeout between attempts, and hands the first connection that works to
        // the waiting checkout: 3 s keeps those pauses at 1.5 s, so the dispatcher resumes
        // soon after the database's return (the claim actors and the finalizer retry a failed
        // checkout themselves).
        .connection_timeout(CHECKOUT_TIMEOUT)
        .build(manager)
        .await
        .map_err(|e| StoreError::Connect(Box::new(e)))?;
    Ok(PgPool(pool))
}

/// Checks out one connection and runs `SELECT 1`.
pub async fn check_connection(pool: &PgPool) -> Result<(), StoreError> {
    let mut conn = pool.get().await?;
    diesel::sql_query("SELECT 1").execute(&mut conn).await?;
    Ok(())
}

/// Applies the pending migrations to `database_url` and returns the versions it applied.
///
/// Connects as [`connect`] does, then runs the synchronous migration harness on a blocking
/// thread, so it is safe to await from an actix or tokio runtime (diesel's async harness is
/// not, under actix's current-thread runtime). It creates no database: on one that does not
/// exist it fails with [`StoreError::NoDatabase`]; [`ensure_database`] creates it.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let applied = actix_outbox::migrate("postgres://localhost/app").await?;
/// println!("applied {applied:?}");
/// # Ok(()) }
/// ```
pub async fn migrate(database_url: &str) -> Result<Vec<String>, StoreError> {
    apply_migrations(database_url, MIGRATIONS).await
}

/// Applies the pending migrations of `set` (the outbox's or the inbox's) and returns the
/// versions it applied.
pub(crate) async fn apply_migrations(database_url: &str, set: EmbeddedMigrations) -> Result<Vec<String>, StoreError> {
    let target = ConnectionString::parse(database_url)?;
    // A missing database is the first thing a new deployment hits: say how to create it rather
    // than hand over the server's refusal.
    let conn = open(&target).await.map_err(|e| match target.database() {
        Some(name) if is_missing_database(e.as_ref()) => StoreError::NoDatabase { database: name.to_owned() },
        _ => StoreError::Connect(e),
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
    let conn = connect(database_url).await?;
    with_harness(conn, move |harness| {
        let pending = harness.pending_migrations(set).map_err(StoreError::Migration)?;
        Ok(pending.iter().map(|m| m.name().to_string()).collect())
    })
    .await
}

/// Runs `f` with `conn` as diesel's synchronous migration harness, on a blocking thread of the
/// current runtime (the one `conn` was opened on, which keeps driving it).
async fn with_harness<T: Send + 'static>(
    conn: AsyncPgConnection,
    f: impl FnOnce(&mut AsyncConnectionWrapper<AsyncPgConnection>) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(move || f(&mut AsyncConnectionWrapper::from(conn)))
        .await
        .map_err(|e| StoreError::Migration(Box::new(e)))?
}

/// Creates the database named in `database_url` when it does not exist yet, through the
/// `postgres` maintenance database of the same server, reached with every other option of the
/// string (host, port, user, password, `sslmode`, socket directory...). Returns whether it
/// created it. Any failure but a missing database (refused, authentication) is returned as it
/// is.
pub async fn ensure_database(database_url: &str) -> Result<bool, StoreError> {
    let target = ConnectionString::parse(database_url)?;
    let Some(name) = target.database() else {
        return Err(InvalidConnectionString::new(database_url, "it names no database and no user".into()).into());
    };
    match open(&target).await {
        Ok(_) => return Ok(false),
        Err(e) if is_missing_database(e.as_ref()) => {}
        Err(e) => return Err(StoreError::Connect(e)),
    }
    let mut admin = open(&target.with_database("postgres")).await.map_err(StoreError::Connect)?;
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let found: Exists = diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS exists")
        .bind::<diesel::sql_types::Text, _>(name)
        .get_result(&mut admin)
        .await?;
    if found.exists {
        return Ok(false);
    }
    // CREATE DATABASE takes no bind parameters: quote the identifier instead.
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    admin.batch_execute(&format!("CREATE DATABASE {quoted}")).await?;
    Ok(true)
}

/// Whether the server answered that the database does not exist (SQLSTATE 3D000).
fn is_missing_database(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<tokio_postgres::Error>()
        .is_some_and(|e| e.code() == Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME))
}
