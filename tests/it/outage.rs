//! Outages: a sink or a database that goes away must cost the messages nothing. These tests drive
//! the dispatcher with an in-process sink whose health the test controls, and put a TCP proxy
//! in front of the real PostgreSQL to cut it; the RabbitMQ sink's own outage tests are in
//! `rabbit.rs`.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{ChannelSink, PublishFuture, SinkAction, SinkState};
use actix_outbox::testing::CrashFinalizer;
use actix_outbox::{DispatcherConfig, OutboxMessage, OutboxSupervisor, PublishError, Publisher};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::proxy::Proxy;
use actix_outbox_test_support::{PATIENCE, TestDb, database_addr, eventually, saw};

const WITHIN: Duration = PATIENCE;

fn config() -> DispatcherConfig {
    DispatcherConfig::default()
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5))
        .sink_probe_interval(Duration::from_millis(100))
}

/// Every message received so far, by id, with how many copies arrived.
fn copies(rx: &mut UnboundedReceiver<Arc<OutboxMessage>>, seen: &mut BTreeMap<i64, usize>) {
    while let Ok(m) = rx.try_recv() {
        *seen.entry(m.id).or_default() += 1;
    }
}

/// A sink that fails every publish as unavailable for three seconds, far longer than the three
/// attempts a row has would last with this backoff: no row is spent, the dispatcher stops
/// claiming (the sink is called for the window in flight and one probe a time), and once the
/// sink is back every row is delivered once with exactly one attempt spent.
#[actix_rt::test]
async fn an_unavailable_sink_spends_no_attempt_however_long_it_is_away() {
    let db = TestDb::new().await;
    let down = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script({
        let (down, calls) = (down.clone(), calls.clone());
        move |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            if down.load(Ordering::Relaxed) {
                SinkAction::Fail(PublishError::Unavailable("link down (scripted)".into()))
            } else {
                SinkAction::Deliver
            }
        }
    });
    let config = config().workers(2).batch(50).max_attempts(3);
    let window = 2 * config.in_flight_limit();
    let ids = db.seed(300, "away").await;
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();

    tokio::time::sleep(Duration::from_secs(3)).await;
    let while_down = calls.load(Ordering::Relaxed);
    // The first claims of each worker, then a probe every 100 ms (30 in 3 s, with slack).
    assert!(while_down <= window + 40, "the sink was called {while_down} times while away (window {window})");
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.retried, metrics.dead, metrics.done), (0, 0, 0), "{metrics:?}");
    assert_eq!(metrics.sink_outages, 1, "one outage, paused once: {metrics:?}");
    let rows = db.rows().await;
    assert!(
        rows.iter().all(|r| r.attempts == 0 || r.status == actix_outbox::admin::Status::Processing),
        "refunded while away"
    );

    down.store(false, Ordering::Relaxed);
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 300) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen);
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), ids, "every row delivered");
    assert!(seen.values().all(|&n| n == 1), "each exactly once");
    let attempts: BTreeSet<i32> = db.rows().await.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, BTreeSet::from([1]), "the outage cost no attempt");
    assert_eq!(db.count_status("dead").await, 0);
}

/// A sink that says it is down is not called at all: nothing is claimed while it is down, and
/// when it says it is up the rows are claimed and published once each.
#[actix_rt::test]
async fn a_sink_that_says_it_is_down_is_not_called_until_it_is_up() {
    let db = TestDb::new().await;
    let down = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink
        .with_script({
            let calls = calls.clone();
            move |_| {
                calls.fetch_add(1, Ordering::Relaxed);
                SinkAction::Deliver
            }
        })
        .with_state({
            let down = down.clone();
            move || {
                if down.load(Ordering::Relaxed) {
                    SinkState::Down("reconnecting (scripted)".into())
                } else {
                    SinkState::Up
                }
            }
        });
    let ids = db.seed(100, "said").await;
    let dispatcher = OutboxSupervisor::start(config(), db.pool.clone(), sink).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(calls.load(Ordering::Relaxed), 0, "a sink that says it is down is not called");
    assert_eq!(db.count_status("pending").await, 100, "nothing is claimed while the sink is down");

    down.store(false, Ordering::Relaxed);
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 100) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen);
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), ids);
    assert!(seen.values().all(|&n| n == 1));
    assert_eq!(calls.load(Ordering::Relaxed), 100, "one call per row");
}

/// A sink that blocks (a broker under a resource alarm) holds what it was sent: publishes wait
/// past the publish timeout and past the lease (kept alive by heartbeats), nothing more is
/// claimed, nothing is timed out or published again, and every row ends done on its first claim.
#[actix_rt::test]
async fn a_blocked_sink_holds_its_publishes_past_the_timeout_and_the_lease() {
    #[derive(Debug)]
    struct Blocking {
        blocked: Arc<AtomicBool>,
        calls: Arc<AtomicUsize>,
    }
    impl Publisher for Blocking {
        fn publish(&self, _: Arc<OutboxMessage>) -> PublishFuture {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let blocked = self.blocked.clone();
            Box::pin(async move {
                while blocked.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Ok(())
            })
        }
        fn state(&self) -> SinkState {
            if self.blocked.load(Ordering::Relaxed) {
                SinkState::Blocked("memory alarm (scripted)".into())
            } else {
                SinkState::Up
            }
        }
    }
    let db = TestDb::new().await;
    let blocked = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let sink = Blocking { blocked: blocked.clone(), calls: calls.clone() };
    let config =
        config().workers(2).batch(20).lease(Duration::from_millis(1500)).publish_timeout(Duration::from_millis(300));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    // Started blocked: the gate is closed; one probe row goes to the sink and waits there.
    db.seed(200, "held").await;
    // Two leases' worth of being blocked.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = calls.load(Ordering::Relaxed);
    assert!(held <= 2, "a blocked sink gets at most a probe, got {held} publishes");
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.retried, metrics.lost_leases, metrics.dead), (0, 0, 0), "{metrics:?}");

    blocked.store(false, Ordering::Relaxed);
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 200) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 200, "each row published once: nothing timed out and went again");
    let rows = db.rows().await;
    assert!(rows.iter().all(|r| r.lease_version == 1 && r.attempts == 1), "no row was reclaimed or retried");
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.retried, metrics.lost_leases), (0, 0), "{metrics:?}");
}

/// PostgreSQL is cut (through a proxy) for ten seconds while rows are being published: the
/// finalizer keeps its fences and retries, so the published rows end done soon after the
/// database's return, long before their hour-long lease would expire, and nothing is published
/// twice. Claims back off meanwhile instead of failing at the poll rate. A claim cut after it
/// committed leased rows whose answer never came: they are handed back by the worker's next
/// claim (version 2) and claimed again (version 3), not left to their lease.
#[actix_rt::test]
async fn a_database_outage_costs_no_lease_and_publishes_nothing_twice() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(database_addr()).await;
    let pool = actix_outbox::connect_pool(&proxy.route(&db.url), 8).await.unwrap();
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(300)));
    let ids = db.seed(600, "cut").await;
    let config = config().workers(2).batch(50).lease(Duration::from_secs(3600));
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    eventually(WITHIN, "rows in flight", || async { saw(db.count_status("processing").await, |v| *v >= 100) }).await;

    proxy.refuse(true);
    proxy.sever();
    tokio::time::sleep(Duration::from_secs(10)).await;
    proxy.refuse(false);

    // Well within the hour's lease: nothing waits for its expiry (about a second on a quiet
    // machine).
    eventually(WITHIN, "every row done long before the lease would expire", || async {
        saw(db.count_status("done").await, |v| *v == 600)
    })
    .await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen);
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), ids, "every row delivered");
    assert!(seen.values().all(|&n| n == 1), "nothing published twice");
    let rows = db.rows().await;
    let handed_back: Vec<_> = rows.iter().filter(|r| r.lease_version != 1).map(|r| (r.id, r.lease_version)).collect();
    assert!(
        handed_back.iter().all(|&(_, v)| v == 3),
        "claimed once, or handed back once and claimed again: {handed_back:?}"
    );
    assert_eq!(handed_back.len(), metrics.released as usize, "{metrics:?}");
    assert!(rows.iter().all(|r| r.attempts == 1), "one attempt each: a lost claim's attempt is refunded");
    assert!(metrics.finalize_retries > 0, "the finalizer retried: {metrics:?}");
    assert_eq!((metrics.lost_leases, metrics.finalize_errors), (0, 0), "{metrics:?}");
    // 2 workers backing off over 10 s: a handful each, not one every 50 ms poll.
    assert!(metrics.claim_errors <= 40, "claims backed off: {metrics:?}");
}

/// With the publish timeout above a third of the lease, a publish's heartbeat can fall due just
/// as its outcome is queued. The heartbeat must not follow the outcome (it would find the row
/// finalized and report a lost lease that never happened).
#[actix_rt::test]
async fn a_heartbeat_never_follows_its_rows_outcome() {
    let db = TestDb::new().await;
    let (sink, mut rx) = ChannelSink::new();
    // Publishes end around each heartbeat (every lease / 3 = 100 ms).
    let sink = sink.with_script(|m| SinkAction::Stall(Duration::from_millis(95 + (m.id % 10) as u64)));
    let config =
        config().workers(2).batch(50).lease(Duration::from_millis(300)).publish_timeout(Duration::from_millis(250));
    db.seed(400, "beat").await;
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 400) }).await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen);
    assert_eq!(seen.len(), 400);
    assert_eq!(metrics.lost_leases, 0, "no false lost lease: {metrics:?}");
}

/// The finalize actor dies while the dispatcher drains: the supervisor still replaces it, the
/// publishes in flight send their writes to the new one, and the shutdown leaves nothing
/// processing, as it promises.
#[actix_rt::test]
async fn a_finalizer_that_dies_while_draining_is_replaced_and_nothing_stays_processing() {
    let db = TestDb::new().await;
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(500)));
    db.seed(40, "drain").await;
    let dispatcher = OutboxSupervisor::start(config().workers(2).batch(20), db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "40 rows in flight", || async { saw(db.count_status("processing").await, |v| *v == 40) }).await;
    let shutdown = dispatcher.send(Shutdown);
    dispatcher.send(CrashFinalizer).await.unwrap();
    tokio::time::timeout(WITHIN, shutdown).await.expect("shutdown answered").unwrap();
    assert_eq!(db.count_status("processing").await, 0, "nothing left processing");
    assert_eq!(db.count_status("done").await, 40);
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!(metrics.restarts, 1, "{metrics:?}");
}

/// Large rows: the dispatcher holds no more payload bytes claimed than its budget (plus one
/// row per worker), whatever the row window would allow, and every row still goes.
#[actix_rt::test]
async fn large_rows_are_claimed_within_the_byte_budget() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let pad = "x".repeat(100_000);
    let events: Vec<_> =
        (0..60).map(|_| actix_outbox::NewEvent::new("t", "big", "t.big", serde_json::json!({ "pad": pad }))).collect();
    actix_outbox::enqueue_many(&mut conn, &events).await.unwrap();
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(50)));
    // 1 MB for 2 workers: 500 kB each, about 5 rows of 100 kB in flight per worker.
    let config = config().workers(2).batch(50).max_in_flight_bytes(1_000_000);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    let mut peak = 0;
    let mut seen = BTreeMap::new();
    while db.count_status("done").await < 60 {
        let held = dispatcher.send(GetMetrics).await.unwrap().in_flight_bytes;
        peak = peak.max(held);
        peak = peak.max(100_011 * db.count_status("processing").await as u64);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    dispatcher.send(Shutdown).await.unwrap();
    copies(&mut rx, &mut seen);
    assert_eq!(seen.len(), 60);
    assert!(peak > 0, "something was measured in flight");
    assert!(peak <= 1_000_000 + 2 * 100_011, "peak {peak} bytes in flight, budget 1,000,000");
    assert_eq!(dispatcher.send(GetMetrics).await.unwrap().in_flight_bytes, 0, "every byte accounted back");
}
