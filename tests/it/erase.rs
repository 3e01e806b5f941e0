//! `admin::erase` and `inbox::erase_aggregate` against the real PostgreSQL: exact counts, the
//! other aggregates' rows untouched, nothing deleted while rows are in flight.

use actix_outbox::admin::{self, EraseError, Erasure};
use actix_outbox::inbox::{self, InboxMessage};
use actix_outbox::testing::inbox::{is_recorded, record};
use diesel_async::SimpleAsyncConnection;

use actix_outbox_test_support::TestDb;

async fn execute(db: &TestDb, sql: &str) {
    db.conn().await.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn ids(db: &TestDb) -> Vec<i64> {
    db.rows().await.iter().map(|r| r.id).collect()
}

#[tokio::test]
async fn erase_deletes_the_done_and_dead_rows_of_one_aggregate_only() {
    let db = TestDb::new().await;
    let erased = db.seed(4, "42").await; // aggregate test/42
    let other = db.seed(3, "43").await;
    execute(
        &db,
        &format!(
            "UPDATE outbox SET status = 'done', done_at = now() WHERE id IN ({}, {}, {});
             UPDATE outbox SET status = 'dead', last_error = 'boom' WHERE id = {};
             UPDATE outbox SET status = 'done', done_at = now() WHERE id = {};
             UPDATE outbox SET status = 'dead' WHERE id = {};",
            erased[0], erased[1], erased[2], erased[3], other[0], other[1]
        ),
    )
    .await;
    let mut conn = db.conn().await;
    let erasure = admin::erase(&mut conn, "test", "42").await.unwrap();
    assert_eq!((erasure.done, erasure.dead), (3, 1));
    assert_eq!(ids(&db).await, other, "the other aggregate's rows remain, and only they");
    assert_eq!(
        (db.count_status("done").await, db.count_status("dead").await, db.count_status("pending").await),
        (1, 1, 1)
    );

    // Erasing again finds nothing; an unknown aggregate neither.
    assert_eq!(admin::erase(&mut conn, "test", "42").await.unwrap(), Erasure::default());
    assert_eq!(admin::erase(&mut conn, "nope", "42").await.unwrap(), Erasure::default());
    assert_eq!(ids(&db).await, other);
}

#[tokio::test]
async fn erase_refuses_while_rows_are_in_flight_and_deletes_nothing() {
    let db = TestDb::new().await;
    let rows = db.seed(5, "42").await;
    // 1 done, 1 dead, 1 processing, 2 pending.
    execute(
        &db,
        &format!(
            "UPDATE outbox SET status = 'done', done_at = now() WHERE id = {};
             UPDATE outbox SET status = 'dead' WHERE id = {};
             UPDATE outbox SET status = 'processing', lease_owner = 'w', lease_until = now() + interval '1 minute',
                 lease_version = 1, attempts = 1 WHERE id = {};",
            rows[0], rows[1], rows[2]
        ),
    )
    .await;
    let mut conn = db.conn().await;
    let e = admin::erase(&mut conn, "test", "42").await.unwrap_err();
    assert!(matches!(e, EraseError::InFlight { pending: 2, processing: 1 }), "{e:?}");
    let message = e.to_string();
    assert!(message.contains("2 pending and 1 processing rows"), "{message}");
    assert!(message.contains("wait until they are done") && message.contains("retry or skip"), "{message}");
    assert_eq!(ids(&db).await, rows, "nothing deleted");

    // Once the rows are done, the erasure goes through.
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now(), lease_owner = NULL, lease_until = NULL WHERE status IN ('pending', 'processing')").await;
    let erasure = admin::erase(&mut conn, "test", "42").await.unwrap();
    assert_eq!((erasure.done, erasure.dead), (4, 1));
    assert_eq!(ids(&db).await, Vec::<i64>::new());
}

#[tokio::test]
async fn erase_runs_inside_the_callers_transaction() {
    use diesel_async::AsyncConnection;
    let db = TestDb::new().await;
    let rows = db.seed(2, "42").await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now()").await;
    let mut conn = db.conn().await;
    let rolled_back: Result<(), EraseError> = conn
        .transaction(async |c| {
            let erasure = admin::erase(c, "test", "42").await?;
            assert_eq!(erasure.done, 2);
            Err(EraseError::InFlight { pending: 0, processing: 0 })
        })
        .await;
    assert!(rolled_back.is_err());
    assert_eq!(ids(&db).await, rows, "the caller's rollback undid the erasure");
}

#[tokio::test]
async fn inbox_erase_blanks_the_aggregate_and_keeps_duplicates_recognised() {
    let db = TestDb::new().await;
    inbox::migrate_inbox(&db.url).await.unwrap();
    let mut conn = db.conn().await;
    let message = |id: i64, agg: &str| {
        InboxMessage::new(id, "order.created", serde_json::json!({})).with_source("src").with_aggregate("order", agg)
    };
    for (consumer, id, agg) in [("billing", 1, "42"), ("billing", 2, "42"), ("shipping", 1, "42"), ("billing", 3, "43")]
    {
        assert!(record(&mut conn, consumer, &message(id, agg)).await.unwrap());
    }
    execute(
        &db,
        "INSERT INTO inbox_aggregates (consumer, source, aggregate_type, aggregate_id, last_message_id) VALUES
            ('billing', 'src', 'order', '42', 2), ('billing', 'src', 'order', '43', 3)",
    )
    .await;

    let erasure = inbox::erase_aggregate(&mut conn, "order", "42").await.unwrap();
    assert_eq!((erasure.anonymised, erasure.marks_deleted), (3, 1));

    assert_eq!(db.scalar("SELECT count(*) AS n FROM inbox WHERE aggregate_id = '42'").await, 0);
    assert_eq!(db.scalar("SELECT count(*) AS n FROM inbox_aggregates WHERE aggregate_id = '42'").await, 0);
    assert_eq!(db.scalar("SELECT count(*) AS n FROM inbox WHERE aggregate_type = '' AND aggregate_id = ''").await, 3);
    // The other aggregate keeps its strings and its mark.
    assert_eq!(
        db.scalar("SELECT count(*) AS n FROM inbox WHERE aggregate_type = 'order' AND aggregate_id = '43'").await,
        1
    );
    assert_eq!(
        db.scalar("SELECT count(*) AS n FROM inbox_aggregates WHERE aggregate_id = '43' AND last_message_id = 3").await,
        1
    );

    // The keys stay: the erased messages are still recorded, and a copy is still a duplicate.
    for (consumer, id) in [("billing", 1), ("billing", 2), ("shipping", 1)] {
        assert!(is_recorded(&mut conn, consumer, "src", id).await.unwrap(), "{consumer} {id}");
        assert!(!record(&mut conn, consumer, &message(id, "42")).await.unwrap(), "{consumer} {id}: a duplicate");
    }
    assert_eq!(db.scalar("SELECT count(*) AS n FROM inbox").await, 4);
}
