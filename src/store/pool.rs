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
//! - every unit of work runs in a transaction of its own ([`PgPool::run`]), so that all of it
//!   stays on one server connection; the transaction sets `idle_in_transaction_session_timeout`
//!   (`SET LOCAL`, to the query timeout), so that a client whose link goes silent between two
//!   statements does not leave the server holding its locks for ever;
//! - nothing relies on the session: no `SET` when a connection opens (a statement that is
//!   never reused is always planned with its real values, which is what
//!   `plan_cache_mode = force_custom_plan` buys a direct connection), no session advisory lock,
//!   no `LISTEN`. What needs a session (the insert listener, the FIFO gate's index build) gets a
//!   connection of its own to [`PoolConfig::direct_url`], or is done without.
//!
//! **A transaction pooler nobody named.** A pool set up for a direct connection
//! ([`Pooler::None`]) whose statements turn out to go through a transaction pooler (the server
//! says a prepared statement of the driver's is missing, or its name taken:
//! [`StoreError::BehindTransactionPooler`]) switches itself to the transaction pooler's path at
//! the first such failure: every connection it hands out from then on keeps no prepared
//! statement and runs each unit of work in a transaction of its own, exactly as
//! [`Pooler::Transaction`] would have from the start, and what needs a session goes to the
//! direct URL or is done without (the insert listener stops, and the workers poll). It logs
//! once, at WARN, which setting to make. The statement that failed had not run (a statement
//! whose prepared form is missing or taken fails before it executes), so nothing is lost; what
//! the switch cannot undo is a session lock or a `LISTEN` that the insert listener took through
//! the pooler before the switch, which stays with a server connection of the pooler until the
//! pooler closes it: give such a deployment a direct URL, or set the pooler.
//!
//! **Deadlines.** Every unit of work of the crate is bounded by [`PoolConfig::query_timeout`]
//! (see `deadline`); a connection that misses it is dropped, never returned to the pool. For a
//! while after one did, every checkout first asks its connection for a quick answer
//! ([`SUSPECT_PING`]), so that the other connections of the same silent link are found and
//! dropped in a second each, rather than each costing a caller the whole timeout.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::CacheSize;
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AnsiTransactionManager, TransactionManager};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

use super::deadline::{self, DEFAULT_QUERY_TIMEOUT};
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

/// The shortest query timeout: below it, a healthy database under load would look silent.
const MIN_QUERY_TIMEOUT: Duration = Duration::from_millis(100);

/// After a connection missed its deadline, how long every checkout pings its connection first.
const SUSPECT_FOR: Duration = Duration::from_secs(15);

/// How long a checkout's ping may take while the pool suspects its connections (at most the
/// query timeout): a connection of a silent link costs its caller this, not the whole timeout.
const SUSPECT_PING: Duration = Duration::from_secs(1);

/// How long a transaction of the store's may wait for its client's next statement before the
/// server ends it (see [`in_transaction`]). The store sends a transaction's statements one after
/// the other, so the wait is a round trip: one of seconds means the link is gone. Behind a
/// transaction pooler every unit is bounded by the pool's query timeout instead.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

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
    /// How long the database may take to answer one unit of work of the crate (a claim, a
    /// finalize statement, a table sample, a statement of the insert listener, a page of the
    /// console, [`PgPool::run`]) before the connection is given up: dropped, never returned
    /// to the pool, its statement cancelled on the server, and the work failed with
    /// [`StoreError::NoAnswer`] (transient: the dispatcher retries on a fresh connection).
    /// Default 5 s; at least 100 ms.
    ///
    /// This is what notices a link that went silent without closing (a frozen VM, a storage
    /// stall, a NAT that dropped its state, a hung pooler), which TCP keepalives cannot see
    /// when the other end's kernel still acknowledges. What it costs: a dispatcher notices
    /// such a link this long after its last statement went out (a WARN names the server then,
    /// and health goes not-ready); and any statement slower than this fails, however healthy
    /// the database: a claim or finalize held by a lock (a migration's `ALTER TABLE`), a
    /// table sample over a backlog of millions. Raise it where statements are legitimately
    /// slow; lower it to notice silence sooner. The connections also set TCP keepalives and a
    /// user timeout (unless the connection string sets its own `keepalives_*` and
    /// `tcp_user_timeout`), for a peer that is really gone.
    pub query_timeout: Duration,
}

impl std::fmt::Debug for PoolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolConfig")
            .field("url", &crate::url::mask_url(&self.url))
            .field("size", &self.size)
            .field("pooler", &self.pooler)
            .field("direct_url", &self.direct_url.as_deref().map(crate::url::mask_url))
            .field("query_timeout", &self.query_timeout)
            .finish()
    }
}

impl PoolConfig {
    /// A pool of `url`, every other setting at its default (each named on its field).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            size: DEFAULT_SIZE,
            pooler: Pooler::None,
            direct_url: None,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
        }
    }

    /// Sets [`PoolConfig::query_timeout`] (at least 100 ms).
    #[must_use]
    pub fn query_timeout(mut self, timeout: Duration) -> Self {
        self.query_timeout = timeout;
        self
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
        let transaction_pooler = Arc::new(AtomicBool::new(self.pooler == Pooler::Transaction));
        let mut config = ManagerConfig::<AsyncPgConnection>::default();
        let setup_target = target.clone();
        let setup_mode = transaction_pooler.clone();
        config.custom_setup = Box::new(move |_| {
            let target = setup_target.clone();
            let mode = setup_mode.clone();
            Box::pin(async move {
                // The pool wants a diesel error: keep the whole chain in its message.
                let conn =
                    open(&target).await.map_err(|e| diesel::ConnectionError::BadConnection(with_causes(e.as_ref())))?;
                set_up(conn, pooler_of(&mode)).await
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
        let first = set_up(first, pooler_of(&transaction_pooler)).await.map_err(StoreError::from)?;
        let _ = pool.add(first);
        Ok(PgPool {
            pool,
            transaction_pooler,
            target,
            direct,
            query_timeout: self.query_timeout.max(MIN_QUERY_TIMEOUT),
            health: Arc::default(),
        })
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

/// What the mode flag of a pool says.
fn pooler_of(transaction_pooler: &AtomicBool) -> Pooler {
    if transaction_pooler.load(Ordering::Relaxed) { Pooler::Transaction } else { Pooler::None }
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
    /// Whether the statements go through a transaction pooler: as configured, or found out
    /// (see the module's docs). Shared by the clones and by the connection setup.
    transaction_pooler: Arc<AtomicBool>,
    /// The pooled connections' server, for the words of a [`StoreError::NoAnswer`].
    target: ConnectionString,
    /// [`PoolConfig::direct_url`].
    direct: Option<ConnectionString>,
    query_timeout: Duration,
    /// What the pool has seen of its connections' answers.
    health: Arc<Mutex<Seen>>,
}

/// What a pool has seen of its connections' answers.
#[derive(Debug, Default)]
struct Seen {
    /// When a connection last missed its deadline.
    silent_at: Option<Instant>,
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
            .field("pooler", &self.pooler())
            .field("direct", &self.direct.as_ref().map(ToString::to_string))
            .field("query_timeout", &self.query_timeout)
            .finish()
    }
}

impl PgPool {
    /// What stands between this pool and the server: as configured, or
    /// [`Pooler::Transaction`] once the pool found that its statements go through a
    /// transaction pooler (see the module's docs).
    pub fn pooler(&self) -> Pooler {
        pooler_of(&self.transaction_pooler)
    }

    /// How long the database may take to answer one unit of work ([`PoolConfig::query_timeout`]).
    pub fn query_timeout(&self) -> Duration {
        self.query_timeout
    }

    /// The pooled connections' server, password masked, as errors name it.
    #[cfg_attr(not(feature = "inbox"), allow(dead_code))]
    pub(crate) fn server(&self) -> String {
        self.target.to_string()
    }

    /// Checks out a connection and runs `f` on it as one unit of work: in a transaction of its
    /// own behind a transaction pooler (so that all of it runs on one server connection), as it
    /// is otherwise. A unit that fails behind a pooler is rolled back. The database has the
    /// query timeout ([`PoolConfig::query_timeout`]) to answer it all: past it, the connection
    /// is dropped and the unit fails with [`StoreError::NoAnswer`].
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
        let mut conn = self.checkout().await?;
        let pooler = self.pooler();
        let limit = self.query_timeout;
        deadline::within(&mut conn, limit, &self.target, async |c| match pooler {
            Pooler::None => f(c).await,
            Pooler::Transaction => in_transaction_idle(c, limit, f).await,
        })
        .await
    }

    /// Checks a connection out, set up for the pooler as it stands now. While the pool suspects
    /// its connections (one missed its deadline lately), each is first asked for a quick
    /// answer, and one that does not give it is dropped and the next one tried.
    pub(crate) async fn checkout(
        &self,
    ) -> Result<diesel_async::pooled_connection::bb8::PooledConnection<'_, AsyncPgConnection>, StoreError> {
        self.checkout_until(None).await
    }

    /// [`PgPool::checkout`], given up at `until` (a shutdown's deadline) if it has no connection
    /// by then (and at the query timeout in any case).
    pub(crate) async fn checkout_until(
        &self,
        until: Option<Instant>,
    ) -> Result<diesel_async::pooled_connection::bb8::PooledConnection<'_, AsyncPgConnection>, StoreError> {
        // Every connection the pool holds, plus a fresh one, at most, and for no longer than
        // the query timeout: a silent link costs a checkout a ping per connection it had opened.
        let started = Instant::now();
        let until = until.map_or(started + self.query_timeout, |until| until.min(started + self.query_timeout));
        let left = || until.saturating_duration_since(Instant::now());
        for _ in 0..=self.pool.state().connections {
            if left().is_zero() {
                break;
            }
            // Dropping a checkout that waits gives nothing up: the pool keeps its connections.
            let Ok(got) = tokio::time::timeout(left(), self.pool.get()).await else { break };
            let mut conn = got?;
            if self.pooler() == Pooler::Transaction {
                // A connection set up before the pool found its pooler keeps no statement from
                // now on (a no-op on one set up for it).
                conn.set_prepared_statement_cache_size(CacheSize::Disabled);
            }
            if !self.suspicious() {
                return Ok(conn);
            }
            // The ping has a deadline of its own, which drops a connection that misses it (a
            // timeout around it would hand a silent connection back to the pool).
            let ping = SUSPECT_PING.min(left()).max(MIN_QUERY_TIMEOUT);
            let pinged = deadline::within(&mut conn, ping, &self.target, async |c| {
                c.batch_execute("SELECT 1").await.map_err(StoreError::from)
            })
            .await;
            match pinged {
                Ok(()) => return Ok(conn),
                // Marked broken by the deadline (or broken already): the pool drops it.
                Err(e) => tracing::debug!(error = %e, "a pooled connection did not answer a ping; dropped"),
            }
        }
        Err(StoreError::Pool(diesel_async::pooled_connection::bb8::RunError::TimedOut))
    }

    /// Runs `f` on `conn` (checked out of this pool) as one unit of work for the pooler as it
    /// stands now (in a transaction behind a transaction pooler, as it is otherwise), within
    /// the query timeout. A failure that shows the
    /// statements go through a transaction pooler the pool was not told about switches the
    /// pool to that pooler's path (see the module's docs).
    pub(crate) async fn unit<T>(
        &self,
        conn: &mut AsyncPgConnection,
        f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.unit_until(conn, None, f).await
    }

    /// [`PgPool::unit`], given up at `until` if that comes before the query timeout (a
    /// shutdown's deadline).
    pub(crate) async fn unit_until<T>(
        &self,
        conn: &mut AsyncPgConnection,
        until: Option<Instant>,
        f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let pooler = self.pooler();
        let limit = until.map_or(self.query_timeout, |until| {
            self.query_timeout.min(until.saturating_duration_since(Instant::now())).max(MIN_QUERY_TIMEOUT)
        });
        let result = deadline::within(conn, limit, &self.target, async |c| match pooler {
            Pooler::None => f(c).await,
            // A transaction the server ends itself if the link goes silent between statements.
            Pooler::Transaction => in_transaction_idle(c, limit, f).await,
        })
        .await;
        self.observe(result)
    }

    /// Runs `f` on `conn` within `limit` (the query timeout when `None`), as it is: for work
    /// that must not be wrapped in a transaction, or that may take longer than one statement
    /// should (a FIFO index build).
    pub(crate) async fn bounded<T>(
        &self,
        conn: &mut AsyncPgConnection,
        limit: Option<Duration>,
        f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let limit = limit.unwrap_or(self.query_timeout);
        let result = deadline::within(conn, limit, &self.target, f).await;
        self.observe(result)
    }

    /// Learns from a unit's outcome: a connection that missed its deadline makes the pool
    /// suspect the others for a while; a lost prepared statement means a transaction pooler.
    fn observe<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &result {
            self.learn(e);
        }
        result
    }

    /// Learns from a failure of work on a connection of this pool's (or of its session): a
    /// connection that missed its deadline makes the pool suspect the others for a while; a
    /// lost prepared statement means a transaction pooler.
    pub(crate) fn learn(&self, e: &StoreError) {
        match e {
            StoreError::NoAnswer { .. } => {
                self.health.lock().unwrap_or_else(|e| e.into_inner()).silent_at = Some(Instant::now());
            }
            StoreError::BehindTransactionPooler(e) => self.found_transaction_pooler(e),
            _ => {}
        }
    }

    /// Whether a connection missed its deadline lately.
    fn suspicious(&self) -> bool {
        self.health.lock().unwrap_or_else(|e| e.into_inner()).silent_at.is_some_and(|at| at.elapsed() < SUSPECT_FOR)
    }

    /// The statements go through a transaction pooler: from now on, every connection is used
    /// as [`Pooler::Transaction`] wants it. Logged once (the first caller to see it).
    fn found_transaction_pooler(&self, e: &diesel::result::Error) {
        if self.transaction_pooler.swap(true, Ordering::Relaxed) {
            return;
        }
        let session = match &self.direct {
            Some(direct) => format!("session work (the insert listener) goes to the direct URL {direct}"),
            None => "with no direct URL, the insert listener stops and the workers poll for new rows; give a direct                      URL to the server (PoolConfig::direct_url, `--direct-url`) to have inserts wake them"
                .to_owned(),
        };
        tracing::warn!(server = %self.target, error = %e,
            "the pool's statements go through a transaction pooler (PgBouncer with pool_mode = transaction?) that the              pool was not told about: switched to the transaction pooler's path (no statement kept prepared, every              unit of work in a transaction of its own) and carrying on; set it at start to skip the failures that              found it out: `--pooler transaction` (PoolConfig::pooler(Pooler::Transaction)); {session}");
    }

    /// Whether [`PgPool::session`] can give a session: false behind a transaction pooler with
    /// no direct URL.
    pub(crate) fn has_session(&self) -> bool {
        self.session_target().is_some()
    }

    /// Where session work connects: the direct URL, the pool's own without a transaction
    /// pooler, nowhere behind one without a direct URL.
    fn session_target(&self) -> Option<&ConnectionString> {
        match (&self.direct, self.pooler()) {
            (Some(direct), _) => Some(direct),
            (None, Pooler::None) => Some(&self.target),
            (None, Pooler::Transaction) => None,
        }
    }

    /// The connection string session work connects to, when there is one (for the words of
    /// a [`StoreError::NoAnswer`] about it).
    pub(crate) fn session_url(&self) -> Option<ConnectionString> {
        self.session_target().cloned()
    }

    /// A connection of its own, outside the pool, for work that holds a session (`LISTEN`, a
    /// session advisory lock, `CREATE INDEX CONCURRENTLY`): to the direct URL, or to the pool's
    /// own server without a transaction pooler. `None` behind a transaction pooler with no
    /// direct URL.
    pub(crate) async fn session(&self) -> Option<Result<AsyncPgConnection, StoreError>> {
        let target = self.session_target()?;
        Some(open(target).await.map_err(StoreError::Connect))
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
    in_transaction_set(conn, "SET LOCAL enable_seqscan = off; SET LOCAL jit = off", f).await
}

/// Runs `f` on `conn` in a transaction of its own (committed when `f` succeeds, rolled back
/// when it fails), or as part of the one `conn` is in. The store's operator functions run this
/// way whatever the pooler, so that they work on any connection.
///
/// A transaction of its own is bounded as [`in_transaction_idle`] with [`IDLE_IN_TRANSACTION`]:
/// the claim's transaction holds the rows it leases locked until it commits, the sweep's holds
/// the horizon's row, and a link that froze after the server ran a statement (nothing closed,
/// so the server never learns the client left) would otherwise keep those locks, and the rows
/// from every other claim, for as long as the server's keepalives take to notice (two hours by
/// default).
pub(crate) async fn in_transaction<T, E>(
    conn: &mut AsyncPgConnection,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    transaction(conn, IDLE_IN_TRANSACTION, "", f).await
}

/// [`in_transaction`], with `settings` (`SET LOCAL` statements) run first, in the same round
/// trip as its `BEGIN` when the transaction is its own.
pub(crate) async fn in_transaction_set<T, E>(
    conn: &mut AsyncPgConnection,
    settings: &str,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    transaction(conn, IDLE_IN_TRANSACTION, settings, f).await
}

/// [`in_transaction`], the transaction ended by the server (its session terminated, its locks
/// released) if it waits longer than `idle` for the client's next statement: a client whose
/// link went silent between two statements holds no lock for longer than that.
pub(crate) async fn in_transaction_idle<T, E>(
    conn: &mut AsyncPgConnection,
    idle: Duration,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    transaction(conn, idle, "", f).await
}

async fn transaction<T, E>(
    conn: &mut AsyncPgConnection,
    idle: Duration,
    settings: &str,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    let depth = AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth();
    if !matches!(depth, Ok(None)) {
        if !settings.is_empty() {
            conn.batch_execute(settings).await?;
        }
        return f(conn).await;
    }
    // One round trip, as a plain BEGIN, the settings with it.
    let begin = format!("{}{}; {settings}", super::sql::BEGIN_IDLE_BOUNDED, idle.as_millis().max(1));
    AnsiTransactionManager::begin_transaction_sql(conn, &begin).await?;
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
