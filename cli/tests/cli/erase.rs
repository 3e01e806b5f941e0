//! `erase`.

use std::time::Duration;

use actix_outbox::inbox::{self, InboxMessage};
use actix_outbox::testing::inbox::record;
use actix_outbox_test_support::TestDb;

use crate::common::*;

#[tokio::test]
async fn erase_deletes_the_aggregates_rows_and_blanks_it_in_the_inbox() {
    let db = TestDb::new().await;
    inbox::migrate_inbox(&db.url).await.unwrap();
    db.seed(4, "42").await; // test/42: ids 1-4
    db.seed(2, "43").await; // test/43: ids 5-6
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() WHERE id IN (1, 2, 3, 5); UPDATE outbox SET status = 'dead' WHERE id = 4;").await;
    let mut conn = db.conn().await;
    for id in [1, 2] {
        let message = InboxMessage::new(id, "test.happened", serde_json::json!({})).with_aggregate("test", "42");
        assert!(record(&mut conn, "billing", &message).await.unwrap());
    }
    execute(
        &db,
        "INSERT INTO inbox_aggregates (consumer, aggregate_type, aggregate_id, last_message_id) VALUES ('billing', 'test', '42', 2)",
    )
    .await;

    let out = ok(&db.url, &["erase", "--aggregate", "test/42", "--reason", "erasure request 118"]).await;
    assert_eq!(
        out,
        "erased test/42: 3 done rows, 1 dead row deleted; inbox: 2 rows anonymised, 1 order mark deleted\n\
         reason: erasure request 118\n"
    );
    assert_eq!(db.rows().await.iter().map(|r| r.id).collect::<Vec<_>>(), [5, 6]);

    // Again, as JSON: nothing left to erase.
    let out = ok(&db.url, &["erase", "--aggregate", "test/42", "--json"]).await;
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"aggregate_type": "test", "aggregate_id": "42", "done": 0, "dead": 0,
            "inbox": {"anonymised": 0, "marks_deleted": 0}, "reason": null})
    );
}

#[tokio::test]
async fn erase_without_an_inbox_says_nothing_of_one() {
    let db = TestDb::new().await;
    db.seed(1, "42").await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now()").await;
    let out = ok(&db.url, &["erase", "--aggregate", "test/42"]).await;
    assert_eq!(out, "erased test/42: 1 done row, 0 dead rows deleted\n");
    assert_eq!(db.rows().await.len(), 0);
}

#[tokio::test]
async fn erase_rejects_a_malformed_aggregate_with_exit_2() {
    let db = TestDb::new().await;
    db.seed(1, "42").await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now()").await;
    for bad in ["test42", "/42", "test/"] {
        let ran = cli(&db.url, &["erase", "--aggregate", bad]).await;
        assert_eq!(ran.code, 2, "{bad}: {ran:?}");
        assert!(ran.error_line().contains("expected TYPE/ID"), "{bad}: {ran:?}");
    }
    assert_eq!(db.rows().await.len(), 1, "nothing erased");
}

#[tokio::test]
async fn erase_refuses_rows_in_flight_with_exit_1_and_the_counts() {
    let db = TestDb::new().await;
    db.seed(3, "42").await;
    execute(
        &db,
        "UPDATE outbox SET status = 'done', done_at = now() WHERE id = 1;
         UPDATE outbox SET status = 'processing', lease_owner = 'w', lease_until = now() + interval '1 minute' WHERE id = 2;",
    )
    .await;
    let ran = cli(&db.url, &["erase", "--aggregate", "test/42"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    let line = ran.error_line();
    assert!(
        line.starts_with(
            "error: test/42: the aggregate still has 1 pending and 1 processing rows, so nothing was erased"
        ),
        "{line}"
    );
    assert_eq!(ran.stdout, "");
    assert_eq!(db.rows().await.len(), 3, "nothing deleted");
}

#[tokio::test]
async fn erase_wait_succeeds_once_the_row_in_flight_is_done() {
    let db = TestDb::new().await;
    db.seed(2, "42").await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() WHERE id = 1").await;
    let url = db.url.clone();
    let erase = tokio::spawn(async move { cli(&url, &["erase", "--aggregate", "test/42", "--wait", "30s"]).await });
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(!erase.is_finished(), "still waiting for row 2");
    assert_eq!(db.rows().await.len(), 2);
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() WHERE id = 2").await;
    let ran = tokio::time::timeout(WITHIN, erase).await.unwrap().unwrap();
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout, "erased test/42: 2 done rows, 0 dead rows deleted\n");
    assert_eq!(db.rows().await.len(), 0);
}

#[tokio::test]
async fn erase_wait_gives_up_after_the_duration() {
    let db = TestDb::new().await;
    db.seed(1, "42").await;
    let ran = cli(&db.url, &["erase", "--aggregate", "test/42", "--wait", "1s"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(
        ran.error_line().contains("after waiting 1s: the aggregate still has 1 pending and 0 processing rows"),
        "{ran:?}"
    );
    assert_eq!(db.rows().await.len(), 1);
}
