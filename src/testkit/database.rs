//! A throwaway database per test: created and migrated on a server given by URL, dropped with
//! its value, retrying while the server is crowded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::migration::{Migration, MigrationSource};
use diesel::pg::Pg;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::stale;
use crate::error::StoreError;
use crate::store::{self, PgPool, PoolConfig};
use crate::url::ConnectionString;

/// The variable [`TestDatabase::from_env`] reads the server's connection string from.
const SERVER_URL_VAR: &str = "TEST_DATABASE_URL";
/// The server [`TestDatabase::from_env`] uses when [`SERVER_URL_VAR`] is unset: the one the
/// crate's README and docs/testing.md describe (PostgreSQL on 127.0.0.1:5432, user `root`,
/// trust authentication).
const DEFAULT_SERVER_URL: &str = "postgres://root@127.0.0.1:5432/postgres";
/// Where `CREATE DATABASE` runs when the server's URL names no database.
const MAINTENANCE_DATABASE: &str = "postgres";
/// Connections in a test database's pool: enough for a dispatcher (its workers, its listener,
/// its finalizer) beside the test's own writes.
const POOL_SIZE: u32 = 8;
/// How long the drop keeps trying (a crowded server, a restart) before it reports the database
/// left behind.
const DROP_TIMEOUT: Duration = Duration::from_secs(60);
/// First pause between two attempts of the drop; it doubles up to [`DROP_BACKOFF_MAX`].
const DROP_BACKOFF_MIN: Duration = Duration::from_millis(50);
const DROP_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Attempts at a name another process took in the same second (same pid on another host).
const NAME_ATTEMPTS: u32 = 5;

/// A database of one test's own: created, with the outbox's tables (and, with the `inbox`
/// feature, the inbox's, then the application's own: [`TestDatabaseOptions`]), on a server
/// given by URL; dropped when this value is.
///
/// Every test gets its own, so tests run in parallel against one server and leave nothing
/// behind. The name is `outbox_test_<seconds>_<pid>_<n>`, unique on the server, `<seconds>`
/// being the server's clock at creation (what tells a stale one, see
/// [`drop_stale_databases`](super::drop_stale_databases)).
///
/// ```no_run
/// # async fn example() -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::testkit::TestDatabase;
///
/// // TEST_DATABASE_URL, else postgres://root@127.0.0.1:5432/postgres
/// let db = TestDatabase::from_env().await?;
/// let mut conn = db.pool().get().await?; // a migrated, empty outbox
/// # drop(conn);
/// # Ok(()) }
/// ```
///
/// The drop closes the pool's connections, then runs `DROP DATABASE ... WITH (FORCE)` on a
/// thread of its own, so it works inside an async test and while a failed test unwinds;
/// connections still open (a clone of the pool, a dispatcher's) are closed by the server. When
/// the server refuses (`too many clients`) or is away, the drop tries again, with a growing
/// pause, for up to a minute ([`TestDatabaseOptions::drop_timeout`]). If it still fails, it
/// says so on stderr, which a test run shows, naming the database and how to remove it; a run
/// killed before its values drop leaves its databases too. Either kind is removed by a later
/// run (see [`drop_stale_databases`](super::drop_stale_databases)).
pub struct TestDatabase {
    name: String,
    url: ConnectionString,
    /// `None` only while [`TestDatabaseOptions::create_with`] fills the database, and once the
    /// drop has closed it.
    pool: Option<PgPool>,
    /// The server's maintenance database, where the drop runs.
    server: ConnectionString,
    drop_timeout: Duration,
    stale_after: Duration,
}

impl std::fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDatabase").field("name", &self.name).field("url", &self.url).finish_non_exhaustive()
    }
}

impl TestDatabase {
    /// Creates a fresh database on the server of `server_url` and migrates it:
    /// `TestDatabase::options().server_url(server_url).create()`.
    ///
    /// `server_url` is any connection string (URL or `key=value`) that reaches the server as a
    /// role allowed to create databases; the database it names (`postgres`, say; `postgres`
    /// when a URL names none) is where the `CREATE DATABASE` runs, and every other option
    /// (host, port, user, password, `sslmode`) carries over to the new database's URL.
    ///
    /// A server that refuses or does not answer fails it at once with [`StoreError::Connect`],
    /// in the server's or the driver's words (`database connection failed: db error: FATAL:
    /// sorry, too many clients already`, `... error connecting to server: Connection refused
    /// (os error 111)`).
    pub async fn create(server_url: &str) -> Result<Self, StoreError> {
        Self::options().server_url(server_url).create().await
    }

    /// Creates a fresh database on the server `TEST_DATABASE_URL` names, or on
    /// `postgres://root@127.0.0.1:5432/postgres` when it is unset: `TestDatabase::options().create()`.
    pub async fn from_env() -> Result<Self, StoreError> {
        Self::options().create().await
    }

    /// The settings of a new database, to change before creating it: the server, the pool's
    /// size, the application's own migrations or setup, the drop's patience.
    pub fn options() -> TestDatabaseOptions {
        TestDatabaseOptions::default()
    }

    /// A pool of connections to the database.
    pub fn pool(&self) -> &PgPool {
        self.pool.as_ref().expect("a test database has its pool from creation to drop")
    }

    /// The database's connection string, for code under test that connects by itself (a
    /// service's `main`, the command line). [`ConnectionString::expose`] gives the text.
    pub fn url(&self) -> &ConnectionString {
        &self.url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A connection of its own, outside the pool (for a `LISTEN`, or a session setting).
    pub async fn connect(&self) -> Result<AsyncPgConnection, StoreError> {
        store::open(&self.url).await.map_err(StoreError::Connect)
    }
}

/// How [`TestDatabase`] makes a database: [`TestDatabase::options`], changed, then
/// [`create`](TestDatabaseOptions::create) or [`create_with`](TestDatabaseOptions::create_with).
///
/// ```no_run
/// # async fn example() -> Result<(), actix_outbox::StoreError> {
/// use std::time::Duration;
/// use actix_outbox::testkit::TestDatabase;
/// use diesel_async::SimpleAsyncConnection;
///
/// let db = TestDatabase::options()
///     .pool_size(4)
///     .drop_timeout(Duration::from_secs(120))
///     // the application's own tables, after the outbox's
///     .create_with(async |conn| conn.batch_execute("CREATE TABLE orders (id bigserial PRIMARY KEY)").await)
///     .await?;
/// # Ok(()) }
/// ```
///
/// An application with diesel migrations of its own hands them over instead:
/// `.migrations(MIGRATIONS)` with `const MIGRATIONS: EmbeddedMigrations = embed_migrations!();`.
pub struct TestDatabaseOptions {
    server_url: Option<String>,
    pool_size: u32,
    migrations: Vec<AppMigrations>,
    drop_timeout: Duration,
    stale_after: Duration,
}

impl Default for TestDatabaseOptions {
    /// The server of `TEST_DATABASE_URL` (else `postgres://root@127.0.0.1:5432/postgres`), a
    /// pool of 8, no migrations but the crate's, a drop that tries for a minute, and stale
    /// databases removed after an hour.
    fn default() -> Self {
        Self {
            server_url: None,
            pool_size: POOL_SIZE,
            migrations: Vec::new(),
            drop_timeout: DROP_TIMEOUT,
            stale_after: stale::STALE_AFTER,
        }
    }
}

impl std::fmt::Debug for TestDatabaseOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDatabaseOptions")
            .field("server_url", &self.server_url.as_deref().map(crate::url::mask_url))
            .field("pool_size", &self.pool_size)
            .field("migrations", &self.migrations.len())
            .field("drop_timeout", &self.drop_timeout)
            .field("stale_after", &self.stale_after)
            .finish()
    }
}

/// The application's migrations, as diesel's harness takes them.
struct AppMigrations(Box<dyn MigrationSource<Pg> + Send + Sync>);

impl MigrationSource<Pg> for AppMigrations {
    fn migrations(&self) -> diesel::migration::Result<Vec<Box<dyn Migration<Pg>>>> {
        self.0.migrations()
    }
}

/// A setup hook that failed, named with its database.
#[derive(Debug, thiserror::Error)]
#[error("the setup of test database {database} failed: {}", crate::url::with_causes(.cause.as_ref()))]
struct SetupFailed {
    database: String,
    #[source]
    cause: Box<dyn std::error::Error + Send + Sync>,
}

impl TestDatabaseOptions {
    /// The server to create the database on (see [`TestDatabase::create`]). Default: the
    /// `TEST_DATABASE_URL` variable when it is set, else
    /// `postgres://root@127.0.0.1:5432/postgres`.
    #[must_use]
    pub fn server_url(mut self, url: impl Into<String>) -> Self {
        self.server_url = Some(url.into());
        self
    }

    /// How many connections the database's pool holds at most. Default 8: a dispatcher's
    /// workers and the test's own writes. Fewer leave more of a crowded server to the tests
    /// that run beside.
    #[must_use]
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// Also applies these migrations (the application's, `embed_migrations!()`), after the
    /// crate's own, each set in one transaction. They share diesel's table of applied versions
    /// with the crate's (whose versions start `2026`), so their versions must differ from those.
    /// Repeatable: the sets apply in the order given.
    #[must_use]
    pub fn migrations(mut self, set: impl MigrationSource<Pg> + Send + Sync + 'static) -> Self {
        self.migrations.push(AppMigrations(Box::new(set)));
        self
    }

    /// How long the drop keeps trying before it gives up and reports the database left behind
    /// on stderr. Default a minute.
    #[must_use]
    pub fn drop_timeout(mut self, timeout: Duration) -> Self {
        self.drop_timeout = timeout;
        self
    }

    /// The age after which a test database left behind on the server (by a killed run, or a
    /// drop that failed) is removed by the first database this process creates there (see
    /// [`drop_stale_databases`](super::drop_stale_databases)). Default an hour.
    #[must_use]
    pub fn stale_after(mut self, age: Duration) -> Self {
        self.stale_after = age;
        self
    }

    /// Creates the database and migrates it (the crate's migrations, the inbox's with the
    /// `inbox` feature, then those given to [`migrations`](Self::migrations)).
    pub async fn create(self) -> Result<TestDatabase, StoreError> {
        self.create_with(async |_| Ok::<(), StoreError>(())).await
    }

    /// [`create`](Self::create), then `setup` on a connection of its own to the new database:
    /// the application's tables, seed rows, anything else its tests expect. A `setup` that
    /// fails fails the creation with [`StoreError::Migration`], naming the database (which is
    /// dropped).
    pub async fn create_with<E>(
        self,
        setup: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<(), E>,
    ) -> Result<TestDatabase, StoreError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let given = match self.server_url {
            Some(url) => url,
            None => std::env::var(SERVER_URL_VAR).unwrap_or_else(|_| DEFAULT_SERVER_URL.to_owned()),
        };
        let server = ConnectionString::parse(&given)?;
        let server = match server.require_database() {
            Ok(_) => server,
            Err(_) => server.with_database(MAINTENANCE_DATABASE),
        };
        let mut admin = store::open(&server).await.map_err(StoreError::Connect)?;
        stale::sweep_once(&mut admin, &server, self.stale_after).await;
        let name = create_database(&mut admin).await?;
        drop(admin);
        // From here on the database exists: dropping `db` removes it whatever fails next.
        let mut db = TestDatabase {
            url: server.with_database(&name),
            name,
            pool: None,
            server,
            drop_timeout: self.drop_timeout,
            stale_after: self.stale_after,
        };
        store::migrate(db.url.expose()).await?;
        #[cfg(feature = "inbox")]
        crate::inbox::migrate_inbox(db.url.expose()).await?;
        for set in self.migrations {
            store::apply_migrations(db.url.expose(), set).await?;
        }
        let mut conn = db.connect().await?;
        setup(&mut conn)
            .await
            .map_err(|e| StoreError::Migration(Box::new(SetupFailed { database: db.name.clone(), cause: e.into() })))?;
        drop(conn);
        db.pool = Some(PoolConfig::new(db.url.expose()).size(self.pool_size).connect().await?);
        Ok(db)
    }
}

/// Creates a database of a fresh name on `admin`'s server and returns the name.
async fn create_database(admin: &mut AsyncPgConnection) -> Result<String, StoreError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    #[derive(diesel::QueryableByName)]
    struct Now {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        seconds: i64,
    }
    let now: Now = diesel::sql_query(store::SERVER_SECONDS_SQL).get_result(admin).await?;
    let mut attempt = 0;
    loop {
        let name = stale::name(now.seconds, std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        match admin.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await {
            Ok(()) => return Ok(name),
            // The same name from a process of the same pid on another host, in the same second.
            Err(diesel::result::Error::DatabaseError(_, info))
                if info.message().ends_with("already exists") && attempt + 1 < NAME_ATTEMPTS =>
            {
                attempt += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // The pool's connections go first, so that they do not hold slots of a crowded server
        // while the drop waits for one (those of a clone of the pool, the server closes).
        drop(self.pool.take());
        let server = self.server.clone();
        let name = self.name.clone();
        let timeout = self.drop_timeout;
        // Drop may run inside the test's runtime (maybe while it unwinds), where blocking on a
        // future is not allowed: a thread with a runtime of its own does it.
        let dropped = std::thread::spawn(move || drop_database(&server, &name, timeout)).join();
        let failure = match dropped {
            Ok(Ok(())) => return,
            Ok(Err(failure)) => failure,
            Err(_) => "the thread dropping it panicked".to_owned(),
        };
        let message = format!(
            "actix-outbox testkit: could not drop the test database {name:?} on {server}: {failure}. Drop it by \
             hand (DROP DATABASE \"{name}\" WITH (FORCE)), or leave it to a later run: the first test database a \
             process creates on this server removes those left behind once they are {age} old",
            name = self.name,
            server = self.server,
            age = humantime::format_duration(self.stale_after),
        );
        tracing::warn!(database = %self.name, "{message}");
        // Where a test run shows it, with or without a subscriber (the harness captures it for
        // the test that dropped the value, and shows it when that test fails).
        eprintln!("{message}");
    }
}

/// Drops database `name` through `server`, trying again while the server refuses or fails,
/// for up to `timeout`; what went wrong last when it gives up.
fn drop_database(server: &ConnectionString, name: &str, timeout: Duration) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    runtime.block_on(async {
        let started = Instant::now();
        let mut pause = DROP_BACKOFF_MIN;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let attempt = async {
                let mut admin = store::open(server).await.map_err(StoreError::Connect)?;
                admin.batch_execute(&sql).await.map_err(StoreError::from)
            };
            let error = match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if started.elapsed() + pause > timeout {
                return Err(format!(
                    "{attempts} attempt(s) in {}, the last one: {error}",
                    humantime::format_duration(Duration::from_millis(started.elapsed().as_millis() as u64))
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(DROP_BACKOFF_MAX);
        }
    })
}
