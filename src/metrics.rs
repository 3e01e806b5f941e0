//! The dispatcher's metrics: counters kept in process ([`MetricsSnapshot`], through
//! [`GetMetrics`](crate::dispatcher::GetMetrics)) and the same, with gauges and histograms, emitted
//! through the facade of the `metrics` crate.
//!
//! The library only emits: without a recorder installed, the facade drops everything at the
//! cost of a branch. The application chooses the exporter (the `actix-outbox run` command
//! serves them in the Prometheus text format with `--metrics-addr`). No series carries a
//! process-specific label (host, pid, owner): the scraper adds its own `instance`. Two
//! dispatchers in one process add up in the counters and in the in-flight gauges, unless each
//! is named ([`DispatcherConfig::name`](crate::DispatcherConfig::name)): then every series of
//! each carries the label `outbox` with its name (`outbox="tenant_a.outbox"`), as `actix-outbox
//! run` names the outboxes when it relays several.
//!
//! | name | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `outbox_claimed_total` | counter | | rows leased by claims (a probe's row included) |
//! | `outbox_claims_total` | counter | | claim statements that ran, empty ones included (rows per claim: claimed ÷ claims) |
//! | `outbox_finalizes_total` | counter | | finalize statements that wrote outcomes (rows per finalize: finalized ÷ finalizes) |
//! | `outbox_published_total` | counter | | publishes the sink acknowledged |
//! | `outbox_finalized_total` | counter | `outcome`: `done`, `retried`, `deferred`, `released`, `dead` | rows whose fenced outcome was written: `done`; back to pending after a retryable failure (`retried`), a deferral (`deferred`) or an outage, attempt refunded (`released`); `dead` (retries exhausted, permanent failure, deferred too long) |
//! | `outbox_reaped_total` | counter | | rows the sweep's reaper sent dead (lease expired with no attempt left) |
//! | `outbox_leases_expired_total` | counter | | rows whose lease expired (a worker died or stalled), set by the sweep for a claim to take over |
//! | `outbox_strays_total` | counter | | pending rows the claims had passed while another statement held them locked, set by the sweep for a claim to take |
//! | `outbox_pruned_total` | counter | | `done` rows the pruner deleted once older than the retention |
//! | `outbox_lost_leases_total` | counter | | fenced writes that found the row taken over or already finalized (nothing written) |
//! | `outbox_publish_crashes_total` | counter | | publishes whose sink panicked; their rows wait for lease expiry |
//! | `outbox_actor_restarts_total` | counter | | claim or finalize actors the supervisor replaced after they died |
//! | `outbox_claim_errors_total` | counter | | claims that failed on the database |
//! | `outbox_finalize_errors_total` | counter | | finalize statements that failed after every retry (their rows wait for lease expiry) |
//! | `outbox_finalize_retries_total` | counter | | finalize statements retried after a transient database failure |
//! | `outbox_sink_outages_total` | counter | | times claiming paused because the sink became unavailable |
//! | `outbox_publish_refused_total` | counter | | publishes the sink refused for now (a broker's nack: a queue at its length limit with `overflow=reject-publish`); their rows went back to pending, attempt refunded, and claims slowed (see `outbox_pace_rate`) |
//! | `outbox_in_flight` | gauge | | rows claimed and not yet finalized |
//! | `outbox_in_flight_bytes` | gauge | | their payload bytes |
//! | `outbox_in_flight_limit` | gauge | | rows the dispatcher keeps in flight at most now: between one worker's `max_in_flight` and all the workers', found from the sink's answer times |
//! | `outbox_max_rate` | gauge | | the cap on messages a second, 0 when not paced |
//! | `outbox_pace_rate` | gauge | | the pace now: the cap, or less while the broker pushes back; without a cap, the pace a nacking broker holds the dispatcher to, 0 when not paced |
//! | `outbox_sink_up` | gauge | | 1 while the sink says it is up and the sink gate is open, else 0 |
//! | `outbox_claiming_paused` | gauge | | 1 while the sink gate holds claiming back (sink unavailable or being probed), else 0 |
//! | `outbox_publish_seconds` | histogram | | from the sink call to its answer (not a panic nor a publish timeout) |
//! | `outbox_delivery_lag_seconds` | histogram | | from the row's `created_at` (database clock) to the sink's acknowledgement (local clock; negative differences count as 0) |
//! | `outbox_rows` | gauge | `status`: `pending`, `processing`, `done`, `dead` | rows in the table per status (sampled) |
//! | `outbox_scheduled_rows` | gauge | | `pending` rows a producer scheduled for later (`NewEvent::not_before`) that are not due yet, part of `outbox_rows{status="pending"}` but not backlog (sampled) |
//! | `outbox_oldest_unfinished_age_seconds` | gauge | | how long the oldest `pending` or `processing` row that is due has been due, 0 when none; scheduled rows count from their scheduled time (sampled, database clock) |
//! | `outbox_expired_leases` | gauge | | `processing` rows whose lease ran out (sampled) |
//! | `outbox_blocked_aggregates` | gauge | | aggregates held back by a dead head, under the FIFO gate only (sampled) |
//! | `outbox_table_sample_errors_total` | counter | | table samples that failed on the database |
//! | `outbox_table_sample_age_seconds` | gauge | | how old the sampled gauges are: seconds since the last table sample that answered (it grows while the database does not answer; the sampled gauges are that old) |
//!
//! Each series is described (its `# HELP` line in Prometheus) to the recorder installed when a
//! supervisor starts; install the recorder first.
//!
//! The sampled gauges come from one statement the supervisor runs every
//! [`DispatcherConfig::table_metrics_interval`](crate::DispatcherConfig::table_metrics_interval)
//! (5 s by default; a second one under FIFO); every dispatcher samples the same table, so a
//! dashboard takes any one instance's value (`max`), not their sum.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use metrics::Label;
use serde::Serialize;

/// What the facade sees of one of the in-process counters.
#[derive(Debug)]
pub(crate) struct Series {
    value: AtomicU64,
    name: &'static str,
    /// Its own labels, then the dispatcher's (`outbox`, when it is named).
    labels: Vec<Label>,
    gauge: bool,
}

impl Series {
    fn counter(outbox: &[Label], name: &'static str, labels: &'static [(&'static str, &'static str)]) -> Self {
        let labels = labels.iter().map(Label::from).chain(outbox.iter().cloned()).collect();
        Self { value: AtomicU64::new(0), name, labels, gauge: false }
    }

    fn gauge(outbox: &[Label], name: &'static str) -> Self {
        Self { value: AtomicU64::new(0), name, labels: outbox.to_vec(), gauge: true }
    }
}

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident: $kind:ident($($key:expr),*)),* $(,)?) => {
        /// Live counters, shared by the dispatcher's actors.
        #[derive(Debug)]
        pub(crate) struct Metrics {
            $(pub(crate) $name: Series,)*
            /// The labels every series of the dispatcher carries: `outbox` when it is named.
            labels: Vec<Label>,
        }

        impl Metrics {
            /// The counters of a dispatcher, its series labelled `outbox = name` when it has one.
            pub(crate) fn new(name: Option<&str>) -> Self {
                let labels: Vec<Label> = name.map(|name| Label::new("outbox", name.to_owned())).into_iter().collect();
                Self { $($name: Series::$kind(&labels, $($key),*),)* labels }
            }
        }

        /// A copy of the dispatcher's counters since it started (and of its gauges now).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
        #[non_exhaustive]
        pub struct MetricsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Metrics {
            pub(crate) fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot { $($name: self.$name.value.load(Relaxed),)* }
            }

            /// Every series, for registering them all at start.
            fn series(&self) -> impl Iterator<Item = &Series> {
                [$(&self.$name,)*].into_iter()
            }
        }
    };
}

counters! {
    /// Rows leased by claims.
    claimed: counter("outbox_claimed_total", &[]),
    /// Claim statements that ran (those that found nothing included): `claimed / claims` is the
    /// rows a claim takes, which the insert listener's lingering raises while rows trickle in.
    claims: counter("outbox_claims_total", &[]),
    /// Finalize statements that wrote outcomes (one per outcome kind a flush carries):
    /// `finalized / finalizes` is the rows a statement writes, which the finalizer's gathering
    /// of a claim's rows raises in steady traffic.
    finalizes: counter("outbox_finalizes_total", &[]),
    /// Publishes the sink acknowledged.
    published: counter("outbox_published_total", &[]),
    /// Rows finalized `done`.
    done: counter("outbox_finalized_total", &[("outcome", "done")]),
    /// Rows put back to pending after a retryable failure.
    retried: counter("outbox_finalized_total", &[("outcome", "retried")]),
    /// Rows put back to pending by a deferral.
    deferred: counter("outbox_finalized_total", &[("outcome", "deferred")]),
    /// Rows put back to pending, attempt refunded, because the sink was unavailable (an
    /// outage costs no attempt).
    released: counter("outbox_finalized_total", &[("outcome", "released")]),
    /// Rows finalized `dead` (retries exhausted, permanent failure, or deferred too long).
    dead: counter("outbox_finalized_total", &[("outcome", "dead")]),
    /// Rows the sweep's reaper sent dead (lease expired with no attempt left).
    reaped: counter("outbox_reaped_total", &[]),
    /// Rows whose lease expired, set by the sweep for a claim to take over.
    expired: counter("outbox_leases_expired_total", &[]),
    /// Pending rows the claims had passed (held locked at the time by a claim that then
    /// failed, or by another statement), set by the sweep for a claim to take.
    strays: counter("outbox_strays_total", &[]),
    /// `done` rows the pruner deleted once older than the retention.
    pruned: counter("outbox_pruned_total", &[]),
    /// Fenced writes that found the row taken over (or already finalized).
    lost_leases: counter("outbox_lost_leases_total", &[]),
    /// Publishes that panicked; their rows wait for lease expiry.
    publish_crashes: counter("outbox_publish_crashes_total", &[]),
    /// Actors the supervisor restarted after they died.
    restarts: counter("outbox_actor_restarts_total", &[]),
    /// Claims that failed on the database.
    claim_errors: counter("outbox_claim_errors_total", &[]),
    /// Finalize flushes that failed on the database after every retry.
    finalize_errors: counter("outbox_finalize_errors_total", &[]),
    /// Finalize statements retried after a transient database failure.
    finalize_retries: counter("outbox_finalize_retries_total", &[]),
    /// Times claiming paused because the sink became unavailable.
    sink_outages: counter("outbox_sink_outages_total", &[]),
    /// Publishes the sink refused for now (a broker's nack); their rows went back to pending,
    /// attempt refunded.
    refused: counter("outbox_publish_refused_total", &[]),
    /// Payload bytes held claimed right now (a gauge: it goes down as publishes finish).
    in_flight_bytes: gauge("outbox_in_flight_bytes"),
    /// Rows held claimed right now, not yet finalized (a gauge).
    in_flight: gauge("outbox_in_flight"),
}

impl Metrics {
    /// Adds `n` to a counter, or raises a gauge by `n`.
    pub(crate) fn add(series: &Series, n: usize) {
        series.value.fetch_add(n as u64, Relaxed);
        if series.gauge {
            metrics::gauge!(series.name, series.labels.iter()).increment(n as f64);
        } else {
            metrics::counter!(series.name, series.labels.iter()).increment(n as u64);
        }
    }

    /// A counter's or gauge's value now.
    pub(crate) fn value(series: &Series) -> u64 {
        series.value.load(Relaxed)
    }

    /// Lowers a gauge.
    pub(crate) fn sub(gauge: &Series, n: usize) {
        debug_assert!(gauge.gauge, "{} is a counter", gauge.name);
        gauge.value.fetch_sub(n as u64, Relaxed);
        metrics::gauge!(gauge.name, gauge.labels.iter()).decrement(n as f64);
    }

    /// The dispatcher's labels with `extra` before them.
    fn labelled(&self, extra: &[(&'static str, &'static str)]) -> Vec<Label> {
        extra.iter().map(Label::from).chain(self.labels.iter().cloned()).collect()
    }

    /// Describes every series to the recorder installed now (nothing without one), and
    /// registers every counter and gauge with every label set it can have (the sampled ones
    /// when `sampled`), at its current value, so that an exporter shows them from the start: an
    /// `increase()` or `rate()` over a series that appears only at its first increment misses
    /// that increment.
    pub(crate) fn describe(&self, sampled: bool) {
        for &(name, kind, help) in HELP {
            match kind {
                MetricKind::Counter => metrics::describe_counter!(name, help),
                MetricKind::Gauge => metrics::describe_gauge!(name, help),
                MetricKind::Histogram => metrics::describe_histogram!(name, help),
            }
        }
        for series in self.series() {
            if series.gauge {
                metrics::gauge!(series.name, series.labels.iter()).increment(0.0);
            } else {
                metrics::counter!(series.name, series.labels.iter()).increment(0);
            }
        }
        metrics::counter!(SAMPLE_ERRORS, self.labels.iter()).increment(0);
        self.sink_gauges(false, false);
        if !sampled {
            return;
        }
        // The sampled gauges read 0 until the first sample, a few seconds after start.
        for status in crate::admin::Status::ALL {
            metrics::gauge!("outbox_rows", self.labelled(&[("status", status.as_str())])).increment(0.0);
        }
        metrics::gauge!("outbox_oldest_unfinished_age_seconds", self.labels.iter()).increment(0.0);
        metrics::gauge!("outbox_expired_leases", self.labels.iter()).increment(0.0);
        metrics::gauge!("outbox_table_sample_age_seconds", self.labels.iter()).increment(0.0);
    }

    /// `outbox_publish_seconds`.
    pub(crate) fn publish_seconds(&self, seconds: f64) {
        metrics::histogram!("outbox_publish_seconds", self.labels.iter()).record(seconds);
    }

    /// `outbox_delivery_lag_seconds`, from the row's creation (database clock) to now.
    pub(crate) fn delivery_lag(&self, created_at: chrono::DateTime<chrono::Utc>) {
        let lag = (chrono::Utc::now() - created_at).to_std().unwrap_or_default();
        metrics::histogram!("outbox_delivery_lag_seconds", self.labels.iter()).record(lag.as_secs_f64());
    }

    /// `outbox_max_rate` and `outbox_pace_rate`.
    pub(crate) fn pace_gauges(&self, pace: &crate::dispatcher::PaceReport) {
        metrics::gauge!("outbox_max_rate", self.labels.iter()).set(pace.max_rate.unwrap_or(0.0));
        metrics::gauge!("outbox_pace_rate", self.labels.iter()).set(pace.rate.unwrap_or(0.0));
    }

    /// `outbox_in_flight_limit`.
    pub(crate) fn window_gauge(&self, limit: usize) {
        metrics::gauge!("outbox_in_flight_limit", self.labels.iter()).set(limit as f64);
    }

    /// `outbox_sink_up` and `outbox_claiming_paused`.
    pub(crate) fn sink_gauges(&self, sink_up: bool, claiming_paused: bool) {
        metrics::gauge!("outbox_sink_up", self.labels.iter()).set(f64::from(u8::from(sink_up)));
        metrics::gauge!("outbox_claiming_paused", self.labels.iter()).set(f64::from(u8::from(claiming_paused)));
    }

    /// The sampled gauges, from a table sample (and the blocked aggregates under FIFO).
    pub(crate) fn sampled(&self, sample: &crate::store::Sample, blocked: Option<i64>) {
        for (status, n) in sample.by_status() {
            metrics::gauge!("outbox_rows", self.labelled(&[("status", status.as_str())])).set(n as f64);
        }
        metrics::gauge!("outbox_scheduled_rows", self.labels.iter()).set(sample.scheduled as f64);
        metrics::gauge!("outbox_oldest_unfinished_age_seconds", self.labels.iter())
            .set(sample.oldest.unwrap_or(0.0).max(0.0));
        metrics::gauge!("outbox_expired_leases", self.labels.iter()).set(sample.expired as f64);
        self.sample_age(std::time::Duration::ZERO);
        if let Some(blocked) = blocked {
            metrics::gauge!("outbox_blocked_aggregates", self.labels.iter()).set(blocked as f64);
        }
    }

    /// `outbox_table_sample_age_seconds`.
    pub(crate) fn sample_age(&self, age: std::time::Duration) {
        metrics::gauge!("outbox_table_sample_age_seconds", self.labels.iter()).set(age.as_secs_f64());
    }

    /// `outbox_table_sample_errors_total`.
    pub(crate) fn sample_failed(&self) {
        metrics::counter!(SAMPLE_ERRORS, self.labels.iter()).increment(1);
    }
}

/// What each series means, given to the installed recorder when a supervisor starts (the
/// `# HELP` lines of a Prometheus exporter); the table above says the same with the labels.
const HELP: &[(&str, MetricKind, &str)] = &[
    ("outbox_claimed_total", MetricKind::Counter, "Rows leased by claims (a probe's row included)."),
    ("outbox_claims_total", MetricKind::Counter, "Claim statements that ran, empty ones included."),
    ("outbox_finalizes_total", MetricKind::Counter, "Finalize statements that wrote outcomes."),
    ("outbox_published_total", MetricKind::Counter, "Publishes the sink acknowledged."),
    (
        "outbox_finalized_total",
        MetricKind::Counter,
        "Rows whose fenced outcome was written, by outcome: done, retried, deferred, released (an outage, attempt \
         refunded), dead.",
    ),
    ("outbox_reaped_total", MetricKind::Counter, "Rows the reaper sent dead: lease expired with no attempt left."),
    (
        "outbox_leases_expired_total",
        MetricKind::Counter,
        "Rows whose lease expired (their holder died or stalled), set by the sweep for a claim to take over.",
    ),
    (
        "outbox_strays_total",
        MetricKind::Counter,
        "Pending rows the claims had passed while another statement held them locked, set for a claim to take.",
    ),
    ("outbox_pruned_total", MetricKind::Counter, "Done rows the pruner deleted once older than the retention."),
    (
        "outbox_lost_leases_total",
        MetricKind::Counter,
        "Fenced writes that found the row taken over or already finalized (nothing written).",
    ),
    (
        "outbox_publish_crashes_total",
        MetricKind::Counter,
        "Publishes whose sink panicked; their rows wait for lease expiry.",
    ),
    (
        "outbox_actor_restarts_total",
        MetricKind::Counter,
        "Claim or finalize actors the supervisor replaced after they died.",
    ),
    ("outbox_claim_errors_total", MetricKind::Counter, "Claims that failed on the database."),
    (
        "outbox_finalize_errors_total",
        MetricKind::Counter,
        "Finalize statements that failed after every retry; their rows wait for lease expiry.",
    ),
    (
        "outbox_finalize_retries_total",
        MetricKind::Counter,
        "Finalize statements retried after a transient database failure.",
    ),
    ("outbox_sink_outages_total", MetricKind::Counter, "Times claiming paused because the sink became unavailable."),
    (
        "outbox_publish_refused_total",
        MetricKind::Counter,
        "Publishes the sink refused for now (a broker's nack, as from a queue at its length limit with \
         reject-publish); their rows went back to pending, attempt refunded.",
    ),
    ("outbox_in_flight", MetricKind::Gauge, "Rows claimed and not yet finalized."),
    ("outbox_in_flight_bytes", MetricKind::Gauge, "Payload bytes of the rows claimed and not yet finalized."),
    (
        "outbox_in_flight_limit",
        MetricKind::Gauge,
        "Rows the dispatcher keeps in flight at most now, found from the sink's answer times.",
    ),
    ("outbox_sink_up", MetricKind::Gauge, "1 while the sink says it is up and the sink gate is open, else 0."),
    ("outbox_claiming_paused", MetricKind::Gauge, "1 while the sink gate holds claiming back, else 0."),
    ("outbox_max_rate", MetricKind::Gauge, "The cap on messages a second, 0 when not paced."),
    (
        "outbox_pace_rate",
        MetricKind::Gauge,
        "The pace now: the cap, or less while the broker pushes back; 0 when not paced.",
    ),
    ("outbox_publish_seconds", MetricKind::Histogram, "From the sink call to its answer."),
    (
        "outbox_delivery_lag_seconds",
        MetricKind::Histogram,
        "From the row's created_at (database clock) to the sink's acknowledgement.",
    ),
    ("outbox_rows", MetricKind::Gauge, "Rows in the outbox table per status (sampled)."),
    (
        "outbox_scheduled_rows",
        MetricKind::Gauge,
        "Pending rows scheduled for later and not yet due; part of the pending rows, not backlog (sampled).",
    ),
    (
        "outbox_oldest_unfinished_age_seconds",
        MetricKind::Gauge,
        "How long the oldest due pending or processing row has been due, 0 when none (sampled, database clock).",
    ),
    ("outbox_expired_leases", MetricKind::Gauge, "Processing rows whose lease ran out (sampled)."),
    (
        "outbox_blocked_aggregates",
        MetricKind::Gauge,
        "Aggregates held back by a dead head, under the FIFO gate only (sampled).",
    ),
    ("outbox_table_sample_errors_total", MetricKind::Counter, "Table samples that failed on the database."),
    (
        "outbox_table_sample_age_seconds",
        MetricKind::Gauge,
        "Seconds since the last table sample that answered: how old the sampled gauges are.",
    ),
];

/// The kind of a series, for [`HELP`].
#[derive(Debug, Clone, Copy)]
enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// `outbox_table_sample_errors_total`.
const SAMPLE_ERRORS: &str = "outbox_table_sample_errors_total";
