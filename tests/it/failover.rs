//! The database as production runs it when a server may die: a primary with a streaming
//! standby (both the test's own, `ReplicatedPair`), the dispatcher connected through a
//! multi-host URL with `target_session_attrs=read-write`, and a failover mid-run; and a
//! dispatcher pointed at a standby alone.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_outbox::admin::{OutboxRow, Status};
use actix_outbox::dispatcher::{GetHealth, GetMetrics, Shutdown};
use actix_outbox::schema::outbox;
use actix_outbox::sink::{ChannelSink, SinkAction};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::actors::Captured;
use actix_outbox_test_support::{PATIENCE, ReplicatedPair, Replication, eventually, saw};

const WITHIN: Duration = PATIENCE;

/// One database on one server of the pair, by URL.
struct On(String);

impl On {
    async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.0).await.unwrap_or_else(|e| panic!("connect to {}: {e}", self.0))
    }

    async fn seed(&self, n: usize, agg: &str) -> Vec<i64> {
        let events: Vec<_> =
            (0..n).map(|i| NewEvent::new("test", agg, "test.happened", serde_json::json!({"n": i}))).collect();
        let mut conn = self.conn().await;
        let mut ids = Vec::new();
        for chunk in events.chunks(1000) {
            ids.extend(actix_outbox::enqueue_many(&mut conn, chunk).await.expect("seed"));
        }
        ids
    }

    async fn rows(&self) -> Vec<OutboxRow> {
        let mut conn = self.conn().await;
        outbox::table.order(outbox::id).select(OutboxRow::as_select()).load(&mut conn).await.expect("rows")
    }

    async fn count_status(&self, status: &str) -> i64 {
        let mut conn = self.conn().await;
        outbox::table.filter(outbox::status.eq(status)).count().get_result(&mut conn).await.expect("count")
    }

    /// Rows still leased into the future (a finalize the failover lost leaves one).
    async fn live_leases(&self) -> i64 {
        let mut conn = self.conn().await;
        outbox::table
            .filter(outbox::status.eq("processing"))
            .filter(outbox::lease_until.gt(diesel::dsl::now))
            .count()
            .get_result(&mut conn)
            .await
            .expect("count")
    }

    /// On a standby: it has replayed all the WAL it can of what it received, and received
    /// nothing more for 500 ms (the last bytes through a link just held may still be on their
    /// way). "All it can": a link held at any byte may leave the last record half received, and
    /// replay stops before it for good (the received position is then never reached), so a
    /// replay position that stays where it is counts as done too.
    async fn replayed_all_received(&self) -> bool {
        #[derive(diesel::QueryableByName)]
        struct Lsns {
            #[diesel(sql_type = diesel::sql_types::Text)]
            received: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            replayed: String,
        }
        let query = || {
            diesel::sql_query(
                "SELECT pg_last_wal_receive_lsn()::text AS received, pg_last_wal_replay_lsn()::text AS replayed",
            )
        };
        let mut conn = self.conn().await;
        let first: Lsns = query().get_result(&mut conn).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let then: Lsns = query().get_result(&mut conn).await.unwrap();
        first.received == then.received && (then.received == then.replayed || first.replayed == then.replayed)
    }

    async fn source(&self) -> String {
        actix_outbox::admin::outbox_source(&mut self.conn().await).await.expect("source")
    }

    /// Sessions holding the insert listener's armed lock (as `actors::armed_sessions` reads
    /// it).
    async fn armed_sessions(&self) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let n: N = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_locks l JOIN pg_database d ON d.oid = l.database
             WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted
               AND l.mode = 'ExclusiveLock' AND l.objsubid = 1
               AND (l.classid::int8 << 32 | l.objid::int8) = hashtextextended('actix-outbox:armed:public.outbox', 0)",
        )
        .get_result(&mut self.conn().await)
        .await
        .unwrap();
        n.n
    }
}

/// Every message received so far, by id, with how many copies arrived.
fn copies(
    rx: &mut UnboundedReceiver<Arc<OutboxMessage>>,
    seen: &mut BTreeMap<i64, usize>,
    sources: &mut BTreeSet<String>,
) {
    while let Ok(m) = rx.try_recv() {
        *seen.entry(m.id).or_default() += 1;
        sources.insert(m.source.to_string());
    }
}

/// The lines of `logs` that contain `what`.
fn lines<'a>(logs: &'a str, what: &str) -> Vec<&'a str> {
    logs.lines().filter(|l| l.contains(what)).collect()
}

/// 3,000 rows, the dispatcher on the multi-host URL, a failover (the primary stopped at once,
/// the standby promoted) once a third are done, then 100 rows committed on the new primary.
/// Every row ends done there, none dead; the source name is the same before and after (a
/// standby is a copy of its primary's cluster, system identifier included); rows committed
/// after the failover are delivered with an hour-long poll interval, so only the insert
/// listener, reconnected to the new primary, can explain it, and it arms there again. Returns
/// the copies the sink saw of each row, the rows on the new primary, the window in flight and
/// the logs.
async fn fail_over_mid_run(replication: Replication) -> (BTreeMap<i64, usize>, Vec<OutboxRow>, usize, String) {
    let captured = Captured::install();
    let mut pair = ReplicatedPair::start(replication).await;
    let name = pair.create_database().await;
    actix_outbox::migrate(&pair.primary_url(&name)).await.unwrap();
    let old = On(pair.primary_url(&name));
    let new = On(pair.standby_url(&name));
    let (primary_port, standby_port) = (pair.primary_port(), pair.standby_port());
    let before = old.seed(3000, "before").await;
    // The seed is the producers' and went before the run: only the dispatcher's own writes
    // race the failover.
    pair.wait_caught_up().await;
    let source = old.source().await;

    let (sink, mut rx) = ChannelSink::new();
    // 2 workers × 40 rows in flight, 50 ms a publish: about 1,600 rows a second, so the
    // failover comes mid-run.
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(50)));
    let config = DispatcherConfig::default()
        .workers(2)
        .batch(20)
        .max_attempts(5)
        .lease(Duration::from_secs(5))
        .publish_timeout(Duration::from_secs(1))
        .poll_interval(Duration::from_secs(3600))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5));
    let window = config.workers * config.in_flight_limit();
    let pool = actix_outbox::connect_pool(&pair.multi_host_url(&name), 8).await.unwrap();
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    eventually(WITHIN, "a third done", || async { saw(old.count_status("done").await, |v| *v >= 1000) }).await;

    pair.fail_over().await;
    let health = dispatcher.send(GetHealth).await.unwrap();
    assert_eq!(health.source.as_deref(), Some(source.as_str()), "{health:?}");

    // Rows whose finalize the old primary took with it are leased on the new one: once their
    // leases run out, the listener's wake-up for the rows below claims them again.
    eventually(WITHIN, "the backlog drained on the new primary", || async {
        saw(new.count_status("pending").await, |v| *v == 0)
    })
    .await;
    eventually(WITHIN, "the listener armed on the new primary", || async {
        saw(new.armed_sessions().await, |v| *v == 1)
    })
    .await;
    eventually(WITHIN, "no lease left from before", || async { saw(new.live_leases().await, |v| *v == 0) }).await;
    let after = new.seed(100, "after").await;
    // The poll is an hour away: only the listener can wake a worker for these.
    eventually(WITHIN, "every row done on the new primary", || async {
        saw(new.count_status("done").await, |v| *v == 3100)
    })
    .await;
    eventually(WITHIN, "the listener armed again", || async { saw(new.armed_sessions().await, |v| *v == 1) }).await;

    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    let health = dispatcher.send(GetHealth).await.unwrap();
    dispatcher.send(Shutdown).await.unwrap();
    assert!(health.is_ready(), "{health:?}");
    assert_eq!(health.source.as_deref(), Some(source.as_str()), "the source name is unchanged: {health:?}");
    assert_eq!(new.source().await, source, "the new primary derives the same source name");
    assert_eq!((metrics.dead, metrics.reaped, metrics.in_flight), (0, 0, 0), "{metrics:?}");

    let mut seen = BTreeMap::new();
    let mut sources = BTreeSet::new();
    copies(&mut rx, &mut seen, &mut sources);
    assert_eq!(sources, BTreeSet::from([source.clone()]), "every message carries the one source name");
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), [before, after.clone()].concat(), "every row delivered");
    let rows = new.rows().await;
    assert!(rows.iter().all(|r| r.status == Status::Done), "every row done on the new primary");
    for id in &after {
        assert_eq!(seen[id], 1, "row {id}, committed after the failover, delivered once");
    }
    let logs = captured.text();
    // The logs name the server the listener reached, of the two the URL lists.
    let connected = lines(&logs, "insert listener connected");
    assert!(
        connected.len() == 1 && connected[0].contains(&format!("server=127.0.0.1:{primary_port}")),
        "{connected:?}"
    );
    let reconnected = lines(&logs, "insert listener reconnected");
    assert!(
        reconnected.last().is_some_and(|l| l.contains(&format!("server=127.0.0.1:{standby_port}"))),
        "the last reconnection reached the promoted standby: {reconnected:?}"
    );
    (seen, rows, window, logs)
}

/// Asynchronous replication (PostgreSQL's default): the primary's last commits may not have
/// reached the standby when it dies. A finalize so lost leaves its row leased on the new
/// primary: it is published again (same id) once the lease runs out, its attempt counted
/// again; a lost claim makes the publish's finalize find the row not leased, and the row goes
/// again. Both are rows that were in flight: the copies stay within the window, and only rows
/// that went twice have spent a second attempt.
#[test]
fn a_failover_mid_run_finishes_every_row_on_the_new_primary() {
    crate::alone::test_alone(
        "failover::a_failover_mid_run_finishes_every_row_on_the_new_primary",
        a_failover_mid_run_finishes_every_row_on_the_new_primary_alone,
    );
}

async fn a_failover_mid_run_finishes_every_row_on_the_new_primary_alone() {
    let (seen, rows, window, logs) = fail_over_mid_run(Replication::Asynchronous).await;
    let twice: BTreeSet<i64> = seen.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).collect();
    assert!(seen.values().all(|&n| n <= 2), "no row more than twice");
    assert!(twice.len() <= window, "{} rows went twice, more than the {window} in flight", twice.len());
    let second_attempt: BTreeSet<i64> = rows.iter().filter(|r| r.attempts != 1).map(|r| r.id).collect();
    assert!(rows.iter().all(|r| (1..=2).contains(&r.attempts)), "one attempt, or two for a row that went again");
    assert!(second_attempt.is_subset(&twice), "a second attempt only for a row published twice: {second_attempt:?}");
    let down = lines(&logs, "database unreachable");
    let back = lines(&logs, "database reachable again");
    assert_eq!((down.len(), back.len()), (1, 1), "one outage, logged once each way:\n{logs}");
    println!(
        "failover: {} rows published twice, {} with a second attempt\n{}\n{}",
        twice.len(),
        second_attempt.len(),
        down[0],
        back[0]
    );
}

/// Synchronous replication: every commit the primary acknowledged is on the standby, so the
/// failover loses no finalize and no claim whose answer arrived; the writes cut mid-way are
/// retried with their fences (or handed back) on the new primary. Nothing is published twice
/// and every row spends exactly one attempt.
#[test]
fn a_failover_under_synchronous_replication_publishes_nothing_twice() {
    crate::alone::test_alone(
        "failover::a_failover_under_synchronous_replication_publishes_nothing_twice",
        a_failover_under_synchronous_replication_publishes_nothing_twice_alone,
    );
}

async fn a_failover_under_synchronous_replication_publishes_nothing_twice_alone() {
    let (seen, rows, _, logs) = fail_over_mid_run(Replication::Synchronous).await;
    let twice: Vec<i64> = seen.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).collect();
    assert_eq!(twice, Vec::<i64>::new(), "nothing published twice");
    let attempts: BTreeSet<i32> = rows.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, BTreeSet::from([1]), "one attempt each");
    let down = lines(&logs, "database unreachable");
    let back = lines(&logs, "database reachable again");
    assert_eq!((down.len(), back.len()), (1, 1), "one outage, logged once each way:\n{logs}");
    println!("failover (synchronous):\n{}\n{}", down[0], back[0]);
}

/// A URL that reaches only a standby: every write fails read-only (SQLSTATE 25006). The
/// dispatcher spends no attempt and sends nothing dead (the rows stay as they were, on both
/// servers), calls the sink for nothing, reports not ready with a reason that names the
/// standby and the fix, logs it once (not once per claim), and starts working once that
/// standby is promoted.
#[test]
fn a_standby_alone_spends_no_attempt_and_is_reported_read_only() {
    crate::alone::test_alone(
        "failover::a_standby_alone_spends_no_attempt_and_is_reported_read_only",
        a_standby_alone_spends_no_attempt_and_is_reported_read_only_alone,
    );
}

async fn a_standby_alone_spends_no_attempt_and_is_reported_read_only_alone() {
    let captured = Captured::install();
    let mut pair = ReplicatedPair::start(Replication::Asynchronous).await;
    let name = pair.create_database().await;
    actix_outbox::migrate(&pair.primary_url(&name)).await.unwrap();
    let primary = On(pair.primary_url(&name));
    let standby = On(pair.standby_url(&name));
    let ids = primary.seed(50, "standby").await;
    pair.wait_caught_up().await;
    let untouched = primary.rows().await;
    assert!(untouched.iter().all(|r| r.status == Status::Pending && r.attempts == 0));

    let calls = Arc::new(AtomicUsize::new(0));
    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script({
        let calls = calls.clone();
        move |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            SinkAction::Deliver
        }
    });
    let config = DispatcherConfig::default()
        .workers(2)
        .batch(20)
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5));
    let pool = actix_outbox::connect_pool(&pair.standby_url(&name), 8).await.unwrap();
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    eventually(WITHIN, "not ready", || async {
        saw(dispatcher.send(GetHealth).await.unwrap(), |h| !h.database_reachable)
    })
    .await;
    // Long enough for each worker's claim to try six times or so (backing off to 1 s apart):
    // a few seconds, in which a poll every 50 ms would have claimed some sixty times.
    eventually(WITHIN, "claims tried again and again", || async {
        saw(dispatcher.send(GetMetrics).await.unwrap().claim_errors, |v| *v >= 12)
    })
    .await;

    let health = dispatcher.send(GetHealth).await.unwrap();
    assert!(!health.is_ready(), "{health:?}");
    let reason = health.not_ready_reason().expect("a reason");
    assert!(reason.contains("read-only"), "{reason}");
    assert!(reason.contains("standby"), "{reason}");
    assert!(reason.contains("target_session_attrs=read-write"), "the fix is named: {reason}");
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.claimed, metrics.done, metrics.dead, metrics.retried), (0, 0, 0, 0), "{metrics:?}");
    assert_eq!(AtomicUsize::load(&calls, Ordering::Relaxed), 0, "the sink was called for nothing");
    assert_eq!(standby.rows().await, untouched, "nothing changed on the standby");
    assert_eq!(primary.rows().await, untouched, "nothing changed on the primary");
    let logs = captured.text();
    let read_only = lines(&logs, "read-only");
    assert_eq!(read_only.len(), 1, "logged once, not per claim:\n{logs}");
    assert!(read_only[0].contains(" WARN "), "{}", read_only[0]);

    pair.promote().await;
    eventually(WITHIN, "every row done on the promoted standby", || async {
        saw(standby.count_status("done").await, |v| *v == 50)
    })
    .await;
    let health = dispatcher.send(GetHealth).await.unwrap();
    dispatcher.send(Shutdown).await.unwrap();
    assert!(health.is_ready(), "{health:?}");
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen, &mut BTreeSet::new());
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), ids, "every row delivered");
    assert!(seen.values().all(|&n| n == 1), "each once");
    let attempts: BTreeSet<i32> = standby.rows().await.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, BTreeSet::from([1]), "the read-only spell cost no attempt");
    let logs = captured.text();
    assert_eq!(lines(&logs, "database reachable again").len(), 1, "{logs}");
}

/// The advisory-lock key the test's session on the standby holds to keep the table sample
/// waiting (see [`HOLD_SAMPLES_SQL`]).
const SAMPLE_HOLD_KEY: i64 = 47_474_747;

/// Makes the dispatcher's table sample wait for [`SAMPLE_HOLD_KEY`]: the sample's statement
/// calls `pg_stat_get_live_tuples` on a `regclass`, and a function of that name taking a
/// `regclass` exactly is chosen over the catalog's (which takes an `oid`). It waits for the key
/// (in the sample's transaction, which a standby allows) and then answers as the catalog's does.
const HOLD_SAMPLES_SQL: &str = "
CREATE FUNCTION public.pg_stat_get_live_tuples(regclass) RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(47474747);
    SELECT pg_catalog.pg_stat_get_live_tuples($1::oid)
$$";

impl On {
    /// Sessions waiting for [`SAMPLE_HOLD_KEY`].
    async fn waiting_for_the_hold(&self) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let n: N = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1
               AND (classid::int8 << 32 | objid::int8) = $1",
        )
        .bind::<diesel::sql_types::BigInt, _>(SAMPLE_HOLD_KEY)
        .get_result(&mut self.conn().await)
        .await
        .unwrap();
        n.n
    }
}

/// `outbox_rows{status="pending"}` in a snapshot of `recorder`, when the dispatcher has set it
/// since the last snapshot (a snapshot reads gauges back to 0).
fn pending_gauge(recorder: &DebuggingRecorder) -> Option<f64> {
    recorder.snapshotter().snapshot().into_vec().into_iter().find_map(|(key, _, _, value)| {
        let key = key.key();
        let pending =
            key.name() == "outbox_rows" && key.labels().any(|l| l.key() == "status" && l.value() == "pending");
        match value {
            DebugValue::Gauge(v) if pending && v.into_inner() != 0.0 => Some(v.into_inner()),
            _ => None,
        }
    })
}

/// A standby alone goes down once and comes up once, though reads answer in between. The
/// dispatcher's first table sample starts before any claim has failed and is held on the
/// standby (see [`HOLD_SAMPLES_SQL`]) while the claims are refused as read-only; then it
/// answers. A read that answers proves the server up, not writable: the state stays read-only
/// (one warning, no `database reachable again`, `GetHealth` read-only) until the promotion, after
/// which it is reachable once. Before the fix the sample's answer logged `database reachable
/// again`, reported the standby ready, and the next claim logged the read-only warning again.
#[test]
fn a_standby_alone_is_down_once_and_up_once_though_its_reads_answer() {
    crate::alone::test_alone(
        "failover::a_standby_alone_is_down_once_and_up_once_though_its_reads_answer",
        a_standby_alone_is_down_once_and_up_once_though_its_reads_answer_alone,
    );
}

async fn a_standby_alone_is_down_once_and_up_once_though_its_reads_answer_alone() {
    let captured = Captured::install();
    // The sampler reports on this thread (the supervisor's), so a thread-local recorder sees it.
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let mut pair = ReplicatedPair::start(Replication::Asynchronous).await;
    let name = pair.create_database().await;
    actix_outbox::migrate(&pair.primary_url(&name)).await.unwrap();
    let primary = On(pair.primary_url(&name));
    let standby = On(pair.standby_url(&name));
    let ids = primary.seed(50, "flap").await;
    primary.conn().await.batch_execute(HOLD_SAMPLES_SQL).await.unwrap();
    pair.wait_caught_up().await;
    let mut hold = standby.conn().await;
    let lock = |sql: &'static str| diesel::sql_query(sql).bind::<diesel::sql_types::BigInt, _>(SAMPLE_HOLD_KEY);
    lock("SELECT pg_advisory_lock($1)").execute(&mut hold).await.unwrap();

    let (sink, mut rx) = ChannelSink::new();
    let config = DispatcherConfig::default()
        .workers(2)
        .batch(20)
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5));
    let pool = actix_outbox::connect_pool(&pair.standby_url(&name), 8).await.unwrap();
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    let health = async || dispatcher.send(GetHealth).await.unwrap();
    let claim_errors = async || dispatcher.send(GetMetrics).await.unwrap().claim_errors;
    eventually(WITHIN, "the first table sample held on the standby", || async {
        saw(standby.waiting_for_the_hold().await, |v| *v == 1)
    })
    .await;
    eventually(WITHIN, "both workers' claims refused twice", || async { saw(claim_errors().await, |v| *v >= 4) }).await;
    let down = health().await;
    assert!(!down.database_reachable && down.database_read_only, "{down:?}");

    lock("SELECT pg_advisory_unlock($1)").execute(&mut hold).await.unwrap();
    let mut sampled = None;
    eventually(WITHIN, "the held sample reported", || {
        sampled = sampled.or_else(|| pending_gauge(&recorder));
        std::future::ready(saw(sampled, |s| s.is_some()))
    })
    .await;
    assert_eq!(sampled, Some(50.0), "the sample read the standby's 50 pending rows");
    // Claims after the sample's answer: before the fix, the one that found the state reachable
    // logged the read-only warning a second time.
    let after = claim_errors().await;
    eventually(WITHIN, "two more claims refused", || async { saw(claim_errors().await, |v| *v >= after + 2) }).await;
    let still = health().await;
    assert!(!still.database_reachable && still.database_read_only, "a read answered, the writes still fail: {still:?}");
    let logs = captured.text();
    assert_eq!(lines(&logs, "database is read-only").len(), 1, "down once:\n{logs}");
    assert_eq!(lines(&logs, "database reachable again").len(), 0, "not up while read-only:\n{logs}");

    pair.promote().await;
    eventually(WITHIN, "every row done on the promoted standby", || async {
        saw(standby.count_status("done").await, |v| *v == 50)
    })
    .await;
    let up = health().await;
    dispatcher.send(Shutdown).await.unwrap();
    assert!(up.is_ready(), "{up:?}");
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen, &mut BTreeSet::new());
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), ids, "every row delivered");
    assert!(seen.values().all(|&n| n == 1), "each once: {seen:?}");
    let logs = captured.text();
    assert_eq!(lines(&logs, "database is read-only").len(), 1, "down once:\n{logs}");
    assert_eq!(lines(&logs, "database reachable again").len(), 1, "up once:\n{logs}");
}

/// What asynchronous replication does not save, measured: the standby falls behind (its link
/// held) while a producer commits 100 rows and the dispatcher publishes and finalizes the whole
/// backlog on the primary; then the primary dies. On the new primary the 100 rows are gone,
/// though their messages went out (the dispatcher cannot take them back); every row the
/// standby had not seen finalized is published a second time, with its id; and the
/// sequence, which the standby knew only as far as it had been WAL-logged (32 values ahead),
/// gives the lost rows' ids again to rows committed after the failover: the same source, the
/// same id, another message.
#[actix_rt::test]
async fn a_failover_behind_a_lagging_standby_loses_the_lag_and_reuses_its_ids() {
    let mut pair = ReplicatedPair::start(Replication::Asynchronous).await;
    let name = pair.create_database().await;
    actix_outbox::migrate(&pair.primary_url(&name)).await.unwrap();
    let old = On(pair.primary_url(&name));
    let new = On(pair.standby_url(&name));
    let before = old.seed(3000, "before").await;
    pair.wait_caught_up().await;

    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(50)));
    let config = DispatcherConfig::default()
        .workers(2)
        .batch(20)
        .lease(Duration::from_secs(5))
        .publish_timeout(Duration::from_secs(1))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5));
    let pool = actix_outbox::connect_pool(&pair.multi_host_url(&name), 8).await.unwrap();
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    eventually(WITHIN, "a third done", || async { saw(old.count_status("done").await, |v| *v >= 1000) }).await;

    pair.hold_replication();
    // What the standby has (and the new primary will start from), once it has replayed all
    // it received.
    eventually(WITHIN, "the standby replayed what it received", || async {
        saw(new.replayed_all_received().await, |&done| done)
    })
    .await;
    let done_on_standby: BTreeSet<i64> =
        new.rows().await.iter().filter(|r| r.status == Status::Done).map(|r| r.id).collect();
    let lost = old.seed(100, "lost").await;
    eventually(WITHIN, "everything done on the old primary", || async {
        saw(old.count_status("done").await, |v| *v == 3100)
    })
    .await;
    pair.fail_over().await;

    let after = new.seed(100, "after").await;
    eventually(WITHIN, "every row done on the new primary", || async {
        let counts = (new.count_status("done").await, new.count_status("processing").await);
        saw(counts, |&(done, processing)| done == 3100 && processing == 0)
    })
    .await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.dead, metrics.reaped), (0, 0), "{metrics:?}");

    let mut by_id: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    let mut sources = BTreeSet::new();
    while let Ok(m) = rx.try_recv() {
        by_id.entry(m.id).or_default().push(m.aggregate_id.clone());
        sources.insert(m.source.to_string());
    }
    assert_eq!(sources.len(), 1, "one source name before and after: {sources:?}");
    let rows = new.rows().await;
    assert!(rows.iter().all(|r| r.aggregate_id != "lost"), "the rows committed during the lag are gone");
    let copies = |id: &i64, agg: &str| by_id.get(id).map_or(0, |aggs| aggs.iter().filter(|a| *a == agg).count());
    assert!(lost.iter().all(|id| copies(id, "lost") == 1), "yet their messages went out, once each");
    let lost_finalizes: BTreeSet<i64> = before.iter().copied().filter(|id| !done_on_standby.contains(id)).collect();
    let twice: BTreeSet<i64> = before.iter().copied().filter(|id| copies(id, "before") == 2).collect();
    assert!(before.iter().all(|id| (1..=2).contains(&copies(id, "before"))), "each row once or twice");
    assert_eq!(twice, lost_finalizes, "published again: exactly the rows whose finalize the standby never saw");
    assert!(after.iter().all(|id| copies(id, "after") == 1), "rows after the failover once each");
    let reused: Vec<i64> = after.iter().copied().filter(|id| lost.contains(id)).collect();
    assert!(!reused.is_empty(), "the lost rows' ids are given again: {after:?} / {lost:?}");
    println!(
        "lagging standby: {} finalizes lost (published twice), {} rows lost (published once), {} of their ids reused after the failover",
        lost_finalizes.len(),
        lost.len(),
        reused.len()
    );
}
