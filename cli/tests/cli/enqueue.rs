//! `enqueue`.

use actix_outbox::admin::Status;
use actix_outbox_test_support::TestDb;
use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn enqueue_inserts_one_event_and_prints_its_id() {
    let db = TestDb::new().await;
    db.seed(2, "other").await;
    let out = ok(
        &db.url,
        &[
            "enqueue",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "42",
            "--event-type",
            "order.created",
            "--payload",
            r#"{"total": 10, "lines": [1, 2]}"#,
        ],
    )
    .await;
    assert_eq!(out.lines().count(), 1, "only the id, for scripts: {out:?}");
    let id: i64 = out.trim().parse().unwrap();
    assert_eq!(id, 3);
    let row = db.row(id).await;
    assert_eq!(
        (row.aggregate_type.as_str(), row.aggregate_id.as_str(), row.event_type.as_str(), row.status),
        ("order", "42", "order.created", Status::Pending)
    );
    assert_eq!(row.payload, json!({"total": 10, "lines": [1, 2]}));
    assert_eq!((row.attempts, row.lease_version), (0, 0));
}

#[tokio::test]
async fn enqueue_refuses_a_payload_that_is_not_json_and_inserts_nothing() {
    let db = TestDb::new().await;
    db.seed(2, "agg").await;
    let before = db.rows().await;
    for payload in [r#"{"total": 10"#, "hello", ""] {
        let ran = cli(
            &db.url,
            &[
                "enqueue",
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "42",
                "--event-type",
                "order.created",
                "--payload",
                payload,
            ],
        )
        .await;
        assert_eq!(ran.code, 2, "{ran:?}");
        let line = ran.error_line();
        assert!(line.contains("--payload") && line.contains("not JSON"), "{line}");
        assert_eq!(ran.stdout, "");
    }
    let ran = cli(
        &db.url,
        &["enqueue", "--aggregate-type", " ", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    )
    .await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("--aggregate-type must not be empty"), "{ran:?}");
    assert_eq!(db.rows().await, before);
}
