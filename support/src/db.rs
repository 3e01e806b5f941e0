//! PostgreSQL: the test server (`TEST_DATABASE_URL`) and databases of a test's own on it.

use actix_outbox::admin::OutboxRow;
use actix_outbox::schema::outbox;
use actix_outbox::{ConnectionString, NewEvent, PgPool};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::unique;

/// The test server (`TEST_DATABASE_URL`).
fn server() -> ConnectionString {
    let url = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    ConnectionString::parse(&url).unwrap_or_else(|e| panic!("TEST_DATABASE_URL: {e}"))
}

/// `host:port` of the test server over TCP, for a proxy in front of it.
pub fn database_addr() -> String {
    let url = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let config: tokio_postgres::Config = url.parse().expect("TEST_DATABASE_URL parses");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    format!("{host}:{}", config.get_ports().first().copied().unwrap_or(5432))
}

/// The connection string of database `name` on the test server.
pub fn database_url(name: &str) -> String {
    server().with_database(name).expose().to_owned()
}

/// A uniquely named database on the test server, not created here, dropped (if it exists by
/// then) when this is.
pub struct ScratchDb {
    /// The database's name.
    pub name: String,
    /// Its connection string.
    pub url: String,
}

impl ScratchDb {
    /// A fresh name on the test server; nothing is created yet.
    #[allow(clippy::new_without_default)] // a new database each time, not a default value
    pub fn new() -> Self {
        let name = unique("db").replace('.', "_");
        ScratchDb { url: database_url(&name), name }
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        // Drop runs inside the test's runtime (maybe while it unwinds): clean up on a thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = AsyncPgConnection::establish(&database_url("postgres")).await {
                    let _ = admin.batch_execute(&sql).await;
                }
            });
        })
        .join();
    }
}

/// A uniquely named, migrated database with a pool, dropped when the test ends.
pub struct TestDb {
    /// The database's name.
    pub name: String,
    /// Its connection string.
    pub url: String,
    /// A pool of up to 16 connections to it.
    pub pool: PgPool,
    _scratch: ScratchDb,
}

impl TestDb {
    /// Creates and migrates a fresh database.
    pub async fn new() -> Self {
        let scratch = ScratchDb::new();
        let mut admin = AsyncPgConnection::establish(&database_url("postgres"))
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432 (see README)");
        admin.batch_execute(&format!("CREATE DATABASE {}", scratch.name)).await.expect("create test database");
        actix_outbox::migrate(&scratch.url).await.expect("migrate test database");
        let pool = actix_outbox::connect_pool(&scratch.url, 16).await.expect("pool");
        TestDb { name: scratch.name.clone(), url: scratch.url.clone(), pool, _scratch: scratch }
    }

    /// The source name a dispatcher derives for this database (`x-outbox-source`).
    pub async fn source(&self) -> String {
        let source = actix_outbox::admin::outbox_source(&mut self.conn().await).await.unwrap();
        let (system, rest) = source.split_once('/').expect("system identifier first");
        assert!(system.parse::<u64>().is_ok(), "a decimal system identifier: {source}");
        assert_eq!(rest, format!("{}/public.outbox", self.name), "then the database and the table");
        source
    }

    /// A connection of its own to the database, outside the pool.
    pub async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.url).await.expect("connect to test database")
    }

    /// Inserts `n` events of aggregate `agg`, returning their ids.
    pub async fn seed(&self, n: usize, agg: &str) -> Vec<i64> {
        let events: Vec<_> =
            (0..n).map(|i| NewEvent::new("test", agg, "test.happened", serde_json::json!({"n": i}))).collect();
        let mut conn = self.conn().await;
        let mut ids = Vec::new();
        for chunk in events.chunks(1000) {
            ids.extend(actix_outbox::enqueue_many(&mut conn, chunk).await.expect("seed"));
        }
        ids
    }

    /// Row `id`, which must exist.
    pub async fn row(&self, id: i64) -> OutboxRow {
        let mut conn = self.conn().await;
        outbox::table.find(id).select(OutboxRow::as_select()).first(&mut conn).await.expect("row")
    }

    /// Every row, by id.
    pub async fn rows(&self) -> Vec<OutboxRow> {
        let mut conn = self.conn().await;
        outbox::table.order(outbox::id).select(OutboxRow::as_select()).load(&mut conn).await.expect("rows")
    }

    /// Rows whose status is `status`.
    pub async fn count_status(&self, status: &str) -> i64 {
        let mut conn = self.conn().await;
        outbox::table.filter(outbox::status.eq(status)).count().get_result(&mut conn).await.expect("count")
    }

    /// The `bigint` column `n` of the one row `sql` returns (`SELECT count(*) AS n FROM ...`):
    /// for the tables a test adds (an inbox, a handler's effects).
    pub async fn scalar(&self, sql: &str) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let n: N =
            diesel::sql_query(sql).get_result(&mut self.conn().await).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        n.n
    }

    /// Makes every pending row claimable now (skips a backoff or deferral).
    pub async fn make_available(&self) {
        let mut conn = self.conn().await;
        conn.batch_execute("UPDATE outbox SET available_at = now() WHERE status = 'pending'").await.unwrap();
    }
}

/// Whether database `name` exists on the test server.
pub async fn database_exists(name: &str) -> bool {
    #[derive(diesel::QueryableByName)]
    struct Found {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        found: bool,
    }
    let mut admin = AsyncPgConnection::establish(&database_url("postgres")).await.unwrap();
    let found: Found = diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS found")
        .bind::<diesel::sql_types::Text, _>(name)
        .get_result(&mut admin)
        .await
        .unwrap();
    found.found
}
