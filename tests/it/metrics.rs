//! What the dispatcher emits through the `metrics` facade, read back with the debugging
//! recorder of `metrics-util` installed as this thread's recorder: an `#[actix_rt::test]` runs
//! the dispatcher's actors on the test's own thread, so tests running in parallel each see their
//! own series only.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_outbox::dispatcher::{GetHealth, GetMetrics, Shutdown};
use actix_outbox::sink::{ChannelSink, SinkAction, SinkState};
use actix_outbox::{DispatcherConfig, Fifo, NewEvent, OutboxSupervisor, PublishError};
use diesel_async::SimpleAsyncConnection;
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use actix_outbox_test_support::{PATIENCE, TestDb, eventually, saw};

const WITHIN: Duration = PATIENCE;

/// One snapshot of the recorder, by `name{label=value,...}` (labels sorted). Taking it resets
/// the recorder's values, so a test takes one, at the end.
#[derive(Debug)]
struct Seen {
    counters: HashMap<String, u64>,
    gauges: HashMap<String, f64>,
    histograms: HashMap<String, Vec<f64>>,
    /// Names of the series the recorder has no description of.
    undescribed: HashSet<String>,
}

impl Seen {
    fn take(recorder: &DebuggingRecorder) -> Seen {
        let mut seen = Seen {
            counters: HashMap::new(),
            gauges: HashMap::new(),
            histograms: HashMap::new(),
            undescribed: HashSet::new(),
        };
        for (key, _, description, value) in recorder.snapshotter().snapshot().into_vec() {
            let (kind, key) = key.into_parts();
            if description.is_none() {
                seen.undescribed.insert(key.name().to_owned());
            }
            let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            labels.sort();
            let name = if labels.is_empty() {
                key.name().to_owned()
            } else {
                format!("{}{{{}}}", key.name(), labels.join(","))
            };
            match (kind, value) {
                (MetricKind::Counter, DebugValue::Counter(n)) => {
                    seen.counters.insert(name, n);
                }
                (MetricKind::Gauge, DebugValue::Gauge(v)) => {
                    seen.gauges.insert(name, v.into_inner());
                }
                (MetricKind::Histogram, DebugValue::Histogram(vs)) => {
                    seen.histograms.insert(name, vs.into_iter().map(|v| v.into_inner()).collect());
                }
                other => panic!("{name}: unexpected {other:?}"),
            }
        }
        seen
    }

    /// Adds a later snapshot to this one. A snapshot resets what it read: counters add up;
    /// a gauge takes the later value unless that is 0, which may only mean "not set since"
    /// (the value set last before the later snapshot, that is, when it changes only away from
    /// 0 or stays at it once there); histograms gather every observation.
    fn merge(&mut self, later: Seen) {
        for (name, n) in later.counters {
            *self.counters.entry(name).or_default() += n;
        }
        for (name, v) in later.gauges {
            if v != 0.0 || !self.gauges.contains_key(&name) {
                self.gauges.insert(name, v);
            }
        }
        for (name, vs) in later.histograms {
            self.histograms.entry(name).or_default().extend(vs);
        }
        self.undescribed.extend(later.undescribed);
    }

    /// Snapshots of `recorder`, merged, until `done` holds of them (up to [`WITHIN`]).
    async fn until(recorder: &DebuggingRecorder, what: &str, done: impl Fn(&Seen) -> bool) -> Seen {
        let mut seen = Seen::take(recorder);
        eventually(WITHIN, what, || {
            seen.merge(Seen::take(recorder));
            std::future::ready(saw(&seen.gauges, |_| done(&seen)))
        })
        .await;
        seen
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }

    fn gauge(&self, name: &str) -> f64 {
        *self.gauges.get(name).unwrap_or_else(|| panic!("no gauge {name}: {:?}", self.gauges))
    }

    fn observations(&self, name: &str) -> usize {
        self.histograms.get(name).map_or(0, Vec::len)
    }
}

async fn sum_attempts(db: &TestDb) -> i64 {
    db.rows().await.iter().map(|r| i64::from(r.attempts)).sum()
}

/// Every counter, with every label set, is exported from the start at 0, before anything
/// happened: an alert on `increase(outbox_lost_leases_total[5m])` must see the first one.
#[actix_rt::test]
async fn every_counter_is_exported_at_zero_from_the_start() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let db = TestDb::new().await;
    let (sink, _rx) = ChannelSink::new();
    let config = DispatcherConfig::default().workers(1).listen_for_inserts(false);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "the dispatcher answers", || async {
        saw(dispatcher.send(GetMetrics).await.map(|_| ()), |answer| answer.is_ok())
    })
    .await;
    let seen = Seen::take(&recorder);
    dispatcher.send(Shutdown).await.unwrap();

    let mut counters: Vec<(&str, u64)> = seen.counters.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    counters.sort();
    let expected = [
        "outbox_actor_restarts_total",
        "outbox_claim_errors_total",
        "outbox_claimed_total",
        "outbox_claims_total",
        "outbox_finalize_errors_total",
        "outbox_finalize_retries_total",
        "outbox_finalized_total{outcome=dead}",
        "outbox_finalized_total{outcome=deferred}",
        "outbox_finalized_total{outcome=done}",
        "outbox_finalized_total{outcome=released}",
        "outbox_finalized_total{outcome=retried}",
        "outbox_finalizes_total",
        "outbox_leases_expired_total",
        "outbox_lost_leases_total",
        "outbox_pruned_total",
        "outbox_publish_crashes_total",
        "outbox_publish_refused_total",
        "outbox_published_total",
        "outbox_reaped_total",
        "outbox_sink_outages_total",
        "outbox_strays_total",
        "outbox_table_sample_errors_total",
    ];
    assert_eq!(counters, expected.map(|name| (name, 0)), "every counter, at 0");
    for gauge in ["outbox_in_flight", "outbox_in_flight_bytes", "outbox_rows{status=dead}", "outbox_expired_leases"] {
        assert_eq!(seen.gauge(gauge), 0.0, "{gauge}");
    }
}

/// 40 rows through a scripted sink: per ten rows, one permanent failure (dead), one retryable
/// failure then a delivery (retried, done), one that always fails retryably (retried twice,
/// dead at the third attempt), one deferral then a delivery (deferred, done), six deliveries.
/// Every counter equals what the table (and the script) says; the in-process snapshot agrees;
/// the gauges and histograms match.
#[actix_rt::test]
async fn counters_gauges_and_histograms_match_the_table() {
    const ROWS: usize = 40;
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);

    let db = TestDb::new().await;
    let ids = db.seed(ROWS, "agg").await;
    let role: HashMap<i64, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i % 10)).collect();
    let deferred_once = Arc::new(Mutex::new(HashSet::new()));
    let (defers, deliveries) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (sink, _rx) = ChannelSink::new();
    let sink = {
        let (defers, deliveries, deferred_once) = (defers.clone(), deliveries.clone(), deferred_once.clone());
        sink.with_script(move |m| {
            let action = match role[&m.id] {
                1 => SinkAction::Fail(PublishError::Permanent("rejected".into())),
                2 if m.attempts == 1 => SinkAction::Fail(PublishError::Retryable("flaky".into())),
                3 => SinkAction::Fail(PublishError::Retryable("always".into())),
                4 if deferred_once.lock().unwrap().insert(m.id) => {
                    defers.fetch_add(1, Ordering::Relaxed);
                    SinkAction::Fail(PublishError::Defer { delay: Duration::ZERO, reason: "later".into() })
                }
                _ => SinkAction::Deliver,
            };
            if action == SinkAction::Deliver {
                deliveries.fetch_add(1, Ordering::Relaxed);
            }
            action
        })
    };
    let config = DispatcherConfig::default()
        .workers(2)
        .batch(5)
        .max_attempts(3)
        .poll_interval(Duration::from_millis(20))
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(5))
        .table_metrics_interval(Some(Duration::from_millis(50)));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "every row final", || async {
        saw(db.count_status("done").await + db.count_status("dead").await, |v| *v == ROWS as i64)
    })
    .await;
    // The last publishes reported (the in-flight gauges move with these counters), then a
    // table sample that saw every row final.
    eventually(WITHIN, "nothing in flight", || async {
        saw(dispatcher.send(GetMetrics).await.unwrap(), |m| m.in_flight == 0 && m.done + m.dead == ROWS as u64)
    })
    .await;
    let seen = Seen::take(&recorder);
    // A recorder of its own from now on for the table's gauges: one sample sets them all at
    // once, so the first snapshot that holds them holds one sample, taken after every row was
    // final (a snapshot resets what it read, and a gauge not set since reads 0).
    let later = DebuggingRecorder::new();
    let _later = metrics::set_default_local_recorder(&later);
    let mut sampled = None;
    eventually(WITHIN, "a table sample of every row final", || {
        let snapshot = Seen::take(&later);
        let rows = |status: &str| snapshot.gauges.get(&format!("outbox_rows{{status={status}}}")).copied();
        if rows("done").unwrap_or(0.0) + rows("dead").unwrap_or(0.0) == ROWS as f64 {
            sampled = Some(snapshot);
        }
        std::future::ready(saw(sampled.is_some(), |&found| found))
    })
    .await;
    let sampled = sampled.unwrap();
    let health = dispatcher.send(GetHealth).await.unwrap();
    dispatcher.send(Shutdown).await.unwrap();
    let snapshot = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!(seen.undescribed, HashSet::new(), "every series has its help text");
    assert!(seen.counters.len() + seen.gauges.len() + seen.histograms.len() >= 15, "{seen:?}");

    let (done, dead) = (db.count_status("done").await, db.count_status("dead").await);
    let attempts = sum_attempts(&db).await;
    let defers = defers.load(Ordering::Relaxed);
    assert_eq!((done, dead, defers), (32, 8, 4), "the script ran as planned");
    // A deferral refunds its attempt: every claim but those is counted in `attempts`.
    let claimed = attempts as u64 + defers;
    let retried = (attempts - ROWS as i64) as u64;
    assert_eq!(retried, 12);

    assert_eq!(seen.counter("outbox_claimed_total"), claimed);
    assert_eq!(seen.counter("outbox_published_total"), done as u64);
    assert_eq!(seen.counter("outbox_published_total"), deliveries.load(Ordering::Relaxed));
    assert_eq!(seen.counter("outbox_finalized_total{outcome=done}"), done as u64);
    assert_eq!(seen.counter("outbox_finalized_total{outcome=dead}"), dead as u64);
    assert_eq!(seen.counter("outbox_finalized_total{outcome=retried}"), retried);
    assert_eq!(seen.counter("outbox_finalized_total{outcome=deferred}"), defers);
    assert_eq!(seen.counter("outbox_finalized_total{outcome=released}"), 0);
    for quiet in [
        "outbox_reaped_total",
        "outbox_lost_leases_total",
        "outbox_publish_crashes_total",
        "outbox_actor_restarts_total",
        "outbox_claim_errors_total",
        "outbox_finalize_errors_total",
        "outbox_sink_outages_total",
        "outbox_table_sample_errors_total",
    ] {
        assert_eq!(seen.counter(quiet), 0, "{quiet}");
    }
    // The in-process counters say the same.
    assert_eq!(
        (snapshot.claimed, snapshot.published, snapshot.done, snapshot.dead, snapshot.retried, snapshot.deferred),
        (claimed, done as u64, done as u64, dead as u64, retried, defers)
    );
    assert_eq!((snapshot.in_flight, snapshot.in_flight_bytes), (0, 0));

    // Every sink answer was timed; every delivery's lag was recorded, and none is negative.
    assert_eq!(seen.observations("outbox_publish_seconds"), claimed as usize);
    assert_eq!(seen.observations("outbox_delivery_lag_seconds"), done as usize);
    let lags = &seen.histograms["outbox_delivery_lag_seconds"];
    assert!(lags.iter().all(|&s| (0.0..30.0).contains(&s)), "{lags:?}");

    assert_eq!(seen.gauge("outbox_in_flight"), 0.0);
    assert_eq!(seen.gauge("outbox_in_flight_bytes"), 0.0);
    // Alone in its actix system, the dispatcher keeps both workers' windows (2 × 2 × 5).
    assert_eq!(seen.gauge("outbox_in_flight_limit"), 20.0);
    assert_eq!(seen.gauge("outbox_sink_up"), 1.0);
    assert_eq!(seen.gauge("outbox_claiming_paused"), 0.0);
    assert_eq!(sampled.gauge("outbox_rows{status=done}"), done as f64);
    assert_eq!(sampled.gauge("outbox_rows{status=dead}"), dead as f64);
    assert_eq!(sampled.gauge("outbox_rows{status=pending}"), 0.0);
    assert_eq!(sampled.gauge("outbox_rows{status=processing}"), 0.0);
    assert_eq!(sampled.gauge("outbox_oldest_unfinished_age_seconds"), 0.0);
    assert_eq!(sampled.gauge("outbox_expired_leases"), 0.0);
    let mut gauge_names = sampled.gauges.keys().chain(seen.gauges.keys());
    assert!(!gauge_names.any(|k| k == "outbox_blocked_aggregates"), "sampled under FIFO only");
    for name in seen.counters.keys().chain(seen.gauges.keys()).chain(seen.histograms.keys()) {
        assert!(!name.contains("owner") && !name.contains("worker"), "no process-specific label: {name}");
    }

    assert_eq!(health.sink, SinkState::Up);
    assert!(health.is_ready() && health.database_reachable && !health.claiming_paused, "{health:?}");
}

/// The sampled gauges follow the table: an expired lease, an old pending row backing off, a
/// scheduled row (counted apart, not in the age) and, under FIFO, an aggregate blocked by its
/// dead head. Sampling off: none of them is emitted.
#[actix_rt::test]
async fn the_table_sample_reports_ages_expired_leases_and_blocked_aggregates() {
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for (agg, event) in [("A", "a.1"), ("A", "a.2"), ("B", "b.1"), ("C", "c.1")] {
        actix_outbox::enqueue(&mut conn, &NewEvent::new("order", agg, event, serde_json::json!({}))).await.unwrap();
    }
    // A's head is dead (a dead row waits in `outbox_later`, never due, as the dispatcher leaves
    // it; A's second row, scheduled an hour ahead, waits behind it); B's row is processing with a
    // lease that ran out an hour ago; C's row is pending, created two minutes ago and backing off
    // for an hour after a failed attempt (so the dispatcher leaves it alone).
    conn.batch_execute(
        "UPDATE outbox SET status = 'dead', attempts = 3, available_at = '9999-12-31 00:00:00+00' WHERE event_type = 'a.1';
         UPDATE outbox SET available_at = now() + interval '1 hour' WHERE event_type IN ('a.2', 'c.1');
         UPDATE outbox SET attempts = 1, lease_version = 1 WHERE event_type = 'c.1';
         UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_owner = 'gone:1:worker-0',
                lease_until = now() - interval '1 hour', created_at = now() - interval '1 minute'
          WHERE event_type = 'b.1';
         UPDATE outbox SET created_at = now() - interval '2 minutes' WHERE event_type = 'c.1';",
    )
    .await
    .unwrap();
    let (sink, _rx) = ChannelSink::new();
    // A claim would reclaim B's row: the sink reports itself down from the start, so the sink
    // gate keeps every claim from running and the table stays as set up.
    let sink = sink.with_state(|| SinkState::Down("test".into()));
    let config = DispatcherConfig::default()
        .workers(1)
        .fifo(Fifo::All)
        .listen_for_inserts(false)
        .sink_probe_interval(Duration::from_secs(3600))
        .table_metrics_interval(Some(Duration::from_millis(50)));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    // The first sample builds the FIFO gate's index first: as long as the host needs.
    let seen = Seen::until(&recorder, "a table sample and the sink's state reported", |seen| {
        let gauge = |name: &str| seen.gauges.get(name).copied();
        gauge("outbox_rows{status=pending}").is_some()
            && gauge("outbox_blocked_aggregates").is_some()
            && gauge("outbox_claiming_paused") == Some(1.0)
    })
    .await;
    let health = dispatcher.send(GetHealth).await.unwrap();
    dispatcher.send(Shutdown).await.unwrap();

    assert_eq!(db.count_status("processing").await, 1, "nothing was claimed: {:?}", db.rows().await);
    assert_eq!(seen.gauge("outbox_rows{status=pending}"), 2.0);
    assert_eq!(seen.gauge("outbox_rows{status=processing}"), 1.0);
    assert_eq!(seen.gauge("outbox_rows{status=dead}"), 1.0);
    assert_eq!(seen.gauge("outbox_rows{status=done}"), 0.0);
    assert_eq!(seen.gauge("outbox_expired_leases"), 1.0);
    assert_eq!(seen.gauge("outbox_scheduled_rows"), 1.0, "A's second row, never claimed, due in an hour");
    let age = seen.gauge("outbox_oldest_unfinished_age_seconds");
    assert!((120.0..130.0).contains(&age), "the pending row created two minutes ago: {age}");
    assert_eq!(seen.gauge("outbox_blocked_aggregates"), 1.0);
    assert_eq!(seen.gauge("outbox_sink_up"), 0.0);
    assert_eq!(seen.gauge("outbox_claiming_paused"), 1.0);
    assert_eq!(seen.counter("outbox_sink_outages_total"), 1);
    assert_eq!(seen.counter("outbox_claimed_total"), 0);
    assert!(!health.is_ready(), "{health:?}");
    assert_eq!(health.not_ready_reason().as_deref(), Some("the sink is down: test"));

    // Sampling off: no sampled gauge at all.
    let recorder = DebuggingRecorder::new();
    let _local = metrics::set_default_local_recorder(&recorder);
    let (sink, _rx) = ChannelSink::new();
    let config = DispatcherConfig::default().workers(1).listen_for_inserts(false).table_metrics_interval(None);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    // A sample would come first thing; the sink's state after the supervisor's first check.
    let seen =
        Seen::until(&recorder, "the sink's state reported", |seen| seen.gauges.get("outbox_sink_up") == Some(&1.0))
            .await;
    dispatcher.send(Shutdown).await.unwrap();
    assert!(
        seen.gauges.keys().all(|k| !k.starts_with("outbox_rows") && !k.contains("expired") && !k.contains("scheduled")),
        "{:?}",
        seen.gauges
    );
    assert_eq!(seen.gauge("outbox_sink_up"), 1.0);
}
