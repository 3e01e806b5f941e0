//! Test databases left behind (by a run killed before its values dropped, or a drop that gave
//! up), and how a later run tells them from everything else on the server.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use diesel::sql_types::{Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::error::StoreError;
use crate::store;
use crate::url::ConnectionString;

/// The default age after which a test database left behind is removed.
pub(super) const STALE_AFTER: Duration = Duration::from_secs(3600);

/// The name of a test database: `outbox_test_<seconds>_<pid>_<n>`, `<seconds>` the server's
/// clock when it was created (what its age is read from; ten digits, from 2001 to 2286),
/// `<pid>` the creating process's, `<n>` its count of databases so far.
pub(super) fn name(seconds: i64, pid: u32, n: u64) -> String {
    format!("outbox_test_{seconds:010}_{pid}_{n}")
}

/// Drops the test databases of the server of `server_url` that [`TestDatabase`](super::TestDatabase)
/// made and nobody uses any more, once they are older than `older_than`, and returns their
/// names. [`TestDatabase`](super::TestDatabase) calls it, with an hour, the first time a
/// process creates a database on a server; call it yourself to clean up at once (a CI job's
/// first step, say).
///
/// A database is taken for a stale test database only when all of these hold, so that no
/// other database is touched, whoever made it:
///
/// - its name is exactly `outbox_test_<seconds>_<pid>_<n>` (digits only, ten of them for the
///   seconds), as the kit names them;
/// - it is owned by the role this connects as (`current_user`): another user's databases are
///   never dropped, whatever their name;
/// - it is older than `older_than`, by the server's clock, from the `<seconds>` in its name;
/// - nobody is connected to it (a test still running holds its pool's connections): it is
///   dropped without `FORCE`, so a session that connects in between makes the drop fail,
///   and the database is kept.
///
/// `server_url` reaches the server as [`TestDatabase::create`](super::TestDatabase::create)'s
/// does. Fails only when the server cannot be reached or read; a database that cannot be
/// dropped is skipped.
pub async fn drop_stale_databases(server_url: &str, older_than: Duration) -> Result<Vec<String>, StoreError> {
    let server = ConnectionString::parse(server_url)?;
    let mut admin = store::open(&server).await.map_err(StoreError::Connect)?;
    drop_stale(&mut admin, older_than).await
}

/// [`drop_stale_databases`] on `admin`, the first time this process creates a database on
/// `server`; failures are only logged (at `debug`): the sweep is a courtesy, the test's own
/// database is what matters.
pub(super) async fn sweep_once(admin: &mut AsyncPgConnection, server: &ConnectionString, older_than: Duration) {
    static SWEPT: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let first = SWEPT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert_with(HashSet::new)
        .insert(server.expose().to_owned());
    if !first {
        return;
    }
    match drop_stale(admin, older_than).await {
        Ok(dropped) if !dropped.is_empty() => tracing::info!(?dropped, "dropped stale test databases"),
        Ok(_) => {}
        Err(e) => tracing::debug!(error = %e, "could not look for stale test databases"),
    }
}

async fn drop_stale(admin: &mut AsyncPgConnection, older_than: Duration) -> Result<Vec<String>, StoreError> {
    #[derive(diesel::QueryableByName)]
    struct Stale {
        #[diesel(sql_type = Text)]
        name: String,
    }
    let stale: Vec<Stale> = diesel::sql_query(store::STALE_TEST_DATABASES_SQL)
        .bind::<Double, _>(older_than.as_secs_f64())
        .load(admin)
        .await?;
    let mut dropped = Vec::new();
    for Stale { name } in stale {
        // Names of the kit's pattern only (checked by the query): digits and underscores, safe
        // to quote as they are.
        match admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\"")).await {
            Ok(()) => dropped.push(name),
            Err(e) => tracing::debug!(database = %name, error = %e, "kept a stale test database"),
        }
    }
    Ok(dropped)
}
