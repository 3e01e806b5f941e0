//! The FIFO operator view: `stats --fifo`, `dead blocked`.

use actix_outbox_test_support::TestDb;
use serde_json::{Value, json};

use crate::common::*;

/// Aggregate order/A is blocked by its dead head (1) with two rows behind it (2, 3); order/B
/// moves (4 done, 5 pending); order/C is not blocked, its head (6) being pending though a later
/// row (7) is dead; mail/M's only row (8) is dead, blocking nothing yet, and only under a gate
/// that covers `email.sent`. Every `created_at` is fixed, so the JSON can be compared whole.
async fn blocked_table(db: &TestDb) {
    let events: Vec<_> = [
        ("order", "A", "order.created"),
        ("order", "A", "order.paid"),
        ("order", "A", "order.paid"),
        ("order", "B", "order.created"),
        ("order", "B", "order.paid"),
        ("order", "C", "order.created"),
        ("order", "C", "order.paid"),
        ("mail", "M", "email.sent"),
    ]
    .into_iter()
    .enumerate()
    .map(|(n, (t, a, e))| actix_outbox::NewEvent::new(t, a, e, json!({"n": n})))
    .collect();
    let ids = actix_outbox::enqueue_many(&mut db.conn().await, &events).await.unwrap();
    assert_eq!(ids, (1..=8).collect::<Vec<_>>());
    make_dead(db, &[1, 7, 8]).await;
    execute(
        db,
        "UPDATE outbox SET status = 'done', attempts = 1, lease_version = 1, done_at = now() WHERE id = 4;
         UPDATE outbox SET last_error = 'permanent: unroutable: exchange \"demo\" has no binding for routing key \"email.sent\"'
             WHERE id = 8;
         UPDATE outbox SET created_at = timestamptz '2026-01-02 03:04:00Z' + id * interval '1 second';",
    )
    .await;
}

/// The `dead blocked --json` object of order/A's head.
fn blocked_a() -> Value {
    json!({
        "aggregate_type": "order", "aggregate_id": "A", "dead_id": 1, "event_type": "order.created",
        "last_error": "retryable: nack 1", "attempts": 12, "created_at": "2026-01-02T03:04:01Z", "waiting": 2,
    })
}

/// The `dead blocked --json` object of mail/M's head.
fn blocked_m() -> Value {
    json!({
        "aggregate_type": "mail", "aggregate_id": "M", "dead_id": 8, "event_type": "email.sent",
        "last_error": "permanent: unroutable: exchange \"demo\" has no binding for routing key \"email.sent\"",
        "attempts": 12, "created_at": "2026-01-02T03:04:08Z", "waiting": 0,
    })
}

/// `stats --json` as an object, without the age (it moves with the clock).
async fn stats_json(db: &TestDb, flags: &[&str]) -> Value {
    let out = ok(&db.url, &[&["stats", "--json"][..], flags].concat()).await;
    assert_eq!(out.lines().count(), 1, "one object: {out}");
    let mut stats: Value = serde_json::from_str(&out).unwrap();
    assert!(stats.as_object_mut().unwrap().remove("oldest_unfinished_age_s").is_some(), "{out}");
    assert_eq!(stats.as_object_mut().unwrap().remove("source"), Some(json!(db.source().await)), "{out}");
    stats
}

#[tokio::test]
async fn stats_with_fifo_adds_the_blocked_aggregates_and_without_it_leaves_them_out() {
    let db = TestDb::new().await;
    blocked_table(&db).await;
    let before = db.rows().await;
    let counts = json!({
        "by_status": {"pending": 4, "processing": 0, "done": 1, "dead": 3},
        "scheduled": 0,
        "expired_leases": 0,
        "attempts": {"0": 4},
    });
    let with = |blocked: Vec<Value>, total: i64| {
        let mut expected = counts.clone();
        expected["blocked_aggregates"] = Value::Array(blocked);
        expected["blocked_aggregates_total"] = json!(total);
        expected
    };

    // Without --fifo the gate is unknown: no blocked keys at all.
    assert_eq!(stats_json(&db, &[]).await, counts);
    // Every event type gated: A (two waiting) and M (nothing waiting yet); C's head is pending.
    assert_eq!(stats_json(&db, &["--fifo"]).await, with(vec![blocked_a(), blocked_m()], 2));
    // Gated types only: M's email.sent blocks nothing.
    assert_eq!(stats_json(&db, &["--fifo", "order.created,order.paid"]).await, with(vec![blocked_a()], 1));
    assert_eq!(stats_json(&db, &["--fifo", "invoice.created"]).await, with(vec![], 0));

    // The table: a section with the heads, the long error cut short, and the way out.
    let out = ok(&db.url, &["stats", "--fifo"]).await;
    let section: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("blocked aggregates")).collect();
    assert_eq!(section[0], "blocked aggregates      2 (FIFO on all event types)", "{out}");
    assert_eq!(
        section[1].split_whitespace().collect::<Vec<_>>(),
        ["AGGREGATE", "DEAD", "ID", "EVENT", "TYPE", "WAITING", "LAST", "ERROR"]
    );
    assert_eq!(
        section[2].split_whitespace().collect::<Vec<_>>(),
        ["order/A", "1", "order.created", "2", "retryable:", "nack", "1"]
    );
    assert_eq!(section[3].split_whitespace().take(4).collect::<Vec<_>>(), ["mail/M", "8", "email.sent", "0"]);
    assert!(
        section[3].ends_with(" 0  permanent: unroutable: exchange \"demo\" has no binding for r…"),
        "the error is cut to 60 characters: {out}"
    );
    assert!(section[4].contains("dead retry DEAD_ID") && section[4].contains("dead skip DEAD_ID --reason"), "{out}");
    assert_eq!(section.len(), 5, "{out}");
    let out = ok(&db.url, &["stats", "--fifo", "invoice.created"]).await;
    assert!(out.ends_with("blocked aggregates      0 (FIFO on event types invoice.created)\n"), "{out}");
    assert!(!ok(&db.url, &["stats"]).await.contains("blocked"), "no section without --fifo");

    assert_eq!(db.rows().await, before, "stats only reads");
}

#[tokio::test]
async fn dead_blocked_lists_the_aggregates_a_dead_head_holds_back() {
    let db = TestDb::new().await;
    blocked_table(&db).await;
    let before = db.rows().await;
    let json_of = async |flags: &[&str]| -> Value {
        serde_json::from_str(&ok(&db.url, &[&["dead", "blocked", "--json"][..], flags].concat()).await).unwrap()
    };

    assert_eq!(json_of(&["--fifo"]).await, json!([blocked_a(), blocked_m()]));
    assert_eq!(json_of(&["--fifo", "--limit", "1"]).await, json!([blocked_a()]));
    assert_eq!(json_of(&["--fifo", "order.created,order.paid"]).await, json!([blocked_a()]));
    assert_eq!(json_of(&["--fifo", "email.sent"]).await, json!([blocked_m()]));
    assert_eq!(json_of(&["--fifo", "invoice.created"]).await, json!([]));

    let table = ok(&db.url, &["dead", "blocked", "--fifo"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[0], "2 aggregates blocked by a dead head (FIFO on all event types), oldest first:", "{table}");
    assert!(lines[1].starts_with("AGGREGATE  DEAD ID  EVENT TYPE") && lines[1].ends_with("LAST ERROR"), "{table}");
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["order/A", "1", "order.created", "2", "12", "2026-01-02", "03:04:01.000Z", "retryable:", "nack", "1"],
        "{table}"
    );
    assert_eq!(
        lines[3].split_whitespace().take(7).collect::<Vec<_>>(),
        ["mail/M", "8", "email.sent", "0", "12", "2026-01-02", "03:04:08.000Z"],
        "{table}"
    );
    assert!(
        lines[3].ends_with("  permanent: unroutable: exchange \"demo\" has no binding for routing key \"email.sent\"")
    );
    assert_eq!(
        lines[4],
        "unblock an aggregate with `actix-outbox dead retry DEAD_ID` (publish its head again) or \
         `actix-outbox dead skip DEAD_ID --reason TEXT` (give the head up); the rows waiting behind it then follow in order"
    );
    assert_eq!(lines.len(), 5, "{table}");

    let limited = ok(&db.url, &["dead", "blocked", "--fifo", "--limit", "1"]).await;
    let lines: Vec<&str> = limited.lines().collect();
    assert!(lines[0].starts_with("2 aggregates blocked") && lines[2].starts_with("order/A "), "{limited}");
    assert_eq!(lines[3], "(first 1 shown; raise --limit for the rest)", "{limited}");
    assert_eq!(lines.len(), 5, "{limited}");

    let one = ok(&db.url, &["dead", "blocked", "--fifo", "email.sent"]).await;
    assert!(
        one.starts_with("1 aggregate blocked by a dead head (FIFO on event types email.sent), oldest first:\n"),
        "{one}"
    );
    assert_eq!(
        ok(&db.url, &["dead", "blocked", "--fifo", "invoice.created,invoice.paid"]).await,
        "no blocked aggregates (FIFO on event types invoice.created, invoice.paid)\n"
    );
    assert_eq!(db.rows().await, before, "dead blocked only reads");

    // Once the head is retried, A is no longer blocked.
    ok(&db.url, &["dead", "retry", "1"]).await;
    assert_eq!(json_of(&["--fifo"]).await, json!([blocked_m()]));

    let empty = TestDb::new().await;
    assert_eq!(
        ok(&empty.url, &["dead", "blocked", "--fifo"]).await,
        "no blocked aggregates (FIFO on all event types)\n"
    );
    assert_eq!(ok(&empty.url, &["dead", "blocked", "--fifo", "--json"]).await, "[]\n");
}
