//! The actor system against a real PostgreSQL, with the in-process sink standing in for the
//! broker (this module is about the dispatcher; the RabbitMQ sink has its own tests).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix::prelude::*;
use actix_outbox::admin::Status;
use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{ActorPublisher, ChannelSink, Publish, SinkAction};
use actix_outbox::testing::CrashWorker;
use actix_outbox::{DispatcherConfig, OutboxMessage, OutboxSupervisor, PublishError, PublishResult};
use tokio::sync::mpsc::UnboundedReceiver;

use actix_outbox_test_support::{PATIENCE, TestDb, eventually, saw};

const WITHIN: Duration = PATIENCE;

fn config() -> DispatcherConfig {
    DispatcherConfig::default()
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5))
}

async fn all_done(db: &TestDb, n: i64) {
    eventually(WITHIN, &format!("{n} rows done"), || async { saw(db.count_status("done").await, |v| *v == n) }).await;
}

/// The rows of `ids` not done yet, with their status (`None`: not in the table).
async fn not_done(db: &TestDb, ids: &[i64]) -> Vec<(i64, Option<Status>)> {
    let rows = db.rows().await;
    ids.iter()
        .map(|&id| (id, rows.iter().find(|r| r.id == id).map(|r| r.status)))
        .filter(|(_, status)| *status != Some(Status::Done))
        .collect()
}

fn drain(rx: &mut UnboundedReceiver<Arc<OutboxMessage>>) -> Vec<Arc<OutboxMessage>> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

/// Scenario 3: 4 workers dispatch 100 rows: each published exactly once, all done.
#[actix_rt::test]
async fn four_workers_publish_each_row_exactly_once() {
    let db = TestDb::new().await;
    let ids = db.seed(100, "a").await;
    let (sink, mut rx) = ChannelSink::new();
    let dispatcher = OutboxSupervisor::start(config().workers(4).batch(7), db.pool.clone(), sink).unwrap();
    all_done(&db, 100).await;
    dispatcher.send(Shutdown).await.unwrap();

    let mut published: Vec<i64> = drain(&mut rx).iter().map(|m| m.id).collect();
    published.sort();
    assert_eq!(published, ids, "every row published once, none twice");
    let rows = db.rows().await;
    assert!(rows.iter().all(|r| r.status == Status::Done && r.attempts == 1 && r.lease_version == 1));
    assert!(rows.iter().all(|r| r.done_at.is_some() && r.lease_owner.is_none() && r.lease_until.is_none()));
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.claimed, m.published, m.done, m.lost_leases, m.retried, m.dead), (100, 100, 100, 0, 0, 0));
}

/// A claim's rows, confirmed one publish at a time, are finalized in one statement: the
/// finalizer waits for every row in flight to report (a flush per arrival wrote the first row
/// alone and the other 39 in a second statement).
#[actix_rt::test]
async fn a_claims_rows_are_finalized_in_one_statement() {
    let db = TestDb::new().await;
    let ids = db.seed(40, "a").await;
    let (sink, mut rx) = ChannelSink::new();
    let dispatcher = OutboxSupervisor::start(config().workers(1).batch(200), db.pool.clone(), sink).unwrap();
    all_done(&db, 40).await;
    dispatcher.send(Shutdown).await.unwrap();

    let mut published: Vec<i64> = drain(&mut rx).iter().map(|m| m.id).collect();
    published.sort();
    assert_eq!(published, ids);
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.claimed, m.done, m.finalizes), (40, 40, 1), "one claim of 40 rows, one finalize of 40");
}

/// Many claims from several workers share the work: with 4 workers and small batches more
/// than one worker claims.
#[actix_rt::test]
async fn workers_share_the_backlog_with_distinct_owner_ids() {
    let db = TestDb::new().await;
    db.seed(400, "a").await;
    let owners = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    // A slow sink keeps rows processing long enough to see who holds them.
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(20)));
    let dispatcher =
        OutboxSupervisor::start(config().workers(4).batch(10).owner("it-host:1".into()), db.pool.clone(), sink)
            .unwrap();
    eventually(WITHIN, "all done, watching owners", || {
        let owners = owners.clone();
        let db = &db;
        async move {
            for r in db.rows().await.iter().filter(|r| r.status == Status::Processing) {
                *owners.lock().unwrap().entry(r.lease_owner.clone().unwrap()).or_default() += 1;
            }
            saw(db.count_status("done").await, |n| *n == 400)
        }
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    let owners = owners.lock().unwrap();
    assert!(owners.len() >= 2, "several workers claimed: {owners:?}");
    assert!(owners.keys().all(|o| o.starts_with("it-host:1:worker-")), "{owners:?}");
}

/// A sink that panics on one message's first attempt: the panic kills only that publish; the
/// row stays processing (version 1) while the dispatcher keeps serving every other row; after
/// the lease expires it is reclaimed with version 2 and ends done; the dead attempt's late
/// finalize is fenced off.
#[actix_rt::test]
async fn panicking_sink_is_survived_and_its_row_reclaimed_after_the_lease() {
    let db = TestDb::new().await;
    let ids = db.seed(20, "a").await;
    let victim = ids[7];
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink
        .with_script(move |m| if m.id == victim && m.attempts == 1 { SinkAction::Panic } else { SinkAction::Deliver });
    let lease = Duration::from_secs(3);
    let dispatcher = OutboxSupervisor::start(
        config().workers(2).batch(5).lease(lease).publish_timeout(Duration::from_secs(1)),
        db.pool.clone(),
        sink,
    )
    .unwrap();

    all_done(&db, 19).await;
    let row = db.row(victim).await;
    assert_eq!((row.status, row.lease_version, row.attempts), (Status::Processing, 1, 1), "held by the dead attempt");

    // Rows inserted after the crash flow while the victim waits for its lease.
    let more = db.seed(10, "b").await;
    eventually(WITHIN, "new rows done while the victim is leased", || async {
        saw(not_done(&db, &more).await, |left| left.is_empty())
    })
    .await;
    assert_eq!(db.row(victim).await.lease_version, 1, "victim still under its first lease");

    all_done(&db, 30).await;
    let row = db.row(victim).await;
    assert_eq!((row.status, row.lease_version, row.attempts), (Status::Done, 2, 2));
    let late = actix_outbox::dispatcher::Fence { id: victim, lease_version: 1 };
    let mut conn = db.conn().await;
    assert!(actix_outbox::testing::mark_done(&mut conn, &[late]).await.unwrap().is_empty(), "stale finalize fenced");

    let published = drain(&mut rx);
    assert_eq!(published.iter().filter(|m| m.id == victim).map(|m| m.attempts).collect::<Vec<_>>(), vec![2]);
    assert_eq!(published.len(), 30);
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.publish_crashes, m.done, m.claimed), (1, 30, 31));
    dispatcher.send(Shutdown).await.unwrap();
}

/// Log lines written at `info` and above, as text (also used by `failover`).
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    /// Captures every log line of the process from now on, through a process-wide subscriber:
    /// only for a test that runs alone in its process ([`crate::alone`]). A thread-local one
    /// would race its neighbours' threads over the callsites' cached interest.
    pub(crate) fn install() -> Captured {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("alone in its process: no other subscriber");
        captured
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Logs at `info`, the command line's default, as text: the error about a row names it, and
/// no per-message span is rendered (it is at `debug`, so that the formatter does not pay for
/// one per message; under the `opentelemetry` feature it is `info`, and rendered). Runs alone
/// in a process of its own, so that no neighbour's logs or subscriber can mix in.
#[test]
fn at_info_a_sink_panic_names_its_row_without_a_per_message_span() {
    let name = "actors::at_info_a_sink_panic_names_its_row_without_a_per_message_span";
    crate::alone::test_alone(name, a_sink_panic_logged_at_info);
}

async fn a_sink_panic_logged_at_info() {
    let captured = Captured::install();

    let db = TestDb::new().await;
    let ids = db.seed(5, "a").await;
    let victim = ids[2];
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(move |m| if m.id == victim { SinkAction::Panic } else { SinkAction::Deliver });
    let dispatcher = OutboxSupervisor::start(config().workers(1), db.pool.clone(), sink).unwrap();
    all_done(&db, 4).await;
    eventually(WITHIN, "the panic logged", || async { saw(captured.text(), |logs| logs.contains("sink panicked")) })
        .await;
    dispatcher.send(Shutdown).await.unwrap();
    assert_eq!(drain(&mut rx).len(), 4);

    let logs = captured.text();
    let panics: Vec<&str> = logs.lines().filter(|l| l.contains("sink panicked")).collect();
    assert_eq!(panics.len(), 1, "{logs}");
    assert!(panics[0].contains(&format!("outbox_id={victim} lease_version=1")), "the row is named: {}", panics[0]);
    let spans = cfg!(feature = "opentelemetry");
    assert_eq!(logs.contains("publish{"), spans, "a per-message span at info only for OpenTelemetry:\n{logs}");
    assert!(!logs.contains("claimed batch"), "the batch lines are at debug: {logs}");
}

/// A claim actor that panics is replaced by the supervisor, and the replacement serves.
#[actix_rt::test]
async fn supervisor_restarts_a_crashed_claim_actor() {
    let db = TestDb::new().await;
    let (sink, mut rx) = ChannelSink::new();
    let dispatcher = OutboxSupervisor::start(config().workers(1), db.pool.clone(), sink).unwrap();
    dispatcher.send(CrashWorker(0)).await.unwrap();
    eventually(WITHIN, "restart counted", || async {
        saw(dispatcher.send(GetMetrics).await.unwrap().restarts, |v| *v == 1)
    })
    .await;

    let ids = db.seed(25, "a").await;
    all_done(&db, 25).await;
    let mut got: Vec<i64> = drain(&mut rx).iter().map(|m| m.id).collect();
    got.sort();
    assert_eq!(got, ids, "the only worker is the restarted one, and it published everything");
    assert_eq!(dispatcher.send(GetMetrics).await.unwrap().restarts, 1);
    dispatcher.send(Shutdown).await.unwrap();
}

/// A claim actor dies while its claim's answer is lost: the claim committed (its rows are leased
/// to the worker, as the rows here are), but nothing will publish them. The replacement hands
/// them back before its first claim, so they go out long before their 60 s lease expires, once
/// each. (The claim is a transaction of three statements, so a lost answer is its commit's; the
/// rows it leaves are set here as it leaves them, rather than by holding back the answer of one
/// statement at the right byte.)
#[actix_rt::test]
async fn a_claim_actor_that_dies_with_its_claim_unanswered_leaves_no_row_to_its_lease() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    // The rows are leased to the worker as a claim whose commit's answer was lost leaves them:
    // its first claims find nothing to take.
    let ids = db.seed(10, "held").await;
    db.conn()
        .await
        .batch_execute(
            "UPDATE outbox SET status = 'processing', lease_owner = 'claimer:worker-0', lease_version = 1,
                               attempts = 1, lease_until = now() + interval '60 seconds'",
        )
        .await
        .unwrap();
    let (sink, mut rx) = ChannelSink::new();
    let config = config().workers(1).batch(10).owner("claimer".to_owned()).lease(Duration::from_secs(60));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(db.count_status("processing").await, 10, "nothing to claim while the lease runs");
    dispatcher.send(CrashWorker(0)).await.unwrap();
    eventually(WITHIN, "the worker replaced", || async {
        saw(dispatcher.send(GetMetrics).await.unwrap().restarts, |v| *v == 1)
    })
    .await;

    all_done(&db, 10).await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    let mut got: Vec<i64> = drain(&mut rx).iter().map(|m| m.id).collect();
    got.sort();
    assert_eq!(got, ids, "each row published once");
    for id in &ids {
        let row = db.row(*id).await;
        assert_eq!((row.lease_version, row.attempts), (3, 1), "row {id}: handed back (2), claimed again (3)");
    }
    assert_eq!(metrics.released, 10, "{metrics:?}");
}

/// Scenario 6 through the actors: a sink that always fails retryably, max attempts 3: three
/// publishes (attempts 1, 2, 3), then dead with attempts 3.
#[actix_rt::test]
async fn retryable_failures_end_dead_after_max_attempts() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script(move |m| {
        log.lock().unwrap().push(m.attempts);
        SinkAction::Fail(PublishError::Retryable("503 from broker".into()))
    });
    let dispatcher = OutboxSupervisor::start(config().max_attempts(3), db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "row dead", || async { saw(db.row(id).await, |row| row.status == Status::Dead) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let row = db.row(id).await;
    assert_eq!((row.attempts, row.lease_version), (3, 3));
    assert!(row.last_error.unwrap().contains("503 from broker"));
    assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.retried, m.dead, m.done), (2, 1, 0));
}

/// Transient failures, then success: the row ends done, attempts counting every try; each
/// retry is one line at the default level naming the row, and the done row keeps what failed.
/// Alone in its process, for its logs.
#[test]
fn retryable_failure_then_success_ends_done() {
    crate::alone::test_alone("actors::retryable_failure_then_success_ends_done", retried_then_done);
}

async fn retried_then_done() {
    let captured = Captured::install();
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(|m| {
        if m.attempts < 3 { SinkAction::Fail(PublishError::Retryable("flaky".into())) } else { SinkAction::Deliver }
    });
    let dispatcher = OutboxSupervisor::start(config(), db.pool.clone(), sink).unwrap();
    all_done(&db, 1).await;
    dispatcher.send(Shutdown).await.unwrap();
    let row = db.row(id).await;
    assert_eq!(
        (row.attempts, row.lease_version, row.last_error.as_deref()),
        (3, 3, Some("retryable (attempt 2): flaky"))
    );
    let logs = captured.text();
    let retries: Vec<&str> = logs.lines().filter(|l| l.contains("publish failed; the row is pending again")).collect();
    assert_eq!(retries.len(), 2, "{logs}");
    for (line, attempt) in retries.iter().zip(1..) {
        assert!(line.contains(" WARN ") && line.contains(&format!("outbox_id={id} lease_version={attempt}")), "{line}");
        assert!(line.contains(&format!("retryable (attempt {attempt}): flaky")), "{line}");
    }
    assert_eq!(drain(&mut rx).iter().map(|m| (m.id, m.attempts)).collect::<Vec<_>>(), vec![(id, 3)]);
}

/// Permanent failures and deferrals through the actors.
#[actix_rt::test]
async fn permanent_goes_dead_and_defer_refunds() {
    let db = TestDb::new().await;
    let ids = db.seed(2, "a").await;
    let (permanent, deferred) = (ids[0], ids[1]);
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script(move |m| {
        if m.id == permanent {
            SinkAction::Fail(PublishError::Permanent("rejected".into()))
        } else {
            SinkAction::Fail(PublishError::Defer { delay: Duration::from_secs(3600), reason: "not yet".into() })
        }
    });
    let dispatcher = OutboxSupervisor::start(config(), db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "both finalized", || async {
        let (permanent, deferred) = (db.row(permanent).await, db.row(deferred).await);
        saw((permanent.status, deferred.last_error), |(status, error)| *status == Status::Dead && error.is_some())
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    let row = db.row(deferred).await;
    assert_eq!((row.status, row.attempts, row.lease_version), (Status::Pending, 0, 1));
    assert_eq!(db.row(permanent).await.attempts, 1);
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.dead, m.deferred, m.retried), (1, 1, 0));
}

/// A publish slower than the publish timeout is a retryable failure: the row goes back to
/// pending with the timeout recorded, not stuck in processing.
#[actix_rt::test]
async fn publish_timeout_reschedules_the_row() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_secs(60)));
    let config = config()
        .publish_timeout(Duration::from_millis(200))
        .backoff_base(Duration::from_secs(3600))
        .backoff_cap(Duration::from_secs(3600));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "rescheduled", || async { saw(db.row(id).await.last_error, |error| error.is_some()) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let row = db.row(id).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 1));
    assert!(row.last_error.unwrap().contains("publish timed out after 200ms"));
}

/// A user's own actix actor as the publish step.
#[actix_rt::test]
async fn a_users_actor_can_be_the_sink() {
    struct Collector(Vec<i64>);
    impl Actor for Collector {
        type Context = Context<Self>;
    }
    impl Handler<Publish> for Collector {
        type Result = PublishResult;
        fn handle(&mut self, msg: Publish, _: &mut Context<Self>) -> PublishResult {
            self.0.push(msg.message.id);
            if msg.message.event_type == "bad" { Err(PublishError::Permanent("bad event".into())) } else { Ok(()) }
        }
    }
    #[derive(Message)]
    #[rtype(result = "Vec<i64>")]
    struct Seen;
    impl Handler<Seen> for Collector {
        type Result = MessageResult<Seen>;
        fn handle(&mut self, _: Seen, _: &mut Context<Self>) -> Self::Result {
            MessageResult(self.0.clone())
        }
    }

    let db = TestDb::new().await;
    let ids = db.seed(5, "a").await;
    let mut conn = db.conn().await;
    let bad = actix_outbox::enqueue(&mut conn, &actix_outbox::NewEvent::new("t", "x", "bad", serde_json::json!(1)))
        .await
        .unwrap();
    let collector = Collector(Vec::new()).start();
    let sink = ActorPublisher::new(collector.clone().recipient());
    let dispatcher = OutboxSupervisor::start(config(), db.pool.clone(), sink).unwrap();
    all_done(&db, 5).await;
    eventually(WITHIN, "bad row dead", || async { saw(db.row(bad).await, |row| row.status == Status::Dead) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let mut seen = collector.send(Seen).await.unwrap();
    seen.sort();
    let mut expected = ids.clone();
    expected.push(bad);
    assert_eq!(seen, expected);
}

/// Shutdown stops claiming, lets in-flight publishes finish and be finalized, leaves nothing
/// processing, and is safe to send twice.
#[actix_rt::test]
async fn shutdown_drains_in_flight_and_leaves_nothing_processing() {
    let db = TestDb::new().await;
    db.seed(300, "a").await;
    let started = Arc::new(AtomicUsize::new(0));
    let counter = started.clone();
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
        SinkAction::Stall(Duration::from_millis(100))
    });
    let dispatcher = OutboxSupervisor::start(config().workers(2).batch(10), db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "publishing started", || async { saw(started.load(Ordering::SeqCst), |n| *n > 0) }).await;

    let (first, second) = tokio::join!(dispatcher.send(Shutdown), dispatcher.send(Shutdown));
    first.unwrap();
    second.unwrap();
    assert_eq!(db.count_status("processing").await, 0, "nothing left processing");
    let done = db.count_status("done").await;
    let published = drain(&mut rx).len() as i64;
    assert!(done > 0 && done < 300, "stopped mid-run: {done} done");
    assert_eq!(published, done, "every publish that started was finalized");
    assert_eq!(db.count_status("pending").await, 300 - done, "the rest untouched");

    // Stopped means stopped: new rows are not claimed, and a third Shutdown answers at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(db.count_status("done").await, done);
    dispatcher.send(Shutdown).await.unwrap();
}

/// An impossible configuration is refused before anything starts.
#[actix_rt::test]
async fn invalid_configuration_is_an_error_not_a_hang() {
    let db = TestDb::new().await;
    let (sink, _rx) = ChannelSink::new();
    let bad = [
        config().publish_timeout(Duration::from_secs(60)), // == lease
        config().workers(0),
        config().batch(0),
        config().max_attempts(0),
    ];
    for c in bad {
        let err = OutboxSupervisor::start(c.clone(), db.pool.clone(), sink.clone()).unwrap_err();
        assert!(matches!(err, actix_outbox::Error::Config(_)), "{c:?} gave {err}");
        assert!(!err.is_transient());
    }
}

/// Sessions of the test database that hold the armed lock of the insert listener of
/// `public.outbox` (its key's high and low 32 bits in pg_locks).
async fn armed_sessions(db: &TestDb) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = db.conn().await;
    let n: N = diesel_async::RunQueryDsl::get_result(
        diesel::sql_query(
            "SELECT count(*) AS n FROM pg_locks l JOIN pg_database d ON d.oid = l.database
             WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted
               AND l.mode = 'ExclusiveLock' AND l.objsubid = 1
               AND (l.classid::int8 << 32 | l.objid::int8) = hashtextextended('actix-outbox:armed:public.outbox', 0)",
        ),
        &mut conn,
    )
    .await
    .unwrap();
    n.n
}

/// Notifications that arrive on `conn`: waits for `expected` of them (up to [`WITHIN`]), then
/// 300 ms more for any beyond (which a check of "none" or "exactly one" is about).
async fn notifications(conn: &mut diesel_async::AsyncPgConnection, expected: usize) -> usize {
    use futures_util::StreamExt;
    let mut stream = std::pin::pin!(conn.notifications_stream());
    let mut n = 0;
    while n < expected && matches!(tokio::time::timeout(WITHIN, stream.next()).await, Ok(Some(Ok(_)))) {
        n += 1;
    }
    while let Ok(Some(Ok(_))) = tokio::time::timeout(Duration::from_millis(300), stream.next()).await {
        n += 1;
    }
    n
}

/// The insert trigger notifies only while a dispatcher is armed (a session holds the armed
/// lock): each NOTIFY serialises the producers' commits, so while no listener waits for one,
/// a producer commits without it. And a busy dispatcher disarms: under a stream of inserts the
/// producers stop notifying: the first insert's notification disarms it, and while its
/// workers have rows to claim it does not arm again, so the 200 rows committed after that
/// notify nobody; every row is still published, and the drained dispatcher arms again.
#[actix_rt::test]
async fn inserts_notify_only_while_a_dispatcher_is_armed() {
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
    let db = TestDb::new().await;
    let mut listening = db.conn().await;
    listening.batch_execute("LISTEN outbox_insert").await.unwrap();
    // Nobody armed: no notification.
    db.seed(1, "quiet").await;
    assert_eq!(notifications(&mut listening, 0).await, 0);
    // Armed (as the listener arms): the insert notifies.
    let mut armed = db.conn().await;
    armed
        .batch_execute("SELECT pg_advisory_lock(hashtextextended('actix-outbox:armed:public.outbox', 0))")
        .await
        .unwrap();
    db.seed(1, "loud").await;
    assert_eq!(notifications(&mut listening, 1).await, 1);
    // A producer transaction that found the lock free keeps a listener from arming until it
    // commits (so that the claim after arming sees its row).
    armed
        .batch_execute("SELECT pg_advisory_unlock(hashtextextended('actix-outbox:armed:public.outbox', 0))")
        .await
        .unwrap();
    let mut producer = db.conn().await;
    producer.batch_execute("BEGIN").await.unwrap();
    producer
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', 'open', 'e', '{}')",
        )
        .await
        .unwrap();
    #[derive(diesel::QueryableByName)]
    struct Locked {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        ok: bool,
    }
    let try_arm = || {
        diesel::sql_query("SELECT pg_try_advisory_lock(hashtextextended('actix-outbox:armed:public.outbox', 0)) AS ok")
    };
    assert!(!try_arm().get_result::<Locked>(&mut armed).await.unwrap().ok, "armed while a producer is open");
    producer.batch_execute("COMMIT").await.unwrap();
    assert!(try_arm().get_result::<Locked>(&mut armed).await.unwrap().ok, "not armed after the producer committed");
    armed
        .batch_execute("SELECT pg_advisory_unlock(hashtextextended('actix-outbox:armed:public.outbox', 0))")
        .await
        .unwrap();
    db.pool.get().await.unwrap().batch_execute("DELETE FROM outbox").await.unwrap();
    let _ = notifications(&mut listening, 0).await;

    // A dispatcher polling only once an hour: its listener arms when idle, disarms once rows
    // stream in, and wakes its workers itself meanwhile. One row in flight a worker, each held
    // half a second by the sink while `hold` is set: rows stay pending, so no claim comes back
    // empty and the listener has no reason to arm again, however fast or slow the host.
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script({
        let hold = hold.clone();
        move |_| {
            if std::sync::atomic::AtomicBool::load(&hold, Ordering::Relaxed) {
                SinkAction::Stall(Duration::from_millis(500))
            } else {
                SinkAction::Deliver
            }
        }
    });
    let hour = Duration::from_secs(3600);
    let config = config().workers(2).batch(1).max_in_flight(1).poll_interval(hour);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "listener armed", || async { saw(armed_sessions(&db).await, |v| *v == 1) }).await;
    #[derive(diesel::QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    // Twenty rows in one statement (one notification, which disarms the listener), then one
    // producer committing row after row, as fast as it can.
    let first: Vec<Id> = diesel::sql_query(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 't', 'first' || n, 'e', '{}' FROM generate_series(1, 20) n RETURNING id",
    )
    .get_results(&mut producer)
    .await
    .unwrap();
    let mut ids: Vec<i64> = first.iter().map(|r| r.id).collect();
    eventually(WITHIN, "disarmed by the first insert", || async { saw(armed_sessions(&db).await, |v| *v == 0) }).await;
    for n in 0..200 {
        let id: Id = diesel::sql_query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('t', $1, 'e', '{}') RETURNING id",
        )
        .bind::<diesel::sql_types::Text, _>(format!("s{n}"))
        .get_result(&mut producer)
        .await
        .unwrap();
        ids.push(id.id);
    }
    assert_eq!(notifications(&mut listening, 1).await, 1, "only the first of 201 inserts notified");
    hold.store(false, Ordering::Relaxed);
    eventually(WITHIN, "every streamed row done", || async { saw(not_done(&db, &ids).await, |left| left.is_empty()) })
        .await;
    // Drained, it arms again.
    eventually(WITHIN, "listener armed again", || async { saw(armed_sessions(&db).await, |v| *v == 1) }).await;
    dispatcher.send(Shutdown).await.unwrap();
}

/// The insert trigger's NOTIFY wakes an idle worker at once: with a poll interval of an hour,
/// rows inserted after the first (empty) claim are still published promptly — both by a plain
/// SQL producer and by `enqueue`.
#[actix_rt::test]
async fn inserts_wake_an_idle_dispatcher_without_polling() {
    let db = TestDb::new().await;
    let (sink, mut rx) = ChannelSink::new();
    let hour = Duration::from_secs(3600);
    let dispatcher = OutboxSupervisor::start(config().workers(2).poll_interval(hour), db.pool.clone(), sink).unwrap();
    // Let the start-up claims run, the workers go idle on their hour-long poll, and the listener
    // arm (rows inserted from then on notify).
    eventually(WITHIN, "listener armed", || async { saw(armed_sessions(&db).await, |v| *v == 1) }).await;
    for round in 0..3 {
        let ids = db.seed(3, &format!("r{round}")).await;
        eventually(WITHIN, &format!("round {round} published"), || async {
            saw(not_done(&db, &ids).await, |left| left.is_empty())
        })
        .await;
    }
    assert_eq!(drain(&mut rx).len(), 9);
    dispatcher.send(Shutdown).await.unwrap();
}

/// A publish still running at a third of the lease extends its lease (a fenced heartbeat), so a
/// slow but alive sink keeps its claim; the row then ends done at its first attempt. With the
/// publish timeout shorter than a third of the lease no heartbeat is needed (nor armed): the
/// publish ends before the first one would fire.
#[actix_rt::test]
async fn slow_publish_extends_its_lease_by_heartbeat() {
    let db = TestDb::new().await;
    let ids = db.seed(1, "a").await;
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(900)));
    let lease = Duration::from_millis(1500);
    let config = config().workers(1).lease(lease).publish_timeout(Duration::from_millis(1400));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "row claimed", || async { saw(db.row(ids[0]).await, |row| row.status == Status::Processing) })
        .await;
    let claimed = db.row(ids[0]).await.lease_until.expect("a claimed row has a lease");
    // The heartbeat fires at lease / 3 = 500 ms and pushes lease_until to now() + lease.
    eventually(WITHIN, "lease extended", || async {
        saw(db.row(ids[0]).await.lease_until, |until| {
            until.is_some_and(|until| until - claimed > chrono::Duration::milliseconds(300))
        })
    })
    .await;
    all_done(&db, 1).await;
    dispatcher.send(Shutdown).await.unwrap();
    let row = db.row(ids[0]).await;
    assert_eq!((row.lease_version, row.attempts), (1, 1), "one claim, never taken over: {row:?}");
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.done, m.lost_leases, m.retried), (1, 0, 0));
}

/// A transaction began (and inserted its row) before a thousand later rows were inserted,
/// committed and published; it commits after them. The dispatcher's cursor remembered it as in
/// progress when it passed its id, and its next claim takes the row at once, through the cursor:
/// not through the sweep's safety net for rows the claims passed (which would count a stray and
/// move the row to `outbox_later`, seconds later).
#[actix_rt::test]
async fn a_row_committed_after_a_thousand_later_rows_were_published_is_published() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    let (sink, mut rx) = ChannelSink::new();
    let dispatcher = OutboxSupervisor::start(config(), db.pool.clone(), sink).unwrap();

    let mut late_tx = db.conn().await;
    late_tx.batch_execute("BEGIN").await.unwrap();
    let late =
        actix_outbox::enqueue(&mut late_tx, &actix_outbox::NewEvent::new("t", "late", "late", serde_json::json!({})))
            .await
            .unwrap();
    let mut later = Vec::new();
    for _ in 0..10 {
        later.extend(db.seed(100, "a").await);
    }
    let mut seen = Vec::new();
    eventually(WITHIN, "the thousand later rows published", || {
        seen.extend(drain(&mut rx).into_iter().map(|m| m.id));
        let n = seen.len();
        async move { n >= 1000 }
    })
    .await;
    late_tx.batch_execute("COMMIT").await.unwrap();
    eventually(WITHIN, "the late row published", || {
        seen.extend(drain(&mut rx).into_iter().map(|m| m.id));
        let found = saw(seen.len(), |_| seen.contains(&late));
        async move { found }
    })
    .await;
    all_done(&db, 1001).await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    seen.sort_unstable();
    let mut expected = later.clone();
    expected.push(late);
    expected.sort_unstable();
    assert_eq!(seen, expected, "each row published once");
    let row = db.row(late).await;
    assert_eq!((row.lease_version, row.attempts), (1, 1));
    assert!(row.available_at <= row.created_at, "taken as a new row, not moved to wait: {row:?}");
    assert_eq!(metrics.strays, 0, "{metrics:?}");
}

/// The database commits a `mark done` and the connection dies before the answer arrives. The
/// finalizer runs the write again on a new connection, finds the row already done at its
/// claim's version, and counts it as done, not as a lost lease.
#[actix_rt::test]
async fn a_finalize_whose_answer_was_lost_is_read_back_not_reported_as_a_lost_lease() {
    let (db, id) = finalize_with_lost_answer(actix_outbox::Retention::Keep).await;
    let row = db.row(id).await;
    assert_eq!((row.status, row.lease_version, row.attempts), (Status::Done, 1, 1));
}

/// The same under `Retention::Delete`: the delete committed, its answer was lost, and the
/// retried delete finds no row: the read-back counts it as done.
#[actix_rt::test]
async fn a_delete_whose_answer_was_lost_is_read_back_not_reported_as_a_lost_lease() {
    let (db, _) = finalize_with_lost_answer(actix_outbox::Retention::Delete).await;
    assert!(db.rows().await.is_empty());
}

/// How long a finalize may take to commit while the database's answers are held back: it is
/// sent at once, unless something else holds the one connection.
const STALLED_FINALIZE: Duration = Duration::from_secs(15);

/// Rows through one connection behind a proxy; the last row's finalize commits and its answer
/// is lost with the connection. Asserts that the dispatcher counted every row done and no lost
/// lease; returns the last row's id.
async fn finalize_with_lost_answer(retention: actix_outbox::Retention) -> (TestDb, i64) {
    let db = TestDb::new().await;
    db.seed(1, "a").await;
    let proxy = Arc::new(crate::proxy::Proxy::start("127.0.0.1:5432".into()).await);
    // One connection, which the first row's claim and finalize leave with both statements
    // prepared: a statement not yet prepared would wait for the silent database before it ran.
    let pool = actix_outbox::connect_pool(&proxy.route(&db.url), 1).await.unwrap();
    // From the publish of the `stall` row on, nothing the database says reaches the dispatcher:
    // that row's `mark done` commits, its answer is held back.
    let (sink, _rx) = ChannelSink::new();
    let stalling = proxy.clone();
    let sink = sink.with_script(move |m| {
        if m.event_type == "stall" {
            stalling.stall_downstream();
        }
        SinkAction::Deliver
    });
    // The `stall` row is claimed by a poll; the next poll comes a second later, when the
    // finalizer already holds the one connection (a claim holding it instead would keep the
    // finalize from running at all). No insert listener: after a notification it wakes the
    // worker every few milliseconds until the table is drained, and such a claim could take the
    // one connection first.
    let quiet =
        config().workers(1).poll_interval(Duration::from_secs(1)).listen_for_inserts(false).retention(retention);
    let dispatcher = OutboxSupervisor::start(quiet, pool, sink).unwrap();
    // Each row is in the table from its insert on, so under Delete an empty table means every
    // row so far was finalized.
    let finalized = async |n: i64| match retention {
        actix_outbox::Retention::Delete => db.rows().await.is_empty(),
        _ => db.count_status("done").await == n,
    };
    let settled = async |n: i64| {
        eventually(WITHIN, &format!("{n} rows finalized"), || async { saw(finalized(n).await, |f| *f) }).await
    };
    settled(1).await;
    let mut conn = db.conn().await;
    let mut rows = 1;
    let mut tries = 0;
    let id = loop {
        tries += 1;
        let stall = actix_outbox::NewEvent::new("test", "a", "stall", serde_json::json!({}));
        let id = actix_outbox::enqueue(&mut conn, &stall).await.unwrap();
        rows += 1;
        // The row's finalize commits while its answer is held back. Unless the sweep (every
        // second) had the one connection, waiting for its own answer, when they stopped: then
        // nothing goes through until they flow again. Let them, and try with another row.
        let deadline = std::time::Instant::now() + STALLED_FINALIZE;
        let mut through = finalized(rows).await;
        while !through && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            through = finalized(rows).await;
        }
        if through {
            break id;
        }
        assert!(tries < 5, "in {tries} tries, no finalize went through while the answers were held");
        proxy.resume();
        settled(rows).await;
    };
    proxy.sever();
    proxy.resume();

    eventually(WITHIN, "the finalizer settles the row", || async {
        saw(dispatcher.send(GetMetrics).await.unwrap(), |m| m.done + m.lost_leases + m.finalize_errors >= rows as u64)
    })
    .await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.done, m.lost_leases), (rows as u64, 0), "{m:?}");
    if tries == 1 {
        assert_eq!(m.finalize_errors, 0, "{m:?}");
    }
    (db, id)
}

/// Every database connection drops at once (a restart, a failover): pooled connections are not
/// pinged on checkout, so each dead one fails one statement and is then replaced, and the
/// dispatcher goes on with nothing lost and nothing published twice.
#[actix_rt::test]
async fn the_dispatcher_recovers_when_its_database_connections_drop() {
    let db = TestDb::new().await;
    let mut ids = db.seed(50, "a").await;
    let proxy = crate::proxy::Proxy::start("127.0.0.1:5432".into()).await;
    let pool = actix_outbox::connect_pool(&proxy.route(&db.url), 6).await.unwrap();
    let (sink, mut rx) = ChannelSink::new();
    let dispatcher = OutboxSupervisor::start(config().workers(4).batch(10), pool, sink).unwrap();
    all_done(&db, 50).await;

    proxy.sever();
    ids.extend(db.seed(50, "b").await);
    all_done(&db, 100).await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let m = dispatcher.send(GetMetrics).await.unwrap();

    let mut published: Vec<i64> = drain(&mut rx).iter().map(|m| m.id).collect();
    published.sort();
    assert_eq!(published, ids, "every row published once");
    assert_eq!((m.done, m.lost_leases, m.finalize_errors), (100, 0, 0), "{m:?}");
    assert!(m.claim_errors > 0, "the dead connections were used and failed: {m:?}");
}

/// `Retention::Delete`: every confirmed row is deleted, once, by its claim's fenced finalize; a
/// row that failed first is deleted after the retry that got through; a dead row stays.
#[actix_rt::test]
async fn delete_retention_deletes_each_confirmed_row_and_keeps_the_dead_ones() {
    let db = TestDb::new().await;
    let ids = db.seed(60, "a").await;
    let (poison, flaky) = (ids[10], ids[20]);
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(move |m| match m.id {
        id if id == poison => SinkAction::Fail(PublishError::Permanent("rejected".into())),
        id if id == flaky && m.attempts == 1 => SinkAction::Fail(PublishError::Retryable("flaky".into())),
        _ => SinkAction::Deliver,
    });
    let config = config().workers(3).batch(7).retention(actix_outbox::Retention::Delete);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "only the dead row left", || async { saw(db.rows().await.len(), |v| *v == 1) }).await;
    // After the shutdown, which waits for the finalizes: a row is gone from the table when its
    // finalize commits, a moment before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let m = dispatcher.send(GetMetrics).await.unwrap();

    let rows = db.rows().await;
    assert_eq!(rows.iter().map(|r| (r.id, r.status, r.attempts)).collect::<Vec<_>>(), vec![(poison, Status::Dead, 1)]);
    let mut published: Vec<(i64, i32)> = drain(&mut rx).iter().map(|m| (m.id, m.attempts)).collect();
    published.sort();
    let expected: Vec<(i64, i32)> =
        ids.iter().filter(|&&id| id != poison).map(|&id| (id, if id == flaky { 2 } else { 1 })).collect();
    assert_eq!(published, expected, "every other row published once (the flaky one on its second attempt)");
    assert_eq!((m.done, m.dead, m.retried, m.lost_leases), (59, 1, 1, 0), "{m:?}");
}

/// A pool shared with an actix-web app gets connections opened by its HTTP workers, whose
/// runtimes stop at shutdown before the dispatcher drains. Connections opened on a runtime
/// that has since stopped still serve the dispatcher: every row done on the first attempt.
#[actix_rt::test]
async fn pooled_connections_outlive_the_runtime_that_opened_them() {
    let db = TestDb::new().await;
    let ids = db.seed(30, "a").await;
    let pool = actix_outbox::connect_pool(&db.url, 4).await.unwrap();
    let opener = pool.clone();
    std::thread::spawn(move || {
        let worker = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        worker.block_on(async {
            // Four at once, so that the pool opens four connections here.
            let conns = futures_util::future::join_all((0..4).map(|_| opener.get())).await;
            for conn in conns {
                let mut conn = conn.unwrap();
                diesel_async::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), &mut *conn).await.unwrap();
            }
        });
        // The runtime ends here, as an HTTP worker's does at shutdown.
    })
    .join()
    .unwrap();
    assert_eq!(pool.state().connections, 4, "the four connections are kept, idle");

    let (sink, mut rx) = ChannelSink::new();
    let dispatcher = OutboxSupervisor::start(config().workers(2), pool.clone(), sink).unwrap();
    all_done(&db, 30).await;
    dispatcher.send(Shutdown).await.unwrap();
    let mut got: Vec<i64> = drain(&mut rx).iter().map(|m| m.id).collect();
    got.sort();
    assert_eq!(got, ids);
    assert!(db.rows().await.iter().all(|r| r.attempts == 1), "no row needed a second attempt");
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!(
        (m.retried, m.claim_errors, m.finalize_retries, m.finalize_errors),
        (0, 0, 0, 0),
        "no statement failed on a connection opened by the stopped runtime"
    );
}

/// A sink made of an async closure serves the dispatcher like any other: what it returns
/// decides each row (one permanent failure goes dead), and it sees each row once.
#[actix_rt::test]
async fn an_async_closure_is_a_sink() {
    let db = TestDb::new().await;
    let ids = db.seed(12, "a").await;
    let refused = ids[4];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = actix_outbox::sink::publisher_fn(async move |message: Arc<OutboxMessage>| {
        tx.send(message.id).unwrap();
        if message.id == refused {
            return Err(actix_outbox::PublishError::Permanent("refused by the closure".into()));
        }
        Ok(())
    });
    let dispatcher = OutboxSupervisor::start(config().workers(2), db.pool.clone(), sink).unwrap();
    all_done(&db, 11).await;
    eventually(WITHIN, "the refused row dead", || async { saw(db.count_status("dead").await, |v| *v == 1) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let mut seen = Vec::new();
    while let Ok(id) = rx.try_recv() {
        seen.push(id);
    }
    seen.sort();
    assert_eq!(seen, ids, "each row handed to the closure once");
    let dead = db.row(refused).await;
    assert_eq!(dead.last_error.as_deref(), Some("permanent: refused by the closure"));
}
