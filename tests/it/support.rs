//! Test fixtures: a fresh migrated database per test, and helpers to read rows back.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use actix_outbox::schema::outbox;
use actix_outbox::{NewEvent, OutboxRow, PgPool};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

/// The server the tests use; `TEST_DATABASE_URL` overrides (any database on it: each test
/// creates its own).
pub fn server_url() -> String {
    let url = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let slash = url.rfind('/').expect("database url has a path");
    url[..slash].to_owned()
}

/// A uniquely named, migrated database, dropped when the test ends.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl TestDb {
    pub async fn new() -> Self {
        let name =
            format!("outbox_it_{}_{}_{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed), rand_suffix());
        let mut admin = AsyncPgConnection::establish(&format!("{}/postgres", server_url()))
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432 (see README)");
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create test database");
        let url = format!("{}/{name}", server_url());
        actix_outbox::migrate(&url).await.expect("migrate test database");
        let pool = actix_outbox::connect_pool(&url, 16).await.expect("pool");
        TestDb { name, url, pool }
    }

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

    pub async fn row(&self, id: i64) -> OutboxRow {
        let mut conn = self.conn().await;
        outbox::table.find(id).select(OutboxRow::as_select()).first(&mut conn).await.expect("row")
    }

    pub async fn rows(&self) -> Vec<OutboxRow> {
        let mut conn = self.conn().await;
        outbox::table.order(outbox::id).select(OutboxRow::as_select()).load(&mut conn).await.expect("rows")
    }

    pub async fn count_status(&self, status: &str) -> i64 {
        let mut conn = self.conn().await;
        outbox::table.filter(outbox::status.eq(status)).count().get_result(&mut conn).await.expect("count")
    }

    /// Makes every pending row claimable now (skips a backoff or deferral).
    pub async fn make_available(&self) {
        let mut conn = self.conn().await;
        conn.batch_execute("UPDATE outbox SET available_at = now() WHERE status = 'pending'").await.unwrap();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs inside the test's runtime; do the async cleanup on a thread of its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = AsyncPgConnection::establish(&format!("{}/postgres", server_url())).await {
                    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            });
        })
        .join();
    }
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    (h.finish() & 0xffff_ffff) as u32
}

/// Polls `check` until it returns true, failing the test after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
