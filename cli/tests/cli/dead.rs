//! `dead list`, `dead retry` and `dead skip`.

use actix_outbox::admin::{SKIPPED_PREFIX, Status};
use actix_outbox_test_support::TestDb;
use serde_json::{Value, json};

use crate::common::*;

#[tokio::test]
async fn dead_list_shows_dead_rows_oldest_first() {
    let db = TestDb::new().await;
    db.seed(6, "agg").await;
    make_dead(&db, &[5, 2, 3]).await;

    let rows: Value = serde_json::from_str(&ok(&db.url, &["dead", "list", "--json"]).await).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["id"].as_i64().unwrap()).collect::<Vec<_>>(), [2, 3, 5]);
    let first = &rows[0];
    assert_eq!(
        (
            &first["aggregate_type"],
            &first["aggregate_id"],
            &first["event_type"],
            &first["attempts"],
            &first["last_error"]
        ),
        (&json!("test"), &json!("agg"), &json!("test.happened"), &json!(12), &json!("retryable: nack 2"))
    );
    assert_eq!(first["payload"], json!({"n": 1}));
    assert!(first["created_at"].as_str().unwrap().parse::<chrono::DateTime<chrono::Utc>>().is_ok());

    let limited: Value = serde_json::from_str(&ok(&db.url, &["dead", "list", "--json", "--limit", "2"]).await).unwrap();
    assert_eq!(limited.as_array().unwrap().len(), 2);

    let table = ok(&db.url, &["dead", "list", "--limit", "2"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "header, 2 rows, a note that there are more:\n{table}");
    assert!(lines[0].starts_with("ID") && lines[0].contains("LAST ERROR"), "{table}");
    assert!(lines[1].trim_start().starts_with("2 ") && lines[1].ends_with("retryable: nack 2"), "{table}");
    assert!(lines[1].contains("test/agg") && lines[1].contains("test.happened"), "{table}");
    assert!(lines[3].contains("raise --limit"), "{table}");

    let empty = TestDb::new().await;
    assert_eq!(ok(&empty.url, &["dead", "list"]).await, "no dead rows\n");
    assert_eq!(ok(&empty.url, &["dead", "list", "--json"]).await, "[]\n");
}

#[tokio::test]
async fn dead_retry_sends_dead_rows_back_to_pending_with_attempts_reset() {
    let db = TestDb::new().await;
    db.seed(5, "agg").await;
    make_dead(&db, &[1, 2, 4]).await;

    let out = ok(&db.url, &["dead", "retry", "4", "1", "4"]).await;
    assert_eq!(out.trim(), "retried 2 dead rows (now pending, attempts reset): 1, 4");
    for id in [1, 4] {
        let row = db.row(id).await;
        assert_eq!((row.status, row.attempts, row.lease_owner.as_deref()), (Status::Pending, 0, None));
        assert!(row.available_at <= chrono::Utc::now(), "claimable now");
        assert_eq!(row.lease_version, 12, "the fencing token only ever grows");
    }
    assert_eq!(db.row(2).await.status, Status::Dead);

    let out = ok(&db.url, &["dead", "retry", "--all"]).await;
    assert_eq!(out.trim(), "retried 1 dead row (now pending, attempts reset)");
    assert_eq!(db.count_status("pending").await, 5);
}

#[tokio::test]
async fn dead_retry_of_an_id_that_is_not_dead_exits_2_and_changes_nothing() {
    let db = TestDb::new().await;
    db.seed(4, "agg").await;
    make_dead(&db, &[1, 3]).await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() WHERE id = 4").await;
    let before = db.rows().await;

    // 2 is pending, 4 done, 999 does not exist: the dead ones (1, 3) must not be retried either.
    let ran = cli(&db.url, &["dead", "retry", "1", "2", "3", "4", "999"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert_eq!(
        ran.error_line(),
        "error: not a dead row: 2, 4, 999 (no row changed; `actix-outbox dead list` shows the dead ones)"
    );
    assert_eq!(ran.stdout, "");
    assert_eq!(db.rows().await, before);
}

#[tokio::test]
async fn dead_skip_marks_dead_rows_done_recording_the_reason() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    make_dead(&db, &[1, 2]).await;

    let out = ok(&db.url, &["dead", "skip", "2", "--reason", "order cancelled by hand, INC-7"]).await;
    assert_eq!(out.trim(), "skipped 1 dead row (now done): 2");
    let row = db.row(2).await;
    assert_eq!(row.status, Status::Done);
    assert!(row.done_at.is_some());
    assert_eq!(
        row.last_error.as_deref(),
        Some(format!("{SKIPPED_PREFIX}order cancelled by hand, INC-7 (was: retryable: nack 2)").as_str())
    );
    assert_eq!(db.row(1).await.status, Status::Dead);
    assert_eq!(db.row(3).await.status, Status::Pending);
}

#[tokio::test]
async fn dead_skip_of_an_id_that_is_not_dead_exits_2_and_changes_nothing() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    make_dead(&db, &[1, 2]).await;
    let before = db.rows().await;

    let ran = cli(&db.url, &["dead", "skip", "1", "2", "3", "--reason", "typo in the id list"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().starts_with("error: not a dead row: 3 (no row changed"), "{ran:?}");

    let ran = cli(&db.url, &["dead", "skip", "1", "--reason", "  "]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("--reason must not be empty"), "{ran:?}");

    let ran = cli(&db.url, &["dead", "skip", "1"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("--reason <TEXT>"), "{ran:?}");

    assert_eq!(db.rows().await, before);
}
