//! The user's test kit (`actix_outbox::testkit`), used as a service's tests would use it, on the
//! real PostgreSQL: every answer of the memory sink through a real dispatcher, the drain's idle
//! rule, the throwaway database's lifetime, and inbox delivery without a broker.

use std::time::Duration;

use actix_outbox::inbox::{HandlerError, InboxConfig, InboxMessage, handler_fn};
use actix_outbox::testkit::{
    Delivered, Drain, DrainError, MemorySink, TestDatabase, deliver, drain_until_idle, inbox_message,
};
use actix_outbox::{NewEvent, PublishError};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

use actix_outbox_test_support::{database_exists, database_url};

async fn database() -> TestDatabase {
    TestDatabase::create(&database_url("postgres")).await.expect("a test database")
}

async fn enqueue(db: &TestDatabase, events: &[(&str, &str)]) -> Vec<i64> {
    let events: Vec<NewEvent> = events
        .iter()
        .map(|(event_type, id)| NewEvent::new("order", *id, *event_type, serde_json::json!({"order": id})))
        .collect();
    let mut conn = db.pool().get().await.unwrap();
    actix_outbox::enqueue_many(&mut conn, &events).await.unwrap()
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Three types, three answers: `order.placed` published at once, `payment.charged` on its third
/// attempt after two retryable failures, `legacy.event` dead at once. The drain reports 3 done
/// and 1 dead with its error, and every call is recorded with its attempt.
#[actix_rt::test]
async fn the_drain_runs_every_answer_of_the_sink_to_its_end() {
    let db = database().await;
    let ids =
        enqueue(&db, &[("order.placed", "1"), ("order.placed", "2"), ("payment.charged", "1"), ("legacy.event", "3")])
            .await;
    let sink = MemorySink::new();
    sink.answer_times("payment.charged", 2, Err(PublishError::Retryable("gateway timeout".into())));
    sink.answer("legacy.event", Err(PublishError::Permanent("no route".into())));

    let drained = drain_until_idle(db.pool(), sink.clone()).await.expect("idle");
    assert_eq!((drained.done, drained.dead, drained.pending), (3, 1, 0));
    assert_eq!(drained.dead_rows.iter().map(|r| r.id).collect::<Vec<_>>(), [ids[3]]);
    assert_eq!(drained.dead_rows[0].last_error.as_deref(), Some("permanent: no route"));
    sink.assert_published("order.placed", 2);
    sink.assert_published("payment.charged", 1);
    sink.assert_published("legacy.event", 0);
    let mut published = sink.published_ids();
    published.sort_unstable();
    assert_eq!(published, ids[..3]);

    let payment: Vec<(i32, bool)> = sink
        .calls()
        .iter()
        .filter(|c| c.message.id == ids[2])
        .map(|c| (c.message.attempts, c.answer.is_ok()))
        .collect();
    assert_eq!(payment, [(1, false), (2, false), (3, true)], "two retryable failures, then published");
    assert_eq!(sink.published_of("payment.charged")[0].aggregate_id, "1");

    let no_dead = std::panic::catch_unwind(|| drained.assert_no_dead()).expect_err("a dead row fails the assertion");
    let message = no_dead.downcast_ref::<String>().unwrap();
    assert_eq!(message, &format!("expected no dead rows, found 1: #{} legacy.event (permanent: no route)", ids[3]));
    let wrong_count = std::panic::catch_unwind(|| sink.assert_published("order.placed", 1)).expect_err("2 is not 1");
    assert_eq!(
        wrong_count.downcast_ref::<String>().unwrap(),
        r#"expected 1 `order.placed` message(s) published, found 2; published by type: {"order.placed": 2, "payment.charged": 1}"#
    );
}

/// A deferral beyond the horizon leaves its row pending (attempt refunded) and the drain idle; a
/// sink that stays unavailable ends the drain with `NotIdle` once its timeout runs out, the
/// dispatcher stopped and the row back to pending with no attempt spent.
#[actix_rt::test]
async fn a_deferred_row_is_left_pending_and_an_unavailable_sink_is_not_idle() {
    let db = database().await;
    let ids = enqueue(&db, &[("order.placed", "1"), ("invoice.due", "2")]).await;
    let sink = MemorySink::new();
    sink.answer("invoice.due", Err(PublishError::Defer { delay: Duration::from_secs(600), reason: "not yet".into() }));
    let drained = drain_until_idle(db.pool(), sink.clone()).await.expect("idle");
    assert_eq!((drained.done, drained.dead, drained.pending), (1, 0, 1));
    assert_eq!(sink.published_ids(), [ids[0]]);
    assert_eq!(sink.calls().iter().filter(|c| c.message.id == ids[1]).count(), 1, "deferred once, not retried");

    let db = database().await;
    let ids = enqueue(&db, &[("order.placed", "1")]).await;
    let sink = MemorySink::new();
    sink.answer("order.placed", Err(PublishError::Unavailable("broker down".into())));
    let error = Drain::new().timeout(Duration::from_millis(500)).run(db.pool(), sink.clone()).await.unwrap_err();
    assert!(
        matches!(
            error,
            DrainError::NotIdle { processing: 0, due: 1, .. } | DrainError::NotIdle { processing: 1, due: 0, .. }
        ),
        "{error:?}"
    );
    sink.assert_nothing_published();
    assert!(sink.calls().len() >= 2, "probed again while unavailable: {} call(s)", sink.calls().len());
    let mut conn = db.pool().get().await.unwrap();
    let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
    assert_eq!(stats.by_status["pending"], 1, "back to pending after the stop");
    let row: Count = diesel::sql_query("SELECT attempts::int8 AS n FROM outbox WHERE id = $1")
        .bind::<BigInt, _>(ids[0])
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(row.n, 0, "an unavailable sink spends no attempt");
}

/// An empty outbox is idle at once; the database exists, migrated, while its value lives and is
/// gone once it drops.
#[actix_rt::test]
async fn a_test_database_is_migrated_and_dropped() {
    let db = database().await;
    let name = db.name().to_owned();
    assert!(name.starts_with("outbox_test_"), "{name}");
    assert_eq!(db.url().database(), Some(name.as_str()));
    let drained = drain_until_idle(db.pool(), MemorySink::new()).await.unwrap();
    assert_eq!((drained.done, drained.dead, drained.pending), (0, 0, 0));
    assert!(actix_outbox::admin::pending_migrations(db.url().expose()).await.unwrap().is_empty(), "migrated");
    assert!(database_exists(&name).await);
    drop(db);
    assert!(!database_exists(&name).await, "dropped with its value");
}

/// A drained message, turned into what a consumer receives, goes through an inbox handler once:
/// applied (its write committed with the inbox row), then a duplicate; a failing handler rolls
/// back and is retried, then dead-lettered on its last attempt.
#[actix_rt::test]
async fn a_published_message_is_applied_once_by_an_inbox_handler() {
    let db = database().await;
    db.connect().await.unwrap().batch_execute("CREATE TABLE seen (id bigint PRIMARY KEY, body text)").await.unwrap();
    let ids = enqueue(&db, &[("order.placed", "7")]).await;
    let sink = MemorySink::new();
    drain_until_idle(db.pool(), sink.clone()).await.unwrap().assert_no_dead();
    let message = inbox_message(&sink.published()[0]);
    assert_eq!((message.message_id, message.event_type.as_str()), (ids[0], "order.placed"));
    assert_eq!((message.aggregate_type.as_str(), message.aggregate_id.as_str()), ("order", "7"));
    assert_eq!(message.source, sink.published()[0].source.as_ref());
    assert!(!message.source.is_empty());
    assert_eq!(message.header_str("x-aggregate-id"), Some("7"));
    assert_eq!(message.header_int("x-attempt"), Some(1));
    assert_eq!(message.payload, Some(serde_json::json!({"order": "7"})));

    let handler = handler_fn(|conn, message: &InboxMessage| {
        let (id, body) = (message.message_id, String::from_utf8_lossy(&message.body).into_owned());
        Box::pin(async move {
            diesel::sql_query("INSERT INTO seen (id, body) VALUES ($1, $2)")
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            Ok(())
        })
    });
    let config = InboxConfig::new("billing", "amqp://unused", "orders");
    assert_eq!(deliver(db.pool(), &config, &handler, &message).await.unwrap(), Delivered::Applied);
    assert_eq!(deliver(db.pool(), &config, &handler, &message).await.unwrap(), Delivered::Duplicate);
    let seen: Count =
        diesel::sql_query("SELECT count(*) AS n FROM seen").get_result(&mut db.connect().await.unwrap()).await.unwrap();
    assert_eq!(seen.n, 1, "one effect");

    let failing = handler_fn(|conn, _message: &InboxMessage| {
        Box::pin(async move {
            diesel::sql_query("INSERT INTO seen (id, body) VALUES (-1, 'rolled back')").execute(conn).await?;
            Err(HandlerError::retryable("downstream busy"))
        })
    });
    let other = InboxMessage::new(ids[0] + 1, "order.placed", serde_json::json!({}));
    let outcome = deliver(db.pool(), &config, &failing, &other).await.unwrap();
    assert_eq!(outcome, Delivered::Retried { reason: "retryable: downstream busy".into() });
    let mut last = other.clone();
    last.attempt = config.max_attempts;
    assert!(matches!(deliver(db.pool(), &config, &failing, &last).await.unwrap(), Delivered::DeadLettered { .. }));
    let seen: Count =
        diesel::sql_query("SELECT count(*) AS n FROM seen").get_result(&mut db.connect().await.unwrap()).await.unwrap();
    assert_eq!(seen.n, 1, "the failed attempts rolled back");
    assert_eq!(
        deliver(db.pool(), &config, &handler, &other).await.unwrap(),
        Delivered::Applied,
        "not recorded by a failure"
    );
}
