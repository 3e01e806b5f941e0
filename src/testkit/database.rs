//! A throwaway database per test.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

use crate::error::StoreError;
use crate::store::{self, PgPool};
use crate::url::ConnectionString;

/// Connections in a test database's pool: enough for a dispatcher (its workers, its listener,
/// its finalizer) beside the test's own writes.
const POOL_SIZE: u32 = 8;

/// A database of one test's own: created, with the outbox's tables (and, with the `inbox`
/// feature, the inbox's), on a server given by URL; dropped when this value is.
///
/// Every test gets its own, so tests run in parallel against one server and leave nothing
/// behind. The name is `outbox_test_<pid>_<n>_<time>`, unique on the server.
///
/// ```no_run
/// # async fn example() -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::testkit::TestDatabase;
///
/// let db = TestDatabase::create("postgres://root@127.0.0.1:5432/postgres").await?;
/// let mut conn = db.pool().get().await?; // a migrated, empty outbox
/// # drop(conn);
/// # Ok(()) }
/// ```
///
/// The drop runs `DROP DATABASE ... WITH (FORCE)` on a thread of its own, so it works inside
/// an async test and while a failed test unwinds; connections still open (the pool's, a
/// dispatcher's) are closed by the server. A test killed before its values drop leaves its
/// database behind: the `outbox_test_` prefix tells which to remove.
pub struct TestDatabase {
    name: String,
    url: ConnectionString,
    server: ConnectionString,
    pool: PgPool,
}

impl std::fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDatabase").field("name", &self.name).field("url", &self.url).finish_non_exhaustive()
    }
}

impl TestDatabase {
    /// Creates a fresh database on the server of `server_url` and migrates it.
    ///
    /// `server_url` is any connection string (URL or `key=value`) that reaches the server as a
    /// role allowed to create databases; the database it names (`postgres`, say) is where the
    /// `CREATE DATABASE` runs, and every other option (host, port, user, password, `sslmode`)
    /// carries over to the new database's URL.
    pub async fn create(server_url: &str) -> Result<Self, StoreError> {
        let server = ConnectionString::parse(server_url)?;
        let name = unique_name();
        let url = server.with_database(&name);
        // The pool connects lazily: made before the database exists, it cannot fail after.
        let pool = store::connect_pool(url.expose(), POOL_SIZE).await?;
        let mut admin = AsyncPgConnection::establish(server.expose()).await?;
        admin.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await?;
        // From here on the database exists: dropping `db` removes it whatever fails next.
        let db = TestDatabase { pool, name, url, server };
        store::migrate(db.url.expose()).await?;
        #[cfg(feature = "inbox")]
        crate::inbox::migrate_inbox(db.url.expose()).await?;
        Ok(db)
    }

    /// A pool of connections to the database.
    pub fn pool(&self) -> &PgPool {
        &self.pool
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
        Ok(AsyncPgConnection::establish(self.url.expose()).await?)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let server = self.server.expose().to_owned();
        let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        let name = self.name.clone();
        // Drop may run inside the test's runtime (maybe while it unwinds), where blocking on a
        // future is not allowed: a thread with a runtime of its own does it.
        let dropped = std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut admin = AsyncPgConnection::establish(&server).await.map_err(|e| e.to_string())?;
                admin.batch_execute(&sql).await.map_err(|e| e.to_string())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(database = %name, error = %e, "could not drop the test database"),
            Err(_) => tracing::warn!(database = %name, "dropping the test database panicked"),
        }
    }
}

/// `outbox_test_<pid>_<n>_<nanoseconds>`: unique among this process's databases by `n`, among
/// processes by the pid and the clock.
fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("outbox_test_{}_{n}_{nanos}", std::process::id())
}
