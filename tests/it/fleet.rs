//! Several dispatchers on one outbox: what a fleet costs the database per message. Counted from
//! PostgreSQL's own statistics of the test's database (`pg_stat_database`: transactions and
//! buffer hits), which do not depend on the host's speed, at the same steady load for one
//! dispatcher and for three.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::ChannelSink;
use actix_outbox::{DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, PoolConfig};
use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use tokio::sync::mpsc::UnboundedReceiver;

use actix_outbox_test_support::{TestDb, eventually};

const WITHIN: Duration = Duration::from_secs(60);

#[derive(diesel::QueryableByName, Debug, Clone, Copy)]
struct DbStats {
    #[diesel(sql_type = BigInt)]
    xact_commit: i64,
    #[diesel(sql_type = BigInt)]
    blks_hit: i64,
}

async fn db_stats(db: &TestDb) -> DbStats {
    let mut conn = db.conn().await;
    diesel::sql_query("SELECT xact_commit, blks_hit FROM pg_stat_database WHERE datname = current_database()")
        .get_result(&mut conn)
        .await
        .unwrap()
}

/// What the dispatchers spent per row, in transactions and buffer hits.
#[derive(Debug, Clone, Copy)]
struct Cost {
    transactions: f64,
    buffer_hits: f64,
}

/// `processes` dispatchers (each a pool and a supervisor of its own, as separate processes
/// would have) relay `rows` rows committed one at a time at `rate` a second; returns what the
/// database did for them, the producer's own commits taken out.
async fn fleet_cost(processes: usize, rows: usize, rate: u32) -> Cost {
    let db = TestDb::new().await;
    let mut fleet = Vec::new();
    let mut receivers: Vec<UnboundedReceiver<Arc<OutboxMessage>>> = Vec::new();
    for n in 0..processes {
        let pool = PoolConfig::new(db.url.clone()).size(6).connect().await.unwrap();
        let (sink, rx) = ChannelSink::new();
        // Polls far apart: the rows come by the insert listener's wake-ups, and what is counted
        // is what the fleet does for them, not its idle polls (three times one's).
        let config = DispatcherConfig::default().owner(format!("fleet-{n}")).poll_interval(Duration::from_secs(5));
        fleet.push(OutboxSupervisor::start(config, pool, sink).unwrap());
        receivers.push(rx);
    }
    // Settled: listeners armed, the first claims run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut producer = db.conn().await;
    // A commit that waits for its WAL flush takes ~4 ms here: the producer would be the bound.
    diesel_async::SimpleAsyncConnection::batch_execute(&mut producer, "SET synchronous_commit = off").await.unwrap();
    let before = db_stats(&db).await;
    let started = Instant::now();
    for i in 0..rows {
        let due = started + Duration::from_secs_f64(i as f64 / f64::from(rate));
        tokio::time::sleep_until(due.into()).await;
        actix_outbox::enqueue(
            &mut producer,
            &NewEvent::new("fleet", format!("a{}", i % 50), "fleet.row", serde_json::json!({})),
        )
        .await
        .unwrap();
    }
    let mut seen = BTreeSet::new();
    eventually(WITHIN, "every row published", || {
        for rx in &mut receivers {
            while let Ok(m) = rx.try_recv() {
                seen.insert(m.id);
            }
        }
        let all = seen.len() == rows;
        async move { all }
    })
    .await;
    for dispatcher in &fleet {
        dispatcher.send(Shutdown).await.unwrap();
    }
    // Their connections closed, every backend has reported its statistics.
    drop(fleet);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = db_stats(&db).await;
    assert_eq!(db.count_status("done").await, rows as i64, "every row done");
    // The producer's commits and this function's first statistics read are not the fleet's.
    let transactions = (after.xact_commit - before.xact_commit - rows as i64 - 1) as f64 / rows as f64;
    let buffer_hits = (after.blks_hit - before.blks_hit) as f64 / rows as f64;
    Cost { transactions, buffer_hits }
}

/// Three dispatchers on one outbox cost the database about what one costs, per message, at the
/// same steady load: they do not all chase every insert. At a load this host keeps up with
/// beside a test suite (a leader that falls behind calls the others, rightly, and then they
/// claim too: at 250 rows/s, with the suite four tests at a time on two cores, three
/// dispatchers once did 1.30× one's transactions); the bench's loaded phase gives the figures
/// at 1,000 rows/s on a quiet host.
#[actix_rt::test]
async fn three_dispatchers_cost_about_what_one_costs_per_message() {
    let one = fleet_cost(1, 1500, 150).await;
    let three = fleet_cost(3, 1500, 150).await;
    eprintln!("one dispatcher: {one:?}; three: {three:?}");
    assert!(three.transactions <= one.transactions * 1.3, "transactions per row: one {one:?}, three {three:?}");
    assert!(three.buffer_hits <= one.buffer_hits * 1.3, "buffer hits per row: one {one:?}, three {three:?}");
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
    // Polls far apart: a row published soon was woken by the leader, not found by a poll.
    let config =
        |n: usize| DispatcherConfig::default().owner(format!("lead-{n}")).poll_interval(Duration::from_secs(30));
    let mut fleet = Vec::new();
    for n in 0..3 {
        let pool = PoolConfig::new(db.url.clone()).size(6).connect().await.unwrap();
        fleet.push(OutboxSupervisor::start(config(n), pool, sink.clone()).unwrap());
    }
    eventually(WITHIN, "one leader", || async { leaders(&db).await == 1 }).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(leaders(&db).await, 1, "one leader, whatever the followers try");
    let mut conn = db.conn().await;
    let event = |n: i64| NewEvent::new("lead", "a", "lead.row", serde_json::json!({"n": n}));
    let first = actix_outbox::enqueue(&mut conn, &event(1)).await.unwrap();
    let message = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("woken, not polled").unwrap();
    assert_eq!(message.id, first);

    // Stop every dispatcher in turn but the last: each time, one of the others leads, and a row
    // is published without a poll.
    for (round, stopped) in fleet.drain(..2).enumerate() {
        stopped.send(Shutdown).await.unwrap();
        drop(stopped);
        eventually(WITHIN, "a new leader", || async { leaders(&db).await == 1 }).await;
        let id = actix_outbox::enqueue(&mut conn, &event(2 + round as i64)).await.unwrap();
        let message =
            tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("woken, not polled").unwrap();
        assert_eq!(message.id, id, "round {round}");
    }
    fleet[0].send(Shutdown).await.unwrap();
    drop(fleet);
    eventually(WITHIN, "no leader left", || async { leaders(&db).await == 0 }).await;
}
