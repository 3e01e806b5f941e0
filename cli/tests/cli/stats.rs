//! `stats`, as JSON and for humans.

use actix_outbox_test_support::TestDb;
use diesel::sql_types::Text;
use diesel_async::RunQueryDsl;
use serde_json::{Value, json};

use crate::common::*;

/// Rows in every state: pending with 0 and 1 attempts, processing with a live and an expired
/// lease, done, dead.
async fn mixed_table(db: &TestDb) {
    db.seed(12, "agg").await;
    execute(
        db,
        "UPDATE outbox SET attempts = 1 WHERE id IN (1, 2);
         UPDATE outbox SET status = 'processing', attempts = 2, lease_version = 2, lease_owner = 'h:1:worker-0',
             lease_until = now() + interval '1 minute' WHERE id = 3;
         UPDATE outbox SET status = 'processing', attempts = 3, lease_version = 3, lease_owner = 'h:1:worker-1',
             lease_until = now() - interval '5 seconds' WHERE id IN (4, 5);
         UPDATE outbox SET status = 'done', attempts = 1, lease_version = 1, done_at = now() WHERE id IN (6, 7, 8);
         UPDATE outbox SET status = 'dead', attempts = 12, lease_version = 12, last_error = 'permanent: unroutable'
             WHERE id = 9;
         UPDATE outbox SET created_at = now() - interval '90 seconds', available_at = now() - interval '90 seconds'
             WHERE id = 10;",
    )
    .await;
}

#[derive(diesel::QueryableByName)]
struct Doc {
    #[diesel(sql_type = Text)]
    doc: String,
}

#[tokio::test]
async fn stats_json_matches_counts_computed_with_sql() {
    let db = TestDb::new().await;
    mixed_table(&db).await;

    let out = ok(&db.url, &["stats", "--json"]).await;
    assert_eq!(out.lines().count(), 1, "one object: {out}");
    let mut stats: Value = serde_json::from_str(&out).unwrap();
    let age = stats.as_object_mut().unwrap().remove("oldest_unfinished_age_s").unwrap();
    let source = stats.as_object_mut().unwrap().remove("source").unwrap();
    let scheduled = stats.as_object_mut().unwrap().remove("scheduled").unwrap();
    assert_eq!(scheduled, json!(0), "nothing scheduled");
    assert_eq!(source, json!(db.source().await), "the source a dispatcher derives for this table");

    // The same facts, computed independently of the store's queries.
    let expected: Doc = diesel::sql_query(
        "SELECT json_build_object(
            'by_status', (SELECT json_object_agg(s, (SELECT count(*) FROM outbox WHERE status = s))
                          FROM unnest(ARRAY['pending', 'processing', 'done', 'dead']) AS s),
            'expired_leases', (SELECT count(*) FROM outbox WHERE status = 'processing' AND lease_until < now()),
            'attempts', (SELECT json_object_agg(attempts::text, n) FROM
                          (SELECT attempts, count(*) AS n FROM outbox
                           WHERE status IN ('pending', 'processing') GROUP BY attempts) AS a),
            'age', (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox
                    WHERE status IN ('pending', 'processing'))
         )::text AS doc",
    )
    .get_result(&mut db.conn().await)
    .await
    .unwrap();
    let mut expected: Value = serde_json::from_str(&expected.doc).unwrap();
    let sql_age = expected.as_object_mut().unwrap().remove("age").unwrap().as_f64().unwrap();
    assert_eq!(stats, expected);
    assert_eq!(
        stats,
        json!({
            "by_status": {"pending": 5, "processing": 3, "done": 3, "dead": 1},
            "expired_leases": 2,
            "attempts": {"0": 3, "1": 2, "2": 1, "3": 2},
        })
    );
    let age = age.as_f64().expect("a number while rows are unfinished");
    assert!((90.0..sql_age + 1.0).contains(&age), "oldest unfinished age {age} s, SQL says {sql_age} s");

    // An empty table: every status present with 0, no age.
    let empty = TestDb::new().await;
    let stats: Value = serde_json::from_str(&ok(&empty.url, &["stats", "--json"]).await).unwrap();
    assert_eq!(
        stats,
        json!({
            "by_status": {"pending": 0, "processing": 0, "done": 0, "dead": 0},
            "scheduled": 0,
            "oldest_unfinished_age_s": null,
            "expired_leases": 0,
            "attempts": {},
            "source": empty.source().await,
        })
    );
}

#[tokio::test]
async fn stats_prints_a_table_for_humans() {
    let db = TestDb::new().await;
    mixed_table(&db).await;
    let before = db.rows().await;
    let out = ok(&db.url, &["stats"]).await;
    let lines: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
    for expected in [
        vec!["pending", "5"],
        vec!["processing", "3"],
        vec!["done", "3"],
        vec!["dead", "1"],
        vec!["expired", "leases", "2"],
        vec!["3", "2"],
    ] {
        assert!(lines.contains(&expected), "no line {expected:?} in\n{out}");
    }
    assert!(out.contains("oldest unfinished row   1m 3"), "{out}");
    assert!(out.contains(&format!("\nsource                  {}\n", db.source().await)), "{out}");
    assert_eq!(db.rows().await, before, "stats only reads");
}

/// A row scheduled for later is counted apart, under pending, in both forms, and is not in the
/// oldest unfinished row's age however old it is; the table for humans says it is not backlog.
#[tokio::test]
async fn stats_shows_scheduled_rows_apart() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    execute(
        &db,
        "UPDATE outbox SET available_at = now() + interval '1 day', created_at = now() - interval '2 hours'
         WHERE id IN (1, 2);",
    )
    .await;
    let stats: Value = serde_json::from_str(&ok(&db.url, &["stats", "--json"]).await).unwrap();
    assert_eq!(stats["by_status"], json!({"pending": 3, "processing": 0, "done": 0, "dead": 0}));
    assert_eq!(stats["scheduled"], json!(2));
    let age = stats["oldest_unfinished_age_s"].as_f64().expect("row 3 is due");
    assert!(age < 600.0, "row 3's age, not the scheduled rows' two hours: {age}");

    let out = ok(&db.url, &["stats"]).await;
    assert!(
        out.starts_with(
            "rows by status\n  pending              3\n    scheduled          2  (not due yet: not backlog)\n"
        ),
        "{out}"
    );
}
