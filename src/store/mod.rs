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
mod claim;
mod fence;
mod fifo;
mod finalize;
mod prepared;
mod producer;
mod sql;

use diesel::ConnectionError;
use diesel_async::pooled_connection::bb8::{Pool, RunError};
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

pub use admin::{SKIPPED_PREFIX, Stats, dead_list, dead_retry, dead_retry_all, dead_skip, purge_done, stats};
pub use claim::{AggregateKey, Claim, ClaimParams, HeadsScan, ReadyPosition, claim, explain_claim};
pub use fifo::{BlockedAggregate, blocked_aggregates, blocked_aggregates_count};
pub use finalize::{
    Bury, Reschedule, Rescheduled, extend_leases, mark_dead, mark_done, reschedule, settled_at_version,
};
pub use producer::{enqueue, enqueue_many, enqueue_ordered, lock_aggregate};

use crate::error::StoreError;

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
/// processing row (measured 5× slower at 500 rows); the claim's plan depends on its `LIMIT` and
/// resume position. Custom plans see the real values on every run.
const SESSION_SETUP: &str = "SET plan_cache_mode = force_custom_plan; SET application_name = 'actix-outbox'";

/// Opens a pool of `size` connections to `database_url`, each set up for the dispatcher.
/// Connections are made lazily, so this fails only on a malformed URL; [`check_connection`]
/// proves the database is reachable.
pub async fn connect_pool(database_url: &str, size: u32) -> Result<PgPool, StoreError> {
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    config.custom_setup = Box::new(|url| {
        let url = url.to_owned();
        Box::pin(async move {
            let mut conn = AsyncPgConnection::establish(&url).await?;
            conn.batch_execute(SESSION_SETUP).await.map_err(ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        })
    });
    // A checkout does not ping: a `SELECT 1` before every claim and every finalize flush was a
    // round trip of its own. A connection whose socket closed is still dropped (bb8 asks
    // `is_broken` on return), and a statement on a connection that died unnoticed fails like
    // any other transient error: the claim actor polls again, the finalizer retries.
    config.recycling_method = RecyclingMethod::Fast;
    let manager = AsyncDieselConnectionManager::new_with_config(database_url, config);
    let pool = Pool::builder()
        .max_size(size.max(1))
        .connection_timeout(std::time::Duration::from_secs(10))
        .build(manager)
        .await
        .map_err(|e| StoreError::Connect(e.to_string()))?;
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
/// Runs the synchronous migration harness on a blocking thread, so it is safe to await from an
/// actix or tokio runtime (diesel's async harness is not, under actix's current-thread runtime).
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let applied = actix_outbox::migrate("postgres://localhost/app").await?;
/// println!("applied {applied:?}");
/// # Ok(()) }
/// ```
pub async fn migrate(database_url: &str) -> Result<Vec<String>, StoreError> {
    let url = database_url.to_owned();
    tokio::task::spawn_blocking(move || migrate_blocking(&url))
        .await
        .map_err(|e| StoreError::Migration(format!("migration thread failed: {e}")))?
}

/// [`migrate`] for callers outside any async runtime (a `main` before the actix system starts).
pub fn migrate_blocking(database_url: &str) -> Result<Vec<String>, StoreError> {
    use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
    let mut conn: AsyncConnectionWrapper<AsyncPgConnection> =
        diesel::Connection::establish(database_url).map_err(StoreError::from)?;
    let applied = conn.run_pending_migrations(MIGRATIONS).map_err(|e| StoreError::Migration(e.to_string()))?;
    Ok(applied.into_iter().map(|v| v.to_string()).collect())
}

/// The embedded migrations not yet applied to `database_url`, by name (empty when the schema is
/// up to date). A dispatcher started on an unmigrated database would log a failed claim every
/// poll; check this first and say what to do.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let pending = actix_outbox::store::pending_migrations("postgres://localhost/app").await?;
/// assert!(pending.is_empty(), "run `actix-outbox migrate` first: {pending:?}");
/// # Ok(()) }
/// ```
pub async fn pending_migrations(database_url: &str) -> Result<Vec<String>, StoreError> {
    use diesel::migration::Migration;
    use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
    let url = database_url.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn: AsyncConnectionWrapper<AsyncPgConnection> = diesel::Connection::establish(&url)?;
        let pending = conn.pending_migrations(MIGRATIONS).map_err(|e| StoreError::Migration(e.to_string()))?;
        Ok(pending.iter().map(|m| m.name().to_string()).collect())
    })
    .await
    .map_err(|e| StoreError::Migration(format!("migration thread failed: {e}")))?
}

/// Creates the database named in `database_url` when it does not exist yet, by connecting to the
/// `postgres` maintenance database of the same server. Returns whether it created it.
pub async fn ensure_database(database_url: &str) -> Result<bool, StoreError> {
    let (server_url, name) = split_database_url(database_url)?;
    if AsyncPgConnection::establish(database_url).await.is_ok() {
        return Ok(false);
    }
    let mut admin = AsyncPgConnection::establish(&format!("{server_url}/postgres")).await?;
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let found: Exists = diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS exists")
        .bind::<diesel::sql_types::Text, _>(&name)
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

/// Splits `postgres://user@host:port/db?opts` into (`postgres://user@host:port`, `db`).
fn split_database_url(url: &str) -> Result<(String, String), StoreError> {
    let bad = || StoreError::BadUrl(mask_password(url));
    let rest = url.strip_prefix("postgres://").or_else(|| url.strip_prefix("postgresql://")).ok_or_else(bad)?;
    let slash = rest.find('/').ok_or_else(bad)?;
    let name = rest[slash + 1..].split('?').next().unwrap_or_default();
    if name.is_empty() {
        return Err(bad());
    }
    let scheme_len = url.len() - rest.len();
    Ok((url[..scheme_len + slash].to_owned(), name.to_owned()))
}

/// `url` with any password replaced by `***`, fit for logs and error messages.
///
/// ```
/// assert_eq!(
///     actix_outbox::mask_password("postgres://app:s3cret@db:5432/app"),
///     "postgres://app:***@db:5432/app"
/// );
/// ```
pub fn mask_password(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else { return url.to_owned() };
    let authority_end = url[scheme_end..].find(['/', '?']).map_or(url.len(), |i| scheme_end + i);
    let authority = &url[scheme_end..authority_end];
    match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at => {
            format!("{}{}:***{}", &url[..scheme_end], &authority[..colon], &url[scheme_end + at..])
        }
        _ => url.to_owned(),
    }
}

/// Maps pool errors onto the store's error type.
impl From<RunError> for StoreError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::User(e) => StoreError::Pool(e.to_string()),
            RunError::TimedOut => StoreError::Pool("timed out waiting for a connection".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_urls() {
        assert_eq!(
            split_database_url("postgres://root@127.0.0.1:5432/test?sslmode=disable").unwrap(),
            ("postgres://root@127.0.0.1:5432".to_owned(), "test".to_owned())
        );
        assert!(split_database_url("postgres://host").is_err());
        assert!(split_database_url("mysql://host/db").is_err());
    }

    #[test]
    fn masks_passwords_only() {
        assert_eq!(mask_password("amqp://guest:guest@h:5672/%2f"), "amqp://guest:***@h:5672/%2f");
        assert_eq!(mask_password("postgres://root@h/db"), "postgres://root@h/db");
        assert_eq!(mask_password("postgres://h:5432/db"), "postgres://h:5432/db");
    }
}
