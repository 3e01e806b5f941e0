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

/// `--not-before` writes the time given into `available_at`, to the microsecond; `--delay` the
/// database's clock plus the delay (the insert's own `now()`, which is also its `created_at`).
/// Both at once, or a time that is not RFC 3339, are refused and insert nothing.
#[tokio::test]
async fn enqueue_schedules_an_event_at_a_time_or_after_a_delay() {
    let db = TestDb::new().await;
    let base = [
        "enqueue",
        "--aggregate-type",
        "order",
        "--aggregate-id",
        "42",
        "--event-type",
        "order.reminder",
        "--payload",
        "{}",
    ];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();

    let id: i64 =
        ok(&db.url, &with(&["--not-before", "2030-01-02T04:04:05.123456+01:00"])).await.trim().parse().unwrap();
    let row = db.row(id).await;
    assert_eq!(row.available_at.to_rfc3339(), "2030-01-02T03:04:05.123456+00:00");
    assert_eq!((row.status, row.attempts, row.lease_version), (Status::Pending, 0, 0));

    let id: i64 = ok(&db.url, &with(&["--delay", "10m"])).await.trim().parse().unwrap();
    let row = db.row(id).await;
    assert_eq!(row.available_at - row.created_at, chrono::Duration::minutes(10));

    let stats: serde_json::Value = serde_json::from_str(&ok(&db.url, &["stats", "--json"]).await).unwrap();
    assert_eq!((stats["by_status"]["pending"].as_i64(), stats["scheduled"].as_i64()), (Some(2), Some(2)));

    let before = db.rows().await;
    let ran = cli(&db.url, &with(&["--not-before", "2030-01-02T03:04:05Z", "--delay", "10m"])).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("'--not-before <TIME>' cannot be used with '--delay <DURATION>'"), "{ran:?}");
    let ran = cli(&db.url, &with(&["--not-before", "tomorrow"])).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert_eq!(
        ran.error_line(),
        "error: invalid value 'tomorrow' for '--not-before <TIME>': not an RFC 3339 time (premature end of input); e.g. \
         2026-12-24T18:00:00Z or 2026-12-24T19:00:00+01:00 (see --help)"
    );
    assert_eq!(db.rows().await, before, "nothing inserted");
}
