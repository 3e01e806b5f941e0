//! Fixtures of the console's tests: the shared [`TestDb`](actix_outbox_test_support::TestDb) (a
//! database of each test's own on the real PostgreSQL server, migrated, dropped at the end), and
//! rows written into it in any state.
#![allow(dead_code)] // each test binary uses part of it

use std::ops::Deref;

use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

/// The shared fixture, with what the console's tests add.
pub struct TestDb(actix_outbox_test_support::TestDb);

impl Deref for TestDb {
    type Target = actix_outbox_test_support::TestDb;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl TestDb {
    pub async fn new() -> Self {
        TestDb(actix_outbox_test_support::TestDb::new().await)
    }

    pub async fn conn(&self) -> AsyncPgConnection {
        self.0.conn().await
    }

    /// Inserts a row of `status` (`pending`, `processing`, `done`, `dead`), as the dispatcher
    /// leaves one (a dead row waits at `available_at` 9999-12-31, never due), and returns its id.
    pub async fn insert(&self, status: &str, aggregate_id: &str, event_type: &str, last_error: Option<&str>) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let mut conn = self.conn().await;
        let id: Id = diesel::sql_query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, status, attempts,
                                 last_error, lease_owner, lease_until, done_at, available_at)
             VALUES ('order', $1, $2, jsonb_build_object('aggregate', $1::text, 'n', 1),
                     jsonb_build_object('x-tenant', 'acme'), $3, $4, $5,
                     CASE WHEN $3 = 'processing' THEN 'test:worker-0' END,
                     CASE WHEN $3 = 'processing' THEN now() + interval '1 minute' END,
                     CASE WHEN $3 = 'done' THEN now() END,
                     CASE WHEN $3 = 'dead' THEN '9999-12-31 00:00:00+00' ELSE now() END)
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
}

/// An aggregate id an attacker might write: markup, quotes, an ampersand, non-ASCII text.
pub const HOSTILE: &str =
    "<script>document.title='pwned'</script><b id=\"pwned\">\"quoted\" 'single' & ünïcødé ✓ 注文</b>";
