//! Dispatcher configuration: defaults in one place (documented on `DispatcherConfig::default`),
//! validated before anything starts.

use std::time::Duration;

/// Claim actors started by default.
const DEFAULT_WORKERS: usize = 4;
/// Rows one claim takes at most by default.
const DEFAULT_BATCH: usize = 200;
/// How long a claim owns its rows by default.
const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Claims a row gets before it goes dead, by default.
const DEFAULT_MAX_ATTEMPTS: i32 = 12;
/// Full-jitter backoff base by default.
const DEFAULT_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Full-jitter backoff cap by default.
const DEFAULT_BACKOFF_CAP: Duration = Duration::from_secs(300);
/// Bound on one publish by default; well under the lease.
const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a claim that came back short, by default.
const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
const DEFAULT_LINGER: Duration = Duration::from_millis(20);
/// Payload bytes a dispatcher holds claimed at once, by default (64 MiB).
const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 64 * 1024 * 1024;
/// Pause between two probes of an unavailable sink, by default.
const DEFAULT_SINK_PROBE_INTERVAL: Duration = Duration::from_millis(500);
/// How often the dispatcher samples the outbox table for its gauges, by default.
const DEFAULT_TABLE_METRICS_INTERVAL: Duration = Duration::from_secs(5);
const DEFAULT_SUMMARY_INTERVAL: Duration = Duration::from_secs(60);
/// Age (since `created_at`) past which a deferral sends the row dead, by default.
const DEFAULT_MAX_DEFER_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// How a dispatcher claims, publishes and finalizes.
///
/// Every field has a default ([`DispatcherConfig::default`]); set the ones you need with the
/// chained setters, and [`DispatcherConfig::validate`] runs when the supervisor starts.
///
/// ```
/// use std::time::Duration;
/// use actix_outbox::DispatcherConfig;
///
/// let config = DispatcherConfig::default()
///     .workers(2)
///     .batch(100)
///     .lease(Duration::from_secs(30))
///     .publish_timeout(Duration::from_secs(5));
/// config.validate().unwrap();
///
/// let broken = DispatcherConfig::default().lease(Duration::from_secs(5));
/// assert!(broken.validate().is_err(), "publish timeout (10 s) must be shorter than the lease");
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DispatcherConfig {
    /// Claim actors, each with its own owner id `<owner>:worker-<n>`. Default 4.
    pub workers: usize,
    /// Rows one claim takes at most. Default 200: each claim and each finalize flush costs a
    /// statement (planned afresh every run), so larger batches spend less database CPU per
    /// message. Smaller batches spread a
    /// short backlog over more workers and bound what one crashed worker leaves waiting for its
    /// lease.
    pub batch: usize,
    /// Rows one worker holds claimed at once (publishing or finalizing). The worker claims the
    /// next batch while the previous one publishes, up to this bound. Default `2 × batch`.
    ///
    /// A dispatcher alone in its actix system holds up to all the workers' windows, `workers ×
    /// max_in_flight`. Beside other dispatchers of the same system (the outboxes of one relay),
    /// the workers together hold between one worker's window and all of theirs, found from the
    /// sink's answer times: opened while answers stay quick, closed when they start to queue (a
    /// mean publish time over its least by more than 10 ms, or than the least itself). In front
    /// of a RabbitMQ queue on one host that is about the floor while a backlog drains, so the
    /// other outboxes' messages wait behind two batches, not eight; a sink slow in parallel (an
    /// HTTP endpoint) gets every worker's window. The gauge `outbox_in_flight_limit` shows it.
    pub max_in_flight: Option<usize>,
    /// Payload bytes (JSON text) the whole dispatcher holds claimed at once, split evenly
    /// between its workers: next to the row window, it bounds memory when rows are large.
    /// Claims take fewer rows when rows are large, and a row larger than a worker's share
    /// still goes, alone. Memory stays near this bound (plus one row per worker at most) whatever
    /// the payload size. Default 64 MiB.
    pub max_in_flight_bytes: usize,
    /// Lease written by a claim (`lease_until = now() + lease`, database clock). A row whose
    /// worker died is reclaimed this long after its claim. Default 60 s.
    pub lease: Duration,
    /// Claims a row gets: a retryable failure or an expired lease at this count sends it dead.
    /// Default 12.
    pub max_attempts: i32,
    /// Full-jitter backoff: a retry waits `uniform(0, min(cap, base × 2^attempts))`. Default 1 s.
    pub backoff_base: Duration,
    /// Upper bound of the backoff. Default 300 s.
    pub backoff_cap: Duration,
    /// Bound on one publish; a publish that takes longer is a retryable failure. Must be shorter
    /// than the lease, so that a message is finalized while its claim is still current.
    /// Default 10 s.
    pub publish_timeout: Duration,
    /// Pause (with ±25 % jitter) after a claim that came back short. Default 500 ms.
    pub poll_interval: Duration,
    /// While rows stream in, the longest a new row waits for others before a claim takes it:
    /// the insert listener then wakes a worker once a quarter of a batch has come in at the
    /// rate rows are being claimed, or after this long, whichever is first (and at least every
    /// 2 ms). Each claim costs the database a statement, a commit and a finalize whatever it
    /// takes, so larger claims cost it less per message; the price is latency while traffic is
    /// light (the operations guide's "Latency and cost"). An idle dispatcher's first row is
    /// claimed at once, whatever this says. Default 20 ms.
    pub linger: Duration,
    /// A deferral of a row older than this (since `created_at`) sends it dead instead, so that a
    /// deferral that never ends does end. Default 7 days.
    pub max_defer_age: Duration,
    /// Prefix of every worker's owner id, written to `lease_owner`. Default
    /// `<hostname>:<pid>`.
    ///
    /// Keep it unique among the dispatchers running on one table: after a claim whose answer was
    /// lost with its connection, a worker hands back every row still leased under its owner id
    /// that it is not publishing. Fencing still holds if two processes share an id, but a row one
    /// of them is publishing could then be handed back and published a second time.
    pub owner: String,
    /// Largest number of fenced writes one finalize statement carries. Default 1000.
    pub finalize_batch: usize,
    /// Per-aggregate ordering: which rows wait for the earlier rows of their aggregate.
    /// Default [`Fifo::Off`]. See [`Fifo`] for the rule and its cost.
    pub fifo: Fifo,
    /// `LISTEN` on a dedicated connection for the outbox's insert trigger and wake a worker at
    /// once, instead of waiting for the poll. It needs a session: behind a transaction pooler,
    /// the pool's direct URL ([`PoolConfig::direct_url`](crate::PoolConfig::direct_url));
    /// without one the dispatcher polls. Of several dispatchers on one outbox, one listener
    /// leads the wake-ups and the others' workers poll less often and help on a backlog (the
    /// operations guide's "Running several dispatchers"). Default true.
    pub listen_for_inserts: bool,
    /// While the sink is unavailable, how often one row is claimed to try it with (a probe).
    /// The first publish that gets through resumes claiming at full speed. A sink that reports
    /// its own state ([`Publisher::state`](crate::Publisher::state)) is probed as soon as it
    /// says it is up. Default 500 ms.
    pub sink_probe_interval: Duration,
    /// How often the dispatcher samples the outbox table (rows per status, age of the oldest
    /// unfinished row, expired leases, blocked aggregates under FIFO) into the gauges of the
    /// `metrics` facade; one aggregate statement a sample over the unfinished rows only, so its
    /// cost follows the backlog, not the history the table keeps (the `done` gauge is
    /// PostgreSQL's estimate of the table's live rows less the unfinished ones). A sample that
    /// takes long (a backlog of millions of rows) spaces the next ones out, so that sampling
    /// takes at most a twentieth of the time (pausing a minute at most);
    /// `outbox_table_sample_age_seconds` says how old the gauges are. `None`: no sampling.
    /// Default 5 s.
    pub table_metrics_interval: Option<Duration>,
    /// How often the dispatcher logs a summary at `info`: messages published, retried, deferred
    /// and dead, rows reaped and leases lost since the last one, with the backlog and the oldest
    /// unfinished row's age as the last table sample saw them (left out, and the sample's age
    /// given instead, when that sample is too old to stand for now: the database did not answer
    /// the later ones). Per-batch lines are at `debug`,
    /// so this is what a busy dispatcher writes at the default level, beside the changes of
    /// state (sink down and up, an outage, a lost lease) logged as they happen. `None`: no
    /// summary. Default 60 s.
    pub summary_interval: Option<Duration>,
    /// What becomes of a row once its message is confirmed: kept as `done` for a day and then
    /// pruned by the dispatcher (the default, [`Retention::KeepFor`]), kept for good, or deleted
    /// by the same fenced statement. See [`Retention`] for the trade-offs.
    pub retention: Retention,
    /// The outbox's name in every message ([`OutboxMessage::source`](crate::OutboxMessage::source),
    /// the RabbitMQ sink's `x-outbox-source` header), so that consumers of many outboxes tell
    /// apart rows that share an id. `None` (the default): derived from the database when the
    /// first claim runs, as `<system identifier>/<database>/<schema>.outbox` (see
    /// [`admin::outbox_source`](crate::admin::outbox_source)), unique without configuration.
    /// Set it where that cannot be read (a role denied `pg_control_system()`), or to keep a name
    /// across a move of the database to another cluster; every dispatcher of one table must use
    /// the same.
    pub source: Option<String>,
    /// Messages a second this dispatcher publishes at most, all workers together: a token
    /// bucket each claim takes its rows from, so that a drain after an outage does not flood
    /// the consumers. Paced, the dispatcher also slows by itself when the broker pushes back
    /// (nacks, as from a queue over its `x-max-length` with `reject-publish`; timeouts; confirms
    /// held by a blocked connection), halving its pace per second of pushback and giving back a
    /// tenth of the cap per calm second. Changed while it runs with
    /// [`SetMaxRate`](crate::dispatcher::SetMaxRate); a fleet shares a cap by dividing it
    /// between its processes. `None` (the default): not paced, except while the broker refuses
    /// messages (nacks): then the claims slow down until it takes them again (see
    /// [`PublishError::Refused`](crate::PublishError::Refused)).
    pub max_rate: Option<f64>,
    /// The outbox's name where one process relays several (`tenant_a.outbox`): the label
    /// `outbox` on every metric series of this dispatcher, and a field of its log lines, so that
    /// each outbox has its own series and lines. `None` (the default): no such label, for a
    /// process with one outbox.
    pub name: Option<String>,
}

impl Default for DispatcherConfig {
    /// Every setting at its default, each also named on its field:
    ///
    /// | setting | default |
    /// | --- | --- |
    /// | [`workers`](DispatcherConfig::workers) | 4 |
    /// | [`batch`](DispatcherConfig::batch) | 200 |
    /// | [`max_in_flight`](DispatcherConfig::max_in_flight) | `None`: `2 × batch` |
    /// | [`max_in_flight_bytes`](DispatcherConfig::max_in_flight_bytes) | 64 MiB |
    /// | [`lease`](DispatcherConfig::lease) | 60 s |
    /// | [`max_attempts`](DispatcherConfig::max_attempts) | 12 |
    /// | [`backoff_base`](DispatcherConfig::backoff_base) | 1 s |
    /// | [`backoff_cap`](DispatcherConfig::backoff_cap) | 300 s |
    /// | [`publish_timeout`](DispatcherConfig::publish_timeout) | 10 s |
    /// | [`poll_interval`](DispatcherConfig::poll_interval) | 500 ms |
    /// | [`linger`](DispatcherConfig::linger) | 20 ms |
    /// | [`max_defer_age`](DispatcherConfig::max_defer_age) | 7 days |
    /// | [`owner`](DispatcherConfig::owner) | `<hostname>:<pid>` |
    /// | [`finalize_batch`](DispatcherConfig::finalize_batch) | 1000 |
    /// | [`fifo`](DispatcherConfig::fifo) | [`Fifo::Off`] |
    /// | [`listen_for_inserts`](DispatcherConfig::listen_for_inserts) | `true` |
    /// | [`sink_probe_interval`](DispatcherConfig::sink_probe_interval) | 500 ms |
    /// | [`table_metrics_interval`](DispatcherConfig::table_metrics_interval) | `Some(5 s)` |
    /// | [`summary_interval`](DispatcherConfig::summary_interval) | `Some(60 s)` |
    /// | [`retention`](DispatcherConfig::retention) | [`Retention::KeepFor`]`(24 h)` |
    /// | [`source`](DispatcherConfig::source) | `None`: derived from the database |
    /// | [`max_rate`](DispatcherConfig::max_rate) | `None`: not paced |
    /// | [`name`](DispatcherConfig::name) | `None`: no `outbox` label |
    ///
    /// ```
    /// use std::time::Duration;
    /// use actix_outbox::DispatcherConfig;
    ///
    /// let config = DispatcherConfig::default();
    /// assert_eq!((config.workers, config.batch, config.max_attempts), (4, 200, 12));
    /// assert_eq!((config.lease, config.publish_timeout), (Duration::from_secs(60), Duration::from_secs(10)));
    /// ```
    fn default() -> Self {
        Self {
            workers: DEFAULT_WORKERS,
            batch: DEFAULT_BATCH,
            max_in_flight: None,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            lease: DEFAULT_LEASE,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff_base: DEFAULT_BACKOFF_BASE,
            backoff_cap: DEFAULT_BACKOFF_CAP,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            linger: DEFAULT_LINGER,
            max_defer_age: DEFAULT_MAX_DEFER_AGE,
            owner: default_owner(),
            finalize_batch: 1000,
            fifo: Fifo::Off,
            listen_for_inserts: true,
            sink_probe_interval: DEFAULT_SINK_PROBE_INTERVAL,
            table_metrics_interval: Some(DEFAULT_TABLE_METRICS_INTERVAL),
            summary_interval: Some(DEFAULT_SUMMARY_INTERVAL),
            retention: Retention::default(),
            source: None,
            max_rate: None,
            name: None,
        }
    }
}

/// `<hostname>:<pid>`: unique per process, readable in `lease_owner`.
pub(crate) fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    format!("{host}:{}", std::process::id())
}

/// Builder setters of the crate's config types: `name: Type` sets the field `name`.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {
        $(
            $(#[$doc])*
            #[must_use]
            pub fn $name(mut self, value: $ty) -> Self {
                self.$name = value;
                self
            }
        )*
    };
}

/// A setter of two fields at once, e.g. a backoff's `(min, max)`: `name(first, second): Type`.
macro_rules! pair_setter {
    ($(#[$doc:meta])* $name:ident($first:ident, $second:ident): $ty:ty) => {
        $(#[$doc])*
        #[must_use]
        pub fn $name(mut self, $first: $ty, $second: $ty) -> Self {
            self.$first = $first;
            self.$second = $second;
            self
        }
    };
}

/// Setters of optional names (`Option<String>` fields) that take anything `Into<String>`.
macro_rules! name_setters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        $(
            $(#[$doc])*
            #[must_use]
            pub fn $name(mut self, name: impl Into<String>) -> Self {
                self.$name = Some(name.into());
                self
            }
        )*
    };
}

pub(crate) use {name_setters, pair_setter, setters};

impl DispatcherConfig {
    setters! {
        /// Sets [`DispatcherConfig::workers`].
        workers: usize,
        /// Sets [`DispatcherConfig::batch`].
        batch: usize,
        /// Sets [`DispatcherConfig::max_in_flight_bytes`].
        max_in_flight_bytes: usize,
        /// Sets [`DispatcherConfig::lease`].
        lease: Duration,
        /// Sets [`DispatcherConfig::max_attempts`].
        max_attempts: i32,
        /// Sets [`DispatcherConfig::backoff_base`].
        backoff_base: Duration,
        /// Sets [`DispatcherConfig::backoff_cap`].
        backoff_cap: Duration,
        /// Sets [`DispatcherConfig::publish_timeout`].
        publish_timeout: Duration,
        /// Sets [`DispatcherConfig::poll_interval`].
        poll_interval: Duration,
        /// Sets [`DispatcherConfig::linger`].
        linger: Duration,
        /// Sets [`DispatcherConfig::max_defer_age`].
        max_defer_age: Duration,
        /// Sets [`DispatcherConfig::owner`].
        owner: String,
        /// Sets [`DispatcherConfig::finalize_batch`].
        finalize_batch: usize,
        /// Sets [`DispatcherConfig::fifo`].
        fifo: Fifo,
        /// Sets [`DispatcherConfig::listen_for_inserts`].
        listen_for_inserts: bool,
        /// Sets [`DispatcherConfig::sink_probe_interval`].
        sink_probe_interval: Duration,
        /// Sets [`DispatcherConfig::table_metrics_interval`] (`None`: no sampling).
        table_metrics_interval: Option<Duration>,
        /// Sets [`DispatcherConfig::summary_interval`] (`None`: no summary).
        summary_interval: Option<Duration>,
        /// Sets [`DispatcherConfig::retention`].
        retention: Retention,
    }

    /// Sets [`DispatcherConfig::source`].
    #[must_use]
    pub fn source(mut self, name: impl Into<String>) -> Self {
        self.source = Some(name.into());
        self
    }

    /// Sets [`DispatcherConfig::name`].
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets [`DispatcherConfig::max_rate`]: messages a second at most.
    #[must_use]
    pub fn max_rate(mut self, per_second: f64) -> Self {
        self.max_rate = Some(per_second);
        self
    }

    /// Sets [`DispatcherConfig::max_in_flight`].
    #[must_use]
    pub fn max_in_flight(mut self, value: usize) -> Self {
        self.max_in_flight = Some(value);
        self
    }

    /// Rows one worker may hold claimed at once.
    pub fn in_flight_limit(&self) -> usize {
        self.max_in_flight.unwrap_or(self.batch.saturating_mul(2))
    }

    /// Payload bytes one worker may hold claimed at once: its share of
    /// [`DispatcherConfig::max_in_flight_bytes`].
    pub fn worker_byte_budget(&self) -> usize {
        (self.max_in_flight_bytes / self.workers.max(1)).max(1)
    }

    /// The owner id of worker `n` (`<owner>:worker-<n>`).
    pub fn worker_owner(&self, n: usize) -> String {
        format!("{}:worker-{n}", self.owner)
    }

    /// Checks the rules that span fields. The supervisor calls it before starting anything.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use ConfigError::*;
        if self.workers == 0 {
            return Err(ZeroWorkers);
        }
        if self.batch == 0 {
            return Err(ZeroBatch);
        }
        if self.max_in_flight_bytes == 0 {
            return Err(ZeroInFlightBytes);
        }
        if self.in_flight_limit() < self.batch {
            return Err(InFlightBelowBatch { in_flight: self.in_flight_limit(), batch: self.batch });
        }
        if self.max_attempts < 1 {
            return Err(MaxAttempts(self.max_attempts));
        }
        if self.lease < Duration::from_millis(10) {
            return Err(LeaseTooShort(self.lease));
        }
        if self.publish_timeout.is_zero() || self.publish_timeout >= self.lease {
            return Err(PublishTimeoutNotBelowLease { publish_timeout: self.publish_timeout, lease: self.lease });
        }
        if self.poll_interval.is_zero() {
            return Err(ZeroPollInterval);
        }
        if self.sink_probe_interval.is_zero() {
            return Err(ZeroSinkProbeInterval);
        }
        if self.table_metrics_interval.is_some_and(|d| d.is_zero()) {
            return Err(ZeroTableMetricsInterval);
        }
        if self.summary_interval.is_some_and(|d| d.is_zero()) {
            return Err(ZeroSummaryInterval);
        }
        if self.backoff_base > self.backoff_cap {
            return Err(BackoffBaseAboveCap { base: self.backoff_base, cap: self.backoff_cap });
        }
        if self.owner.trim().is_empty() {
            return Err(EmptyOwner);
        }
        if self.finalize_batch == 0 {
            return Err(ZeroFinalizeBatch);
        }
        if self.source.as_ref().is_some_and(|s| s.trim().is_empty()) {
            return Err(EmptySource);
        }
        if let Fifo::EventTypes(types) = &self.fifo
            && types.is_empty()
        {
            return Err(EmptyFifoEventTypes);
        }
        if let Some(rate) = self.max_rate {
            check_max_rate(rate)?;
        }
        if self.retention == Retention::KeepFor(Duration::ZERO) {
            return Err(ZeroRetention);
        }
        Ok(())
    }
}

/// A cap on messages a second must be a number above zero.
pub(crate) fn check_max_rate(rate: f64) -> Result<(), ConfigError> {
    if rate.is_finite() && rate > 0.0 { Ok(()) } else { Err(ConfigError::BadMaxRate(rate.to_string())) }
}

/// A configuration that cannot work; the message names the setting and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `retention` keeps `done` rows for no time: say [`Retention::Delete`] to delete them at
    /// once.
    #[error("retention must keep done rows for some time; to delete them as they are confirmed, use Retention::Delete")]
    ZeroRetention,
    /// `max_rate` is not a number of messages a second above zero (given as written).
    #[error("max rate must be a number of messages a second above zero, not {0}")]
    BadMaxRate(String),
    /// `workers` is 0: nothing would ever claim.
    #[error("workers must be at least 1")]
    ZeroWorkers,
    /// `batch` is 0: every claim would be empty.
    #[error("batch must be at least 1")]
    ZeroBatch,
    /// `max_in_flight` below `batch`: a full batch could never be claimed.
    #[error("max in flight ({in_flight}) must be at least the batch ({batch})")]
    InFlightBelowBatch {
        /// The in-flight bound.
        in_flight: usize,
        /// The batch size.
        batch: usize,
    },
    /// `source` is set but empty: its messages would look like another producer's.
    #[error("source must not be empty (leave it unset to derive it from the database)")]
    EmptySource,
    /// `max_in_flight_bytes` is 0: nothing could ever be claimed.
    #[error("max in flight bytes must be above zero")]
    ZeroInFlightBytes,
    /// `table_metrics_interval` is `Some(0)` (use `None` to turn sampling off).
    #[error("table metrics interval must be above zero (None turns sampling off)")]
    ZeroTableMetricsInterval,
    /// `summary_interval` is `Some(0)` (use `None` to turn the summary off).
    #[error("summary interval must be above zero (None turns the summary off)")]
    ZeroSummaryInterval,
    /// `max_attempts` below 1.
    #[error("max attempts must be at least 1 (got {0})")]
    MaxAttempts(i32),
    /// A lease too short to publish anything in.
    #[error("lease must be at least 10ms (got {0:?})")]
    LeaseTooShort(Duration),
    /// The publish timeout is zero or not shorter than the lease: a publish could outlive its
    /// claim, and another worker would publish the same row meanwhile.
    #[error("publish timeout ({publish_timeout:?}) must be above zero and shorter than the lease ({lease:?})")]
    PublishTimeoutNotBelowLease {
        /// The publish timeout.
        publish_timeout: Duration,
        /// The lease.
        lease: Duration,
    },
    /// A zero poll interval would spin on an empty table.
    #[error("poll interval must be above zero")]
    ZeroPollInterval,
    /// A zero probe interval would hammer an unavailable sink.
    #[error("sink probe interval must be above zero")]
    ZeroSinkProbeInterval,
    /// Backoff base above its cap.
    #[error("backoff base ({base:?}) must not exceed the backoff cap ({cap:?})")]
    BackoffBaseAboveCap {
        /// The base.
        base: Duration,
        /// The cap.
        cap: Duration,
    },
    /// An empty owner id.
    #[error("owner must not be empty")]
    EmptyOwner,
    /// `finalize_batch` is 0.
    #[error("finalize batch must be at least 1")]
    ZeroFinalizeBatch,
    /// [`Fifo::EventTypes`] with an empty list would order nothing; say [`Fifo::Off`] instead.
    #[error("fifo event types must not be empty (use Fifo::Off to turn ordering off)")]
    EmptyFifoEventTypes,
}

/// Per-aggregate FIFO: which rows a claim holds back until the earlier rows of their aggregate
/// are finished (docs/architecture.md, "The FIFO gate").
///
/// An **aggregate** is identified by `(aggregate_type, aggregate_id)`: `order/42` and
/// `customer/42` are two aggregates with independent order.
///
/// With the gate on, a row is claimable only when no earlier row (smaller `id`) of its
/// aggregate is `pending`, `processing` or `dead`, i.e. when every earlier row is `done`. So
/// each aggregate has at most one row in flight, and its rows are claimed and finalized in id
/// order, across workers, processes and lease takeovers. A `dead` row blocks the rows behind it
/// until an operator retries it ([`dead_retry`](crate::admin::dead_retry)) or skips it
/// ([`dead_skip`](crate::admin::dead_skip)); [`blocked_aggregates`](crate::admin::blocked_aggregates)
/// lists them. A row waiting for its backoff or a deferral blocks the same way.
///
/// What it does **not** promise: the order in which a broker sees the messages after a lease
/// takeover (the old worker's late publish can arrive after its successor), so consumers still
/// apply events idempotently. And it trusts that ids commit in order within an aggregate, which
/// producers ensure with [`enqueue_ordered`](crate::enqueue_ordered) (or by locking the
/// aggregate's own row `FOR UPDATE`) inside their transaction.
///
/// **Ordered and unordered types** ([`Fifo::EventTypes`]), one rule: *only rows of the listed
/// types are gated, and only by earlier unfinished rows of listed types of the same aggregate;
/// rows of other types are never gated and never block.* A dead `order.created` therefore
/// holds back a later `order.paid` (both listed) but not a later `email.sent` (unlisted), and a
/// dead or backed-off `email.sent` holds back nothing.
///
/// Every dispatcher claiming from the table must use the same setting: a dispatcher with the
/// gate off claims any ready row, whatever its aggregate.
///
/// Cost: an aggregate's rows go out one at a time, one claim-publish-finalize round trip each,
/// so a hot aggregate moves no faster than that loop. A claim reads the oldest pending rows in
/// `(available_at, id)` order and skips each row that waits behind its aggregate with one index
/// probe each. Under `All`, that walk stops after `4 × batch` rows; when it found
/// fewer free rows than the batch (a long backlog of a few aggregates ahead of the others, or
/// every aggregate's first row in flight), a skip scan visits up to `4 × batch` aggregates with
/// unfinished rows instead, one index descent each, and the worker's next scan goes on where
/// this one stopped: about 25 ms per 200-row claim, whatever the backlogs and however many
/// aggregates. `EventTypes` walks the pending rows without that bound (a bounded walk could
/// leave unlisted rows, which never wait, behind a window of blocked listed ones), so there a
/// claim pays one probe for every blocked listed row ahead of the free rows it finds.
/// `fifo-explain` (the workspace's `tools/`) measures both on a million-row table. Gate only the event types
/// that need order.
///
/// The gate has an index of its own, `outbox_fifo_gate`, which the migrations leave out (every
/// insert and claim would write it, for nothing, where the gate is off). A dispatcher whose gate
/// is on builds it before its first claim, without blocking producers; on a big table that
/// build reads the whole table once, so run `actix-outbox migrate --fifo` (or
/// [`admin::ensure_fifo_index`](crate::admin::ensure_fifo_index)) ahead of time.
///
/// ```
/// use actix_outbox::{DispatcherConfig, Fifo};
///
/// let config = DispatcherConfig::default().fifo(Fifo::event_types(["order.created", "order.paid"]));
/// config.validate().unwrap();
/// assert!(config.fifo.is_gated("order.paid"));
/// assert!(!config.fifo.is_gated("email.sent"));
///
/// assert!(DispatcherConfig::default().fifo(Fifo::EventTypes(vec![])).validate().is_err());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fifo {
    /// No ordering: any ready row is claimable (the default, and the fastest).
    #[default]
    Off,
    /// Every row is gated by the earlier unfinished rows of its aggregate.
    All,
    /// Only rows of these event types are gated, and only by earlier unfinished rows of these
    /// types (see the rule above). Must not be empty.
    EventTypes(Vec<String>),
}

/// What the dispatcher does with a row whose message the sink confirmed.
///
/// Whichever is chosen, the write is fenced (it applies only while the claim that published the
/// row still holds it) and only confirmed rows are touched: `dead` rows stay for inspection and
/// replay until an operator retries or skips them, and `pending` and `processing` rows are never
/// deleted.
///
/// | | [`Retention::KeepFor`] (default, 24 h) | [`Retention::Keep`] | [`Retention::Delete`] |
/// | --- | --- | --- | --- |
/// | a confirmed row | becomes `done`, with `done_at`; deleted by the dispatcher once older than the window | becomes `done` for good | is deleted |
/// | audit trail in the table | every row published within the window | every published row, until `purge --older-than` runs | none: only what is not yet sent, and `dead` rows |
/// | `stats`, `outbox_rows{status="done"}` | count `done` rows | count `done` rows | show 0 `done` (the dispatcher's `outbox_finalized_total{outcome="done"}` still counts) |
/// | table size | the window's rows (rate × window × about 600 bytes at a 200-byte payload) | grows until purged | the backlog |
/// | database work per message | an `UPDATE` written beside the row (HOT: no index entry), and a share of a batched `DELETE` later | the `UPDATE` | a `DELETE` |
///
/// **Why 24 hours.** The `done` rows answer an operator's questions about what was sent ("was
/// order 42's event published, when, after how many attempts?"), and those come within a day of
/// an incident: long enough to look at yesterday, short enough that the table stays the size of
/// a day. River keeps completed jobs for 24 hours by default for the same reasons. Pruning runs
/// in one process of a fleet at a time, in short batches off the claim path (see
/// docs/operations.md, "Retention"); `purge --older-than` stays for one-off use.
///
/// ```
/// use std::time::Duration;
/// use actix_outbox::{DispatcherConfig, Retention};
///
/// assert_eq!(DispatcherConfig::default().retention, Retention::KeepFor(Duration::from_secs(24 * 3600)));
/// let config = DispatcherConfig::default().retention(Retention::KeepFor(Duration::from_secs(600)));
/// assert_eq!(config.retention, Retention::KeepFor(Duration::from_secs(600)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retention {
    /// Keep the row as `done` (with `done_at`) for this long after it was finished, then delete
    /// it (the dispatcher's pruner).
    KeepFor(Duration),
    /// Keep the row as `done` (with `done_at`) for good, for `stats`, audits and `purge`.
    Keep,
    /// Delete the row in the finalize statement.
    Delete,
}

/// How long `done` rows are kept by default.
const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

impl Default for Retention {
    /// [`Retention::KeepFor`] 24 hours.
    fn default() -> Self {
        Retention::KeepFor(DEFAULT_RETENTION)
    }
}

impl Fifo {
    /// [`Fifo::EventTypes`] from any list of strings.
    pub fn event_types<S: Into<String>>(types: impl IntoIterator<Item = S>) -> Self {
        Fifo::EventTypes(types.into_iter().map(Into::into).collect())
    }

    /// Whether any row is gated.
    pub fn is_on(&self) -> bool {
        !matches!(self, Fifo::Off)
    }

    /// Whether rows of `event_type` are gated (and so can block later gated rows).
    pub fn is_gated(&self, event_type: &str) -> bool {
        match self {
            Fifo::Off => false,
            Fifo::All => true,
            Fifo::EventTypes(types) => types.iter().any(|t| t == event_type),
        }
    }
}

impl std::fmt::Display for Fifo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fifo::Off => f.write_str("off"),
            Fifo::All => f.write_str("all event types"),
            Fifo::EventTypes(types) => write!(f, "event types {}", types.join(", ")),
        }
    }
}
