//! How the process reaches PostgreSQL: [`PgPool`], straight to the server or through a
//! transaction pooler ([`Pooler`]), and the connections of its own that session work needs.
//!
//! **Behind a transaction pooler** (PgBouncer in `pool_mode = transaction`, and the poolers of
//! most managed PostgreSQL offerings), a client connection is given a server connection for
//! one transaction at a time. A statement outside a transaction may be prepared on one server
//! connection and run on another, and a prepared statement left behind stays on a server
//! connection that another process may be handed next (`prepared statement "s1" already
//! exists`). So, behind one:
//!
//! - the pool's connections keep no prepared statement: each statement is prepared, run and
//!   closed inside the transaction it belongs to;
//! - every unit of work runs in a transaction of its own ([`PgPool::run`], [`unit`]), so that
//!   all of it stays on one server connection;
//! - nothing relies on the session: no `SET` when a connection opens (a statement that is
//!   never reused is always planned with its real values, which is what
//!   `plan_cache_mode = force_custom_plan` buys a direct connection), no session advisory lock,
//!   no `LISTEN`. What needs a session (the insert listener, the FIFO gate's index build) gets a
//!   connection of its own to [`PoolConfig::direct_url`], or is done without.

use diesel::connection::CacheSize;
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AnsiTransactionManager, TransactionManager};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

use super::open;
use crate::error::StoreError;
use crate::url::{ConnectionString, with_causes};

/// Session settings applied to every pooled connection of a direct pool.
///
/// `plan_cache_mode = force_custom_plan`: the claim and the finalizes stay prepared, and after
/// five runs PostgreSQL may switch a prepared statement to a generic plan, made once and kept for
/// the connection's life. A generic plan made while the table was small (a new outbox, a test)
/// reads it whole, and goes on reading it whole once it holds millions of rows (measured: a
/// batched finalize at 35 ms a run instead of 0.1 ms, after a few minutes of traffic on a new
/// table); the pool's connections also carry the producers' business statements, whose plans
/// may depend on their values. Custom plans see the real values on every run; their cost, the
/// planning of every run, is spread over the rows of a statement (claims wait a few milliseconds
/// to gather rows while traffic flows: see `listener`).
const SESSION_SETUP: &str = "SET plan_cache_mode = force_custom_plan";

/// How long a checkout waits for a connection (see [`connect_pool`]).
const CHECKOUT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The default number of connections of a pool.
const DEFAULT_SIZE: u32 = 8;

/// What stands between this process and PostgreSQL; see the [`PoolConfig`] docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Pooler {
    /// Nothing, or a pooler in session mode: each connection is a session of its own. The
    /// claim and the finalizes stay prepared on their connection. The default.
    #[default]
    None,
    /// A pooler in transaction mode (PgBouncer's `pool_mode = transaction`): a connection is a
    /// session for one transaction at a time. Every unit of work runs in a transaction of its
    /// own and keeps no prepared statement past it; what needs a session goes to
    /// [`PoolConfig::direct_url`].
    Transaction,
}

impl std::fmt::Display for Pooler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Pooler::None => "none",
            Pooler::Transaction => "transaction",
        })
    }
}

impl std::str::FromStr for Pooler {
    type Err = String;

    /// `none` or `transaction` (what the command line's `--pooler` takes).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Pooler::None),
            "transaction" => Ok(Pooler::Transaction),
            other => Err(format!("unknown pooler mode {other:?}: expected `none` or `transaction`")),
        }
    }
}

/// How a [`PgPool`] reaches PostgreSQL: the connection string, the number of connections, and
/// whether a transaction pooler stands in front of the server.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::{PoolConfig, Pooler};
///
/// // Through PgBouncer in transaction mode; the insert listener gets a session of its own.
/// let pool = PoolConfig::new("postgres://app@pgbouncer:6432/app")
///     .size(6)
///     .pooler(Pooler::Transaction)
///     .direct_url("postgres://app@db-primary:5432/app")
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
///
/// Behind a transaction pooler without a direct URL, the dispatcher polls for new rows (every
/// [`DispatcherConfig::poll_interval`](crate::DispatcherConfig::poll_interval)) instead of
/// listening, and under the FIFO gate it needs the gate's index built ahead of time
/// (`actix-outbox migrate --fifo` on a direct URL).
#[derive(Clone)]
#[non_exhaustive]
pub struct PoolConfig {
    /// The connection string of the pooled connections (a URL or `key=value` pairs, see
    /// [`ConnectionString`]).
    pub url: String,
    /// How many connections the pool holds at most. Default 8 (a dispatcher needs its
    /// workers + 2).
    pub size: u32,
    /// What stands between the process and the server. Default [`Pooler::None`].
    pub pooler: Pooler,
    /// A connection string that reaches the server itself (not through a transaction pooler),
    /// for the work that needs a session: the insert listener's `LISTEN` and its advisory lock,
    /// and the FIFO gate's index build. Without it, the pool's own connection string is used
    /// for that work when [`PoolConfig::pooler`] is [`Pooler::None`], and the work is done
    /// without behind a transaction pooler. Default `None`.
    pub direct_url: Option<String>,
}

impl std::fmt::Debug for PoolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolConfig")
            .field("url", &crate::url::mask_url(&self.url))
            .field("size", &self.size)
            .field("pooler", &self.pooler)
            .field("direct_url", &self.direct_url.as_deref().map(crate::url::mask_url))
            .finish()
    }
}

impl PoolConfig {
    /// A pool of `url`, every other setting at its default (each named on its field).
    pub fn new(url: impl Into<String>) -> Self {
        Self { url: url.into(), size: DEFAULT_SIZE, pooler: Pooler::None, direct_url: None }
    }

    /// Sets [`PoolConfig::size`].
    #[must_use]
    pub fn size(mut self, size: u32) -> Self {
        self.size = size;
        self
    }

    /// Sets [`PoolConfig::pooler`].
    #[must_use]
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// Sets [`PoolConfig::direct_url`].
    #[must_use]
    pub fn direct_url(mut self, url: impl Into<String>) -> Self {
        self.direct_url = Some(url.into());
        self
    }

    /// Opens the pool and its first connection. A database that refuses (an unknown role, a
    /// wrong password, a missing database), is not there (connection refused) or does not answer
    /// within the connect timeout fails this at once with [`StoreError::Connect`], whose message
    /// and source are the server's or the driver's own words, rather than every checkout after
    /// it with a pool timeout. Once open, the pool makes further connections as they are needed
    /// and keeps trying while the database is away.
    ///
    /// Each connection is opened as [`connect`](crate::admin::connect) does, and its socket is
    /// driven on a thread of the crate's own, not by the runtime that happened to open it, so
    /// the pool may be shared by any runtimes (an actix-web app's workers and the dispatcher)
    /// and keeps working after one of them stops.
    pub async fn connect(&self) -> Result<PgPool, StoreError> {
        let target = ConnectionString::parse(&self.url)?;
        let direct = self.direct_url.as_deref().map(ConnectionString::parse).transpose()?;
        let pooler = self.pooler;
        let mut config = ManagerConfig::<AsyncPgConnection>::default();
        let setup_target = target.clone();
        config.custom_setup = Box::new(move |_| {
            let target = setup_target.clone();
            Box::pin(async move {
                // The pool wants a diesel error: keep the whole chain in its message.
                let conn =
                    open(&target).await.map_err(|e| diesel::ConnectionError::BadConnection(with_causes(e.as_ref())))?;
                set_up(conn, pooler).await
            })
        });
        // A checkout does not ping: a `SELECT 1` before every claim and every finalize flush was a
        // round trip of its own. A connection whose socket closed is still dropped (bb8 asks
        // `is_broken` on return), and a statement on a connection that died unnoticed fails like
        // any other transient error: the claim actor polls again, the finalizer retries.
        config.recycling_method = RecyclingMethod::Fast;
        let manager = AsyncDieselConnectionManager::new_with_config(target.expose(), config);
        let pool = Pool::builder()
            .max_size(self.size.max(1))
            // While the database is away, bb8 keeps trying to connect for a checkout, pausing up
            // to half this timeout between attempts, and hands the first connection that works
            // to the waiting checkout: 3 s keeps those pauses at 1.5 s, so the dispatcher resumes
            // soon after the database's return (the claim actors and the finalizer retry a
            // failed checkout themselves).
            .connection_timeout(CHECKOUT_TIMEOUT)
            .build(manager)
            .await
            .map_err(|e| StoreError::Connect(Box::new(e)))?;
        // Opened here, with its cause kept whole: bb8 would keep retrying a refused connection
        // until the checkout timed out, and report only the timeout. It is the pool's first.
        let first = open(&target).await.map_err(StoreError::Connect)?;
        let first = set_up(first, pooler).await.map_err(StoreError::from)?;
        let _ = pool.add(first);
        let session = match (direct, pooler) {
            (Some(direct), _) => Some(direct),
            (None, Pooler::None) => Some(target),
            (None, Pooler::Transaction) => None,
        };
        Ok(PgPool { pool, pooler, session })
    }
}

/// Sets a new pooled connection up for `pooler` (see [`SESSION_SETUP`]).
async fn set_up(mut conn: AsyncPgConnection, pooler: Pooler) -> Result<AsyncPgConnection, diesel::ConnectionError> {
    match pooler {
        Pooler::None => {
            conn.batch_execute(SESSION_SETUP).await.map_err(diesel::ConnectionError::CouldntSetupConfiguration)?
        }
        Pooler::Transaction => conn.set_prepared_statement_cache_size(CacheSize::Disabled),
    }
    Ok(conn)
}

/// Opens a pool of `size` connections straight to `database_url` (a URL or `key=value` pairs,
/// see [`ConnectionString`]): [`PoolConfig::new`] with that size, connected. Behind a
/// transaction pooler, use [`PoolConfig`] with [`Pooler::Transaction`].
///
/// Its first connection is opened here: a database that refuses or does not answer fails it at
/// once with the server's words ([`PoolConfig::connect`]).
///
/// ```no_run
/// # async fn f() {
/// match actix_outbox::connect_pool("postgres://nobody@127.0.0.1:5432/app", 4).await {
///     Ok(pool) => { /* ... */ }
///     // database connection failed: db error: FATAL: role "nobody" does not exist
///     Err(e) => eprintln!("{e}"),
/// }
/// # }
/// ```
pub async fn connect_pool(database_url: &str, size: u32) -> Result<PgPool, StoreError> {
    PoolConfig::new(database_url).size(size).connect().await
}

/// A bb8 pool of diesel-async PostgreSQL connections, each set up for the dispatcher; made by
/// [`PoolConfig::connect`] (or [`connect_pool`]) and nothing else, so the dispatcher never runs
/// on a connection that lacks the setup. It dereferences to the bb8 pool: `pool.get().await`
/// checks a connection out. Behind a transaction pooler, run what you do on it in a
/// transaction, or through [`PgPool::run`].
#[derive(Clone)]
pub struct PgPool {
    pool: Pool<AsyncPgConnection>,
    pooler: Pooler,
    /// Where session work connects: the direct URL, the pool's own without a transaction
    /// pooler, nowhere behind one without a direct URL.
    session: Option<ConnectionString>,
}

impl std::ops::Deref for PgPool {
    type Target = Pool<AsyncPgConnection>;

    fn deref(&self) -> &Self::Target {
        &self.pool
    }
}

impl std::fmt::Debug for PgPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.pool.state();
        f.debug_struct("PgPool")
            .field("connections", &state.connections)
            .field("idle", &state.idle_connections)
            .field("pooler", &self.pooler)
            .field("session", &self.session.as_ref().map(ToString::to_string))
            .finish()
    }
}

impl PgPool {
    /// What stands between this pool and the server.
    pub fn pooler(&self) -> Pooler {
        self.pooler
    }

    /// Checks out a connection and runs `f` on it as one unit of work: in a transaction of its
    /// own behind a transaction pooler (so that all of it runs on one server connection), as it
    /// is otherwise. A unit that fails behind a pooler is rolled back.
    ///
    /// ```no_run
    /// # async fn f(pool: actix_outbox::PgPool) -> Result<(), actix_outbox::StoreError> {
    /// let stats = pool.run(async |conn| actix_outbox::admin::stats(conn).await).await?;
    /// # Ok(()) }
    /// ```
    pub async fn run<T, E>(&self, f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StoreError> + From<diesel::result::Error>,
    {
        let mut conn = self.pool.get().await.map_err(StoreError::from)?;
        unit(&mut conn, self.pooler, f).await
    }

    /// Whether [`PgPool::session`] can give a session: false behind a transaction pooler with
    /// no direct URL.
    pub(crate) fn has_session(&self) -> bool {
        self.session.is_some()
    }

    /// A connection of its own, outside the pool, for work that holds a session (`LISTEN`, a
    /// session advisory lock, `CREATE INDEX CONCURRENTLY`): to the direct URL, or to the pool's
    /// own server without a transaction pooler. `None` behind a transaction pooler with no
    /// direct URL.
    pub(crate) async fn session(&self) -> Option<Result<AsyncPgConnection, StoreError>> {
        let target = self.session.as_ref()?;
        Some(open(target).await.map_err(StoreError::Connect))
    }
}

/// Runs `f` on `conn` as one unit of work for `pooler`: in a transaction of its own behind a
/// transaction pooler unless `conn` is in one already, as it is otherwise.
pub(crate) async fn unit<T, E>(
    conn: &mut AsyncPgConnection,
    pooler: Pooler,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    match pooler {
        Pooler::None => f(conn).await,
        Pooler::Transaction => in_transaction(conn, f).await,
    }
}

/// Runs `f` on `conn` in a transaction of its own (as [`in_transaction`]) whose statements read
/// the table through indexes only: for the dispatcher's maintenance (the sweep, the table
/// sample, the prune, the hand-back of a lost claim's rows), each of which reads a part of the
/// table that an index bounds. Their plans depend on statistics, and statistics can say that a
/// scan of the whole table is cheaper (right after a bulk load in one transaction, `txid` has one
/// value) when the part read is a thousandth of it; `enable_seqscan = off` for the transaction
/// alone keeps every plan on its index, and `jit = off` keeps the estimate of such a scan from
/// compiling code for a statement that reads a few rows. Neither setting outlives the
/// transaction, so the producers' statements on the same connections are planned as usual.
pub(crate) async fn through_indexes<T, E>(
    conn: &mut AsyncPgConnection,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    in_transaction(conn, async |conn| {
        conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL jit = off").await?;
        f(conn).await
    })
    .await
}

/// Runs `f` on `conn` in a transaction of its own (committed when `f` succeeds, rolled back
/// when it fails), or as part of the one `conn` is in. The store's operator functions run this
/// way whatever the pooler, so that they work on any connection.
pub(crate) async fn in_transaction<T, E>(
    conn: &mut AsyncPgConnection,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth();
    if !matches!(depth, Ok(None)) {
        return f(conn).await;
    }
    AnsiTransactionManager::begin_transaction(conn).await?;
    match f(conn).await {
        Ok(value) => {
            AnsiTransactionManager::commit_transaction(conn).await?;
            Ok(value)
        }
        Err(e) => {
            // The unit's own error is the one to report; a connection that cannot roll back is
            // broken, and the pool drops it.
            let _ = AnsiTransactionManager::rollback_transaction(conn).await;
            Err(e)
        }
    }
}
