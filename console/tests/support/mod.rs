//! Fixtures of the console's tests: a database of each test's own on the real PostgreSQL
//! server, and rows written into it in any state.
//!
//! `TEST_DATABASE_URL` names the server (default `postgres://root@127.0.0.1:5432/test`); each
//! test creates a uniquely named database there, migrates it with `actix_outbox::migrate`, and
//! drops it when its fixture is dropped, so tests run in parallel.
#![allow(dead_code)] // each test binary uses part of it

use std::sync::atomic::{AtomicU32, Ordering};

use actix_outbox::{ConnectionString, PgPool};
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn server() -> ConnectionString {
    let url = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    ConnectionString::parse(&url).unwrap_or_else(|e| panic!("TEST_DATABASE_URL: {e}"))
}

fn database_url(name: &str) -> String {
    server().with_database(name).expose().to_owned()
}

/// A uniquely named, migrated database with a pool, dropped when the test ends.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new() -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let name =
            format!("outbox_console_{}_{}_{nanos:08x}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let mut admin = AsyncPgConnection::establish(&database_url("postgres"))
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432 (see README)");
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create test database");
        let url = database_url(&name);
        actix_outbox::migrate(&url).await.expect("migrate test database");
        let pool = actix_outbox::connect_pool(&url, 4).await.expect("pool");
        TestDb { name, url, pool }
    }

    pub async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.url).await.expect("connect to test database")
    }

    /// Inserts a row of `status` (`pending`, `processing`, `done`, `dead`) and returns its id.
    pub async fn insert(&self, status: &str, aggregate_id: &str, event_type: &str, last_error: Option<&str>) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let mut conn = self.conn().await;
        let id: Id = diesel::sql_query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, status, attempts,
                                 last_error, lease_owner, lease_until, done_at)
             VALUES ('order', $1, $2, jsonb_build_object('aggregate', $1::text, 'n', 1),
                     jsonb_build_object('x-tenant', 'acme'), $3, $4, $5,
                     CASE WHEN $3 = 'processing' THEN 'test:worker-0' END,
                     CASE WHEN $3 = 'processing' THEN now() + interval '1 minute' END,
                     CASE WHEN $3 = 'done' THEN now() END)
             RETURNING id",
        )
        .bind::<Text, _>(aggregate_id)
        .bind::<Text, _>(event_type)
        .bind::<Text, _>(status)
        .bind::<Integer, _>(if status == "dead" { 12 } else { 1 })
        .bind::<Nullable<Text>, _>(last_error)
        .get_result(&mut conn)
        .await
        .expect("insert a row");
        id.id
    }

    /// `(status, attempts, last_error)` of a row.
    pub async fn state(&self, id: i64) -> (String, i32, Option<String>) {
        #[derive(diesel::QueryableByName)]
        struct State {
            #[diesel(sql_type = Text)]
            status: String,
            #[diesel(sql_type = Integer)]
            attempts: i32,
            #[diesel(sql_type = Nullable<Text>)]
            last_error: Option<String>,
        }
        let mut conn = self.conn().await;
        let s: State = diesel::sql_query("SELECT status, attempts, last_error FROM outbox WHERE id = $1")
            .bind::<BigInt, _>(id)
            .get_result(&mut conn)
            .await
            .expect("read a row");
        (s.status, s.attempts, s.last_error)
    }

    /// Rows per status, counted by the database.
    pub async fn count(&self, status: &str) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let mut conn = self.conn().await;
        let n: N = diesel::sql_query("SELECT count(*) AS n FROM outbox WHERE status = $1")
            .bind::<Text, _>(status)
            .get_result(&mut conn)
            .await
            .expect("count rows");
        n.n
    }
}

impl Drop for TestDb {
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

/// An aggregate id an attacker might write: markup, quotes, an ampersand, non-ASCII text.
pub const HOSTILE: &str =
    "<script>document.title='pwned'</script><b id=\"pwned\">\"quoted\" 'single' & ünïcødé ✓ 注文</b>";
