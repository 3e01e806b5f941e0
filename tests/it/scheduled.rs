//! Scheduled events (`NewEvent::not_before`): written with their time by every `enqueue`
//! function, published no earlier, holding their aggregate's later events under the FIFO gate,
//! and counted apart by `stats` (neither backlog nor in the oldest unfinished row's age). Every
//! time is the database's clock.

use std::time::Duration;

use actix_outbox::testkit::{Drain, MemorySink};
use actix_outbox::{Fifo, NewEvent, StoreError};
use chrono::{DateTime, Utc};
use diesel::sql_types::Timestamptz;
use diesel::{IntoSql, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use actix_outbox_test_support::TestDb;

/// The transaction's time on the database's clock (`now()`, what `created_at` defaults to).
async fn now(conn: &mut AsyncPgConnection) -> DateTime<Utc> {
    diesel::select(diesel::dsl::now.into_sql::<Timestamptz>()).get_result(conn).await.unwrap()
}

fn event(aggregate: &str, event_type: &str) -> NewEvent {
    NewEvent::new("order", aggregate, event_type, serde_json::json!({}))
}

/// `enqueue`, `enqueue_many` and `enqueue_ordered` write the time into `available_at`, to the
/// microsecond; an event without one is available when it is created.
#[actix_rt::test]
async fn every_enqueue_writes_the_time_into_available_at() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (at, ids) = conn
        .transaction::<_, StoreError, _>(async |tx| {
            let at = now(tx).await;
            let plain = actix_outbox::enqueue(tx, &event("1", "order.placed")).await?;
            let reminder = actix_outbox::enqueue(
                tx,
                &event("1", "order.payment_reminder").not_before(at + chrono::Duration::minutes(10)),
            )
            .await?;
            let many = actix_outbox::enqueue_many(
                tx,
                &[event("2", "order.placed"), event("2", "order.expired").not_before(at + chrono::Duration::hours(1))],
            )
            .await?;
            let ordered = actix_outbox::enqueue_ordered(
                tx,
                &event("3", "order.archived").not_before(at + chrono::Duration::microseconds(7_200_000_001)),
            )
            .await?;
            Ok((at, [plain, reminder, many[0], many[1], ordered]))
        })
        .await
        .unwrap();
    let rows = db.rows().await;
    let written: Vec<(i64, DateTime<Utc>, DateTime<Utc>)> =
        rows.iter().map(|r| (r.id, r.created_at, r.available_at)).collect();
    assert_eq!(
        written,
        [
            (ids[0], at, at),
            (ids[1], at, at + chrono::Duration::minutes(10)),
            (ids[2], at, at),
            (ids[3], at, at + chrono::Duration::hours(1)),
            (ids[4], at, at + chrono::Duration::microseconds(7_200_000_001)),
        ]
    );
    let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
    assert_eq!((stats.by_status["pending"], stats.scheduled, stats.backlog()), (5, 3, 2));
}

/// A scheduled event is not claimed before its time: one due in two seconds is published after
/// it (its `done_at` at or after its `available_at`), one due in ten minutes is left pending and
/// untouched (never claimed), while an event without a time goes at once.
#[actix_rt::test]
async fn a_scheduled_event_is_published_no_earlier_than_its_time() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (at, ids) = conn
        .transaction::<_, StoreError, _>(async |tx| {
            let at = now(tx).await;
            let ids = actix_outbox::enqueue_many(
                tx,
                &[
                    event("1", "order.placed"),
                    event("2", "order.reminder").not_before(at + chrono::Duration::seconds(2)),
                    event("3", "order.expired").not_before(at + chrono::Duration::minutes(10)),
                ],
            )
            .await?;
            Ok((at, ids))
        })
        .await
        .unwrap();
    let sink = MemorySink::new();
    // The horizon takes in the row due in two seconds, not the one due in ten minutes.
    let drained = Drain::new().horizon(Duration::from_secs(5)).run(&db.pool, sink.clone()).await.unwrap();
    assert_eq!((drained.done, drained.dead, drained.pending), (2, 0, 1));
    let mut published = sink.published_ids();
    published.sort_unstable();
    assert_eq!(published, ids[..2]);

    let soon = db.row(ids[1]).await;
    let due = at + chrono::Duration::seconds(2);
    let done_at = soon.done_at.expect("done");
    assert!(done_at >= due, "published at {done_at}, before its time {due}");
    // Done, it no longer waits: its `available_at` is back at its `created_at`.
    assert_eq!(soon.available_at, soon.created_at);
    let later = db.row(ids[2]).await;
    assert_eq!((later.attempts, later.lease_version, later.done_at), (0, 0, None), "never claimed");
    assert!(sink.calls().iter().all(|c| c.message.id != ids[2]));
    let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
    assert_eq!((stats.by_status["pending"], stats.scheduled, stats.backlog()), (1, 1, 0));
    assert_eq!(stats.oldest_unfinished_age_s, None, "nothing due is unfinished");
}

/// Under the FIFO gate a scheduled event is its aggregate's head: the aggregate's next event,
/// available at once, waits until the scheduled one is published, and goes after it.
#[actix_rt::test]
async fn under_the_fifo_gate_a_scheduled_event_holds_its_aggregates_later_events() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (at, ids) = conn
        .transaction::<_, StoreError, _>(async |tx| {
            let at = now(tx).await;
            let reminder = actix_outbox::enqueue_ordered(
                tx,
                &event("7", "order.reminder").not_before(at + chrono::Duration::seconds(2)),
            )
            .await?;
            let paid = actix_outbox::enqueue_ordered(tx, &event("7", "order.paid")).await?;
            let other = actix_outbox::enqueue_ordered(tx, &event("8", "order.placed")).await?;
            Ok((at, [reminder, paid, other]))
        })
        .await
        .unwrap();
    let sink = MemorySink::new();
    let drained = Drain::new()
        .configure(|c| c.fifo(Fifo::All))
        .horizon(Duration::from_secs(5))
        .run(&db.pool, sink.clone())
        .await
        .unwrap();
    assert_eq!((drained.done, drained.dead, drained.pending), (3, 0, 0));
    let published = sink.published_ids();
    let position = |id: i64| published.iter().position(|p| *p == id).unwrap_or_else(|| panic!("{id} in {published:?}"));
    assert!(position(ids[0]) < position(ids[1]), "the aggregate's events in id order: {published:?}");
    let (reminder, paid) = (db.row(ids[0]).await, db.row(ids[1]).await);
    let due = at + chrono::Duration::seconds(2);
    assert!(reminder.done_at.expect("done") >= due, "{reminder:?}");
    assert_eq!(paid.available_at, at, "available at once");
    let paid_done = paid.done_at.expect("done");
    assert!(paid_done >= due, "held back until {due}: done at {paid_done}");
    assert!(paid_done >= reminder.done_at.expect("done"));
}

#[derive(QueryableByName)]
struct Age {
    #[diesel(sql_type = diesel::sql_types::Double)]
    age: f64,
}

/// Seconds from `at` to now, on the database's clock.
async fn seconds_since(db: &TestDb, at: DateTime<Utc>) -> f64 {
    let age: Age = diesel::sql_query("SELECT extract(epoch FROM now() - $1)::float8 AS age")
        .bind::<Timestamptz, _>(at)
        .get_result(&mut db.conn().await)
        .await
        .unwrap();
    age.age
}

/// `stats` counts a scheduled row apart (part of pending, not backlog) and leaves it out of the
/// oldest unfinished row's age, however old the row; a row due since its scheduled time counts
/// from that time, not from its creation; a row backing off after a failure is backlog, not
/// scheduled, and counts from its creation. The drain reports the scheduled row pending.
#[actix_rt::test]
async fn stats_count_scheduled_rows_apart_and_age_only_due_ones() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let at = conn
        .transaction::<_, StoreError, _>(async |tx| {
            let at = now(tx).await;
            actix_outbox::enqueue_many(
                tx,
                &[
                    event("1", "order.placed"),
                    event("2", "order.reminder").not_before(at + chrono::Duration::hours(1)),
                    event("3", "order.expired").not_before(at - chrono::Duration::seconds(40)),
                    event("4", "order.retried"),
                ],
            )
            .await?;
            Ok(at)
        })
        .await
        .unwrap();
    // Row 2 was written three hours ago for an hour from now; row 3 two hours ago for 40 s ago;
    // row 4 failed once and backs off for an hour, created 90 s ago.
    conn.batch_execute(
        "UPDATE outbox SET created_at = created_at - interval '3 hours' WHERE aggregate_id = '2';
         UPDATE outbox SET created_at = created_at - interval '2 hours' WHERE aggregate_id = '3';
         UPDATE outbox SET created_at = created_at - interval '90 seconds', attempts = 1, lease_version = 1,
                           available_at = now() + interval '1 hour', last_error = 'retryable: busy'
          WHERE aggregate_id = '4';",
    )
    .await
    .unwrap();
    let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
    assert_eq!((stats.by_status["pending"], stats.scheduled, stats.backlog()), (4, 1, 3));
    let age = stats.oldest_unfinished_age_s.expect("rows are due");
    let expected = seconds_since(&db, at - chrono::Duration::seconds(90)).await;
    assert!((expected - 60.0..=expected).contains(&age), "row 4's 90 s and more, not hours: {age} (now {expected})");

    // Without row 4: row 3, due since its time 40 s before `at`, not since its creation.
    conn.batch_execute("UPDATE outbox SET status = 'done', done_at = now() WHERE aggregate_id = '4'").await.unwrap();
    let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
    let age = stats.oldest_unfinished_age_s.expect("rows are due");
    let expected = seconds_since(&db, at - chrono::Duration::seconds(40)).await;
    assert!((expected - 60.0..=expected).contains(&age), "row 3's 40 s and more: {age} (now {expected})");
    assert_eq!((stats.by_status["pending"], stats.scheduled, stats.backlog()), (3, 1, 2));
}
