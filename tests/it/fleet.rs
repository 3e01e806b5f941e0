//! Several dispatchers on one outbox: one of them leads the insert wake-ups, the others claim
//! only when it calls for help (a backlog) or when it is gone. What a fleet costs the database
//! per row depends on how fast the host keeps up (a leader that falls behind rightly calls
//! the others): that figure is the bench's (`--phases loaded --processes N`, docs/benchmarks.md,
//! "A fleet"); these tests check the mechanism that keeps it down, by who claimed what.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{ChannelSink, SinkAction};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, PoolConfig};
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::mpsc::UnboundedReceiver;

use actix_outbox_test_support::{PATIENCE, TestDb, eventually, saw};

const WITHIN: Duration = PATIENCE;

/// The channel on which a leading listener calls its followers (`listener::HELP_CHANNEL`).
const HELP_CHANNEL: &str = "outbox_fleet_help";

/// The leader's calls for help that have arrived on `conn` (which listens on
/// [`HELP_CHANNEL`]) since the last look.
fn help_calls(conn: &mut AsyncPgConnection) -> usize {
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    let mut calls = 0;
    while let Some(Some(notification)) = notifications.next().now_or_never() {
        let notification = notification.expect("the test's listening connection");
        assert_eq!(notification.payload, "public.outbox", "a call names its outbox");
        calls += 1;
    }
    calls
}

/// `url` with the connections named `name` (`application_name`), a URL or `key=value` pairs.
fn named(url: &str, name: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}application_name={name}")
    } else {
        format!("{url} application_name={name}")
    }
}

/// The `application_name` of the session holding the insert listeners' lead on `db`.
async fn leader_name(db: &TestDb) -> Option<String> {
    #[derive(diesel::QueryableByName)]
    struct Name {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    let names: Vec<Name> = diesel_async::RunQueryDsl::load(
        diesel::sql_query(format!(
            "SELECT a.application_name AS name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()
               AND (l.classid::int8 << 32 | l.objid::int8) = {}",
            crate::pooler::LEAD
        )),
        &mut db.conn().await,
    )
    .await
    .unwrap();
    names.into_iter().next().map(|n| n.name)
}

/// Moves what each dispatcher's sink received into `got` (by dispatcher).
fn receive(receivers: &mut [UnboundedReceiver<Arc<OutboxMessage>>], got: &mut [Vec<i64>]) {
    for (rx, got) in receivers.iter_mut().zip(got.iter_mut()) {
        while let Ok(m) = rx.try_recv() {
            got.push(m.id);
        }
    }
}

/// Three dispatchers on one outbox, none of which polls in the test's time (an hour; a
/// follower's, four). One leads (one holder of the lead lock). Rows inserted one at a time,
/// each published before the next, are all claimed by the leader, which never calls for help:
/// the followers claim nothing. A backlog (2,000 rows in one statement, the leader's sink slow)
/// makes the leader's claims come back whole: it calls for help on `outbox_fleet_help`, and
/// then the followers claim too. Every row is published once.
#[actix_rt::test]
async fn one_leader_claims_alone_until_a_backlog_makes_it_call_the_followers() {
    const BACKLOG: usize = 2_000;
    let db = TestDb::new().await;
    let mut listening = db.conn().await;
    listening.batch_execute(&format!("LISTEN {HELP_CHANNEL}")).await.unwrap();
    // The leader's sink is slowed once the leader is known, so that the backlog outlasts the
    // followers' answer to the call by far.
    let slowed = Arc::new(AtomicUsize::new(usize::MAX));
    let mut fleet = Vec::new();
    let mut receivers = Vec::new();
    for n in 0..3 {
        let pool = PoolConfig::new(named(&db.url, &format!("fleet-{n}"))).size(6).connect().await.unwrap();
        let (sink, rx) = ChannelSink::new();
        let slowed = slowed.clone();
        let sink = sink.with_script(move |_| {
            if slowed.load(Ordering::Relaxed) == n {
                SinkAction::Stall(Duration::from_millis(200))
            } else {
                SinkAction::Deliver
            }
        });
        // One worker, and no table sample: the worker's start-up claim is the last statement
        // its connection runs until something wakes it, which the test can see.
        let config = DispatcherConfig::default()
            .owner(format!("fleet-{n}"))
            .workers(1)
            .batch(20)
            .table_metrics_interval(None)
            .poll_interval(Duration::from_secs(3600));
        fleet.push(OutboxSupervisor::start(config, pool, sink).unwrap());
        receivers.push(rx);
    }
    eventually(WITHIN, "one leader", || async { saw(leader_name(&db).await, |name| name.is_some()) }).await;
    let leader_name = leader_name(&db).await.unwrap();
    let leader: usize = leader_name.strip_prefix("fleet-").unwrap().parse().unwrap();
    // A worker that started late would find the first row by its start-up claim, woken by no
    // one: the rows come once every worker has claimed once.
    for (n, dispatcher) in fleet.iter().enumerate() {
        eventually(WITHIN, &format!("fleet-{n}'s start-up claim over"), || async {
            saw(dispatcher.send(GetMetrics).await.unwrap().claims, |claims| *claims >= 1)
        })
        .await;
    }

    let mut conn = db.conn().await;
    let mut got = vec![Vec::new(); 3];
    let mut trickled = Vec::new();
    for i in 0..10 {
        let event = NewEvent::new("fleet", "a", "fleet.row", serde_json::json!({ "i": i }));
        trickled.push(actix_outbox::enqueue(&mut conn, &event).await.unwrap());
        eventually(WITHIN, &format!("row {i} published"), || {
            receive(&mut receivers, &mut got);
            std::future::ready(saw(got.clone(), |got| got.iter().map(Vec::len).sum::<usize>() == i + 1))
        })
        .await;
    }
    assert_eq!(got[leader], trickled, "the leader ({leader_name}) claimed every trickled row: {got:?}");
    assert_eq!(got.iter().map(Vec::len).sum::<usize>(), 10, "the followers claimed none: {got:?}");
    assert_eq!(help_calls(&mut listening), 0, "no call for help without a backlog");

    slowed.store(leader, Ordering::Relaxed);
    // In ten statements, one commit after the other: the listener that arms as the first
    // commits drops the notifications that came before it armed (its next claim finds their
    // rows) and stays armed, neither ticking nor calling, until the next one.
    for _ in 0..10 {
        conn.batch_execute(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'fleet', 'b' || (n % 50), 'fleet.row', '{{}}' FROM generate_series(1, {}) n",
            BACKLOG / 10
        ))
        .await
        .unwrap();
    }
    let mut calls = 0;
    eventually(WITHIN, "the backlog published", || {
        receive(&mut receivers, &mut got);
        calls += help_calls(&mut listening);
        let counts: Vec<usize> = got.iter().map(Vec::len).collect();
        std::future::ready(saw((counts, calls), |(counts, _)| counts.iter().sum::<usize>() == 10 + BACKLOG))
    })
    .await;
    let followers: usize = (0..3).filter(|&n| n != leader).map(|n| got[n].len()).sum();
    assert!(
        calls >= 1,
        "the leader called for help ({calls} calls; rows by dispatcher: {:?})",
        got.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert!(
        followers > 0,
        "the followers answered the call: {} rows each",
        got.iter().map(Vec::len).map(|n| n.to_string()).collect::<Vec<_>>().join(", ")
    );
    let all: BTreeSet<i64> = got.iter().flatten().copied().collect();
    assert_eq!(all.len(), 10 + BACKLOG, "every row published once");
    assert_eq!(leaders(&db).await, 1, "still one leader");
    // A row's message is out before its finalize commits: shut down (which waits for the
    // finalizes) before counting.
    for dispatcher in fleet {
        dispatcher.send(Shutdown).await.unwrap();
    }
    assert_eq!(db.count_status("done").await, (10 + BACKLOG) as i64);
}

/// Holders of the insert listeners' lead (the advisory lock `LEAD`) on `db`.
async fn leaders(db: &TestDb) -> i64 {
    crate::pooler::advisory_locks(db, Some(crate::pooler::LEAD)).await
}

/// Of three dispatchers one leads the insert wake-ups; when it stops another leads within the
/// follow check, and a row inserted then is published at once by one of the two left, without
/// waiting for a poll.
#[actix_rt::test]
async fn one_dispatcher_leads_and_another_takes_over_when_it_stops() {
    let db = TestDb::new().await;
    let (sink, mut rx) = ChannelSink::new();
    // No poll in the test's time: a row published was woken by the leader, not found by a poll.
    let config =
        |n: usize| DispatcherConfig::default().owner(format!("lead-{n}")).poll_interval(Duration::from_secs(3600));
    let mut fleet = Vec::new();
    for n in 0..3 {
        let pool = PoolConfig::new(db.url.clone()).size(6).connect().await.unwrap();
        fleet.push(OutboxSupervisor::start(config(n), pool, sink.clone()).unwrap());
    }
    eventually(WITHIN, "one leader", || async { saw(leaders(&db).await, |v| *v == 1) }).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(leaders(&db).await, 1, "one leader, whatever the followers try");
    let mut conn = db.conn().await;
    let event = |n: i64| NewEvent::new("lead", "a", "lead.row", serde_json::json!({"n": n}));
    let first = actix_outbox::enqueue(&mut conn, &event(1)).await.unwrap();
    let message = tokio::time::timeout(WITHIN, rx.recv()).await.expect("woken, not polled").unwrap();
    assert_eq!(message.id, first);

    // Stop every dispatcher in turn but the last: each time, one of the others leads, and a row
    // is published without a poll.
    for (round, stopped) in fleet.drain(..2).enumerate() {
        stopped.send(Shutdown).await.unwrap();
        drop(stopped);
        eventually(WITHIN, "a new leader", || async { saw(leaders(&db).await, |v| *v == 1) }).await;
        let id = actix_outbox::enqueue(&mut conn, &event(2 + round as i64)).await.unwrap();
        let message = tokio::time::timeout(WITHIN, rx.recv()).await.expect("woken, not polled").unwrap();
        assert_eq!(message.id, id, "round {round}");
    }
    fleet[0].send(Shutdown).await.unwrap();
    drop(fleet);
    eventually(WITHIN, "no leader left", || async { saw(leaders(&db).await, |v| *v == 0) }).await;
}
