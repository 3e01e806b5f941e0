//! `OutboxSupervisor`: owns the configuration, the pool and the publisher; starts the claim
//! and finalize actors, restarts any that die, reports metrics and runs the shutdown protocol.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::claim::{ClaimActor, Drain, Probe};
use super::finalize::{FinalizeActor, FinalizerSlot, Flushed};
use super::gate::{Check, Claimable};
use super::pace::PaceReport;
use super::shared::Shared;
use super::wake::Wake;
use crate::config::{ConfigError, DispatcherConfig, Retention};
use crate::error::Error;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::publisher::{Publisher, SinkState};
use crate::store::PgPool;

/// How often the supervisor checks that its actors are alive.
const WATCHDOG_PERIOD: Duration = Duration::from_millis(200);
/// How often the supervisor asks the sink how it is ([`Publisher::state`]).
const SINK_CHECK_PERIOD: Duration = Duration::from_millis(100);
/// How long past the publish timeout a shutdown lets the finalizer try a failing database.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// The dispatcher: register it in an actix application and it moves outbox rows to the
/// publisher until it is shut down.
///
/// It starts one claim actor per worker and one finalize actor on the current arbiter. Each
/// claimed message gets a publish actor of its own. An actor that dies (a panic in its
/// handler) is replaced within 200 ms; the rows it held stay `processing` until
/// their lease expires, and are then reclaimed with a higher `lease_version`, so that any late
/// write from the dead attempt is fenced off. A panicking sink kills only its own publish.
///
/// ```no_run
/// use actix_outbox::dispatcher::Shutdown;
/// use actix_outbox::sink::ChannelSink;
/// use actix_outbox::{DispatcherConfig, OutboxSupervisor, connect_pool, migrate};
///
/// #[actix::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let url = "postgres://root@127.0.0.1:5432/app";
///     migrate(url).await?;
///     let pool = connect_pool(url, 8).await?;
///     let (sink, mut published) = ChannelSink::new();
///     let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink)?;
///     while let Some(message) = published.recv().await {
///         println!("{} {}", message.id, message.event_type);
///     }
///     dispatcher.send(Shutdown).await?;
///     Ok(())
/// }
/// ```
pub struct OutboxSupervisor {
    shared: Arc<Shared>,
    workers: Vec<Addr<ClaimActor>>,
    finalizer: Option<Arc<FinalizerSlot>>,
    state: State,
    /// What the sink said at the last check, and since when.
    sink: (SinkState, Instant),
    shutdown_waiters: Vec<oneshot::Sender<()>>,
    /// The insert listener, cancelled at shutdown.
    listener: Option<SpawnHandle>,
    /// The worker the next wake-up goes to.
    next_wake: usize,
    /// A table sample is running (the next one due skips).
    sampling: bool,
    /// The sampler's pace: how many of its ticks the last sample's cost skips, and how many of
    /// those are left.
    sample_pause: (u32, u32),
    /// A sweep is running (the next one due skips).
    sweeping: bool,
    /// Where the pruner's passes start; `Some` while a pass runs is `pruning`.
    pruner: super::pruner::Pruner,
    /// A pruning pass is running (the next one due skips).
    pruning: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Draining,
    Stopped,
}

impl std::fmt::Debug for OutboxSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxSupervisor")
            .field("owner", &self.shared.config.owner)
            .field("workers", &self.workers.len())
            .field("state", &self.state)
            .finish()
    }
}

impl OutboxSupervisor {
    /// A supervisor for `config`, claiming through `pool` and publishing with `publisher`.
    /// Fails if the configuration is invalid; nothing starts until the actor does.
    pub fn new(config: DispatcherConfig, pool: PgPool, publisher: impl Publisher) -> Result<Self, Error> {
        config.validate()?;
        let shared = Arc::new(Shared::new(config, pool, Arc::new(publisher)));
        Ok(Self {
            shared,
            workers: Vec::new(),
            finalizer: None,
            state: State::Running,
            sink: (SinkState::Up, Instant::now()),
            shutdown_waiters: Vec::new(),
            listener: None,
            next_wake: 0,
            sampling: false,
            sample_pause: (0, 0),
            sweeping: false,
            pruner: Default::default(),
            pruning: false,
        })
    }

    /// [`OutboxSupervisor::new`], started on the current arbiter.
    pub fn start(config: DispatcherConfig, pool: PgPool, publisher: impl Publisher) -> Result<Addr<Self>, Error> {
        Ok(Self::new(config, pool, publisher)?.start())
    }

    /// Replaces any actor that died. The finalizer is replaced while draining too: the drain
    /// waits for every publish to be finalized, and a publish whose write died with the old
    /// finalizer sends it again to the new one.
    fn watchdog(&mut self) {
        if self.state == State::Stopped {
            return;
        }
        let Some(slot) = self.finalizer.clone() else { return };
        if !slot.get().connected() {
            error!("finalize actor died; restarting it");
            Metrics::add(&self.shared.metrics.restarts, 1);
            slot.set(FinalizeActor::new(self.shared.clone()).start());
        }
        if self.state != State::Running {
            return;
        }
        for n in 0..self.workers.len() {
            if !self.workers[n].connected() {
                error!(worker = %self.shared.config.worker_owner(n),
                    "claim actor died; restarting it (its publishes finish; rows a claim of it leased and nothing publishes are handed back)");
                Metrics::add(&self.shared.metrics.restarts, 1);
                self.workers[n] = ClaimActor::new(n, self.shared.clone(), slot.clone()).replacing_a_dead_one().start();
            }
        }
    }

    /// Asks the sink how it is, logs its changes of state, and acts on the gate's verdict.
    /// Starts a table sample unless one is running.
    fn sample_table(&mut self, ctx: &mut Context<Self>) {
        // How old the gauges are: a dashboard tells a stale backlog from a current one.
        if let Some(age) = self.shared.summary.sample_age() {
            self.shared.metrics.sample_age(age);
        }
        // While the database is down the claims and the finalizer probe it; a sample would only
        // add a waiter for the pool's connections.
        if self.sampling || self.state == State::Stopped || !self.shared.db.reachable() {
            return;
        }
        // A costly sample (a large backlog) spaces the next ones out, so that sampling takes a
        // bounded share of a connection while the dispatcher drains that backlog.
        if self.sample_pause.1 > 0 {
            self.sample_pause.1 -= 1;
            return;
        }
        self.sampling = true;
        let started = Instant::now();
        let sample = super::sampler::sample(self.shared.clone());
        // A dispatcher that stopped while its sample ran reports nothing more.
        ctx.spawn(sample.into_actor(self).map(move |sampled, act, _| {
            act.sampling = false;
            // Only an answer paces: a sample that failed (a database that did not answer) is
            // tried again at the next tick.
            let every = act.shared.config.table_metrics_interval.unwrap_or_default();
            let skip = if sampled.is_ok() { super::sampler::ticks_to_skip(started.elapsed(), every) } else { 0 };
            act.sample_pause = (skip, skip);
            if act.state != State::Stopped {
                super::sampler::report(&act.shared, sampled);
            }
        }));
    }

    /// Starts a sweep unless one is running; one whose stretch was full runs again soon.
    fn sweep(&mut self, ctx: &mut Context<Self>) {
        if self.sweeping || self.state == State::Stopped || !self.shared.db.reachable() {
            return;
        }
        self.sweeping = true;
        let sweep = super::sweeper::sweep(self.shared.clone());
        ctx.spawn(sweep.into_actor(self).map(|swept, act, ctx| {
            act.sweeping = false;
            if act.state != State::Stopped && super::sweeper::report(&act.shared, swept) {
                ctx.run_later(super::sweeper::SWEEP_AGAIN, |act, ctx| act.sweep(ctx));
            }
        }));
    }

    /// Starts a pruning pass unless one is running.
    fn prune(&mut self, ctx: &mut Context<Self>, keep: Duration) {
        if self.pruning || self.state == State::Stopped || !self.shared.db.reachable() {
            return;
        }
        self.pruning = true;
        let from = self.pruner.start();
        let pass = super::pruner::prune(self.shared.clone(), keep, from);
        ctx.spawn(pass.into_actor(self).map(|pass, act, _| {
            act.pruning = false;
            super::pruner::report(&act.shared, &pass);
            if let Ok(pass) = pass {
                act.pruner.ended(&pass);
            }
        }));
    }

    /// How long a table sample stands for the table: two intervals and a query timeout (one
    /// sample may skip, or take its time), and the intervals its cost has the sampler skip;
    /// older, the summary says how old it is instead.
    fn sample_fresh_for(&self) -> Duration {
        let config = &self.shared.config;
        config.table_metrics_interval.unwrap_or_default() * (2 + self.sample_pause.0) + self.shared.pool.query_timeout()
    }

    fn check_sink(&mut self) {
        if self.state != State::Running {
            return;
        }
        let state = self.shared.publisher.state();
        if state != self.sink.0 {
            let lasted = Duration::from_millis(self.sink.1.elapsed().as_millis() as u64);
            let lasted = humantime::format_duration(lasted);
            let outbox = self.shared.config.name.as_deref();
            match &state {
                SinkState::Up => info!(outbox, was = %self.sink.0, lasted = %lasted, "sink is up"),
                SinkState::Blocked(why) => warn!(outbox, reason = %why, after = %lasted, "sink is blocked"),
                SinkState::Down(why) => warn!(outbox, reason = %why, after = %lasted, "sink is down"),
            }
            self.sink = (state.clone(), Instant::now());
        }
        let check = self.shared.gate.check(&state);
        let paused = self.shared.gate.claimable() == Claimable::No;
        self.shared.metrics.sink_gauges(state.is_up() && !paused, paused);
        self.shared.metrics.pace_gauges(&self.shared.pace.report());
        self.shared.metrics.window_gauge(self.shared.window.limit());
        match check {
            Check::Nothing => {}
            Check::Paused => Metrics::add(&self.shared.metrics.sink_outages, 1),
            Check::WakeAll => {
                for w in &self.workers {
                    w.do_send(Wake);
                }
            }
            Check::Probe => {
                self.next_wake = (self.next_wake + 1) % self.workers.len();
                self.workers[self.next_wake].do_send(Probe);
            }
        }
    }
}

impl Actor for OutboxSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if crate::lifecycle::system_gone() {
            ctx.stop();
            return;
        }
        let shared = self.shared.clone();
        let config = &shared.config;
        info!(outbox = config.name.as_deref(), owner = %config.owner, workers = config.workers, batch = config.batch,
            lease = %humantime::format_duration(config.lease), max_attempts = config.max_attempts,
            fifo = %config.fifo, max_rate = %config.max_rate.map_or("none".to_owned(), |r| format!("{r}/s")),
            "outbox dispatcher starting");
        self.shared.metrics.describe(config.table_metrics_interval.is_some());
        let finalizer = Arc::new(FinalizerSlot::new(FinalizeActor::new(self.shared.clone()).start()));
        self.workers =
            (0..config.workers).map(|n| ClaimActor::new(n, self.shared.clone(), finalizer.clone()).start()).collect();
        self.finalizer = Some(finalizer);
        // Before the workers' first claim (they start on the next turn of the arbiter): a sink
        // that is down at start pauses claiming from the outset.
        self.check_sink();
        ctx.run_interval(WATCHDOG_PERIOD, |act, _| act.watchdog());
        ctx.run_interval(SINK_CHECK_PERIOD, |act, _| act.check_sink());
        if let Some(every) = config.summary_interval {
            ctx.run_interval(every, |act, _| {
                let shared = &act.shared;
                shared.summary.log(shared.config.name.as_deref(), shared.metrics.snapshot(), act.sample_fresh_for())
            });
        }
        if let Some(every) = config.table_metrics_interval {
            self.sample_table(ctx);
            ctx.run_interval(every, |act, ctx| act.sample_table(ctx));
        }
        ctx.run_interval(super::sweeper::SWEEP_EVERY, |act, ctx| act.sweep(ctx));
        if let Retention::KeepFor(keep) = config.retention {
            ctx.run_later(super::pruner::FIRST_PASS_AFTER, move |act, ctx| act.prune(ctx, keep));
            ctx.run_interval(super::pruner::every(keep), move |act, ctx| act.prune(ctx, keep));
        }
        if config.listen_for_inserts && !self.shared.pool.has_session() {
            warn!(poll_interval = %humantime::format_duration(config.poll_interval),
                "behind a transaction pooler with no direct URL, the insert listener is off: workers find new rows \
                 by polling, so a new row may wait up to the poll interval; give the pool a direct URL to the server \
                 (PoolConfig::direct_url, `run --direct-url`) to have inserts wake them at once");
        } else if config.listen_for_inserts {
            let supervisor = ctx.address().downgrade();
            let wake = move |what: super::listener::Wake| {
                let alive = supervisor.upgrade();
                match (&alive, what) {
                    (Some(addr), super::listener::Wake::One) => addr.do_send(WakeWorkers),
                    (Some(addr), super::listener::Wake::All) => addr.do_send(WakeAll),
                    _ => {}
                }
                alive.is_some()
            };
            let listener = super::listener::listen(self.shared.pool.clone(), self.shared.wakeups.clone(), wake);
            self.listener = Some(ctx.spawn(listener.into_actor(self)));
        }
    }
}

/// Ask for the dispatcher's counters.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "MetricsSnapshot")]
pub struct GetMetrics;

impl Handler<GetMetrics> for OutboxSupervisor {
    type Result = MessageResult<GetMetrics>;

    fn handle(&mut self, _: GetMetrics, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.shared.metrics.snapshot())
    }
}

/// Ask for the dispatcher's view of its dependencies, for a readiness probe.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Health")]
pub struct GetHealth;

/// The dispatcher's view of the two services it depends on, as of its last look at each
/// ([`GetHealth`]). Ready means: the database answered the last statement, and the sink is
/// [`SinkState::Up`] with claiming not paused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// What the sink said at the supervisor's last check (every 100 ms).
    pub sink: SinkState,
    /// The sink gate holds claiming back (the sink was found unavailable, or is being probed).
    pub claiming_paused: bool,
    /// No statement of the dispatcher (claim, finalize, table sample) failed on a transient
    /// error, or went unanswered within the pool's query timeout
    /// ([`PoolConfig::query_timeout`](crate::PoolConfig::query_timeout)), since its last write
    /// (claim, finalize) committed; true before the first. A read that answers does not count:
    /// a standby answers reads.
    pub database_reachable: bool,
    /// The database refused the dispatcher's last write as read-only (SQLSTATE 25006): it
    /// reached a standby, not the primary. Claiming waits, spending no attempt; false once a
    /// write commits.
    pub database_read_only: bool,
    /// Shutdown has begun: the dispatcher claims nothing more.
    pub stopping: bool,
    /// The outbox's source name ([`DispatcherConfig::source`](crate::DispatcherConfig::source)),
    /// once known: configured, or derived by the first claim.
    pub source: Option<String>,
}

impl Health {
    /// Whether the dispatcher can move rows: the database answers, the sink is up and
    /// claiming is neither paused nor stopped.
    pub fn is_ready(&self) -> bool {
        self.database_reachable && self.sink.is_up() && !self.claiming_paused && !self.stopping
    }

    /// Why the dispatcher is not ready, in one line; `None` when it is.
    pub fn not_ready_reason(&self) -> Option<String> {
        if self.stopping {
            Some("the dispatcher is shutting down".to_owned())
        } else if !self.database_reachable && self.database_read_only {
            Some(
                "the database is read-only (a standby, or default_transaction_read_only): point the URL at the primary, \
                 or list every server with target_session_attrs=read-write"
                    .to_owned(),
            )
        } else if !self.database_reachable {
            Some("the database did not answer the dispatcher's last statement".to_owned())
        } else if !self.sink.is_up() {
            Some(format!("the sink is {}", self.sink))
        } else if self.claiming_paused {
            Some("claiming is paused until the sink answers a probe".to_owned())
        } else {
            None
        }
    }
}

impl Handler<GetHealth> for OutboxSupervisor {
    type Result = MessageResult<GetHealth>;

    fn handle(&mut self, _: GetHealth, _: &mut Context<Self>) -> Self::Result {
        MessageResult(Health {
            sink: self.sink.0.clone(),
            claiming_paused: self.shared.gate.claimable() == Claimable::No,
            database_reachable: self.shared.db.reachable(),
            database_read_only: self.shared.db.read_only(),
            stopping: self.state != State::Running,
            source: self.shared.known_source().map(|s| s.to_string()),
        })
    }
}

/// New rows were inserted: wake one worker (in turn) to claim now rather than at its next
/// poll. Cheap: a worker already claiming claims once more when its claim returns, one with a
/// full window claims when the window opens. The insert listener sends it; applications that
/// disable the listener can send it themselves after committing events.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct WakeWorkers;

impl Handler<WakeWorkers> for OutboxSupervisor {
    type Result = ();

    fn handle(&mut self, _: WakeWorkers, _: &mut Context<Self>) {
        if self.state == State::Running && !self.workers.is_empty() {
            self.next_wake = (self.next_wake + 1) % self.workers.len();
            self.workers[self.next_wake].do_send(Wake);
        }
    }
}

/// The leading dispatcher found a backlog: every worker claims now (see `listener`).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
struct WakeAll;

impl Handler<WakeAll> for OutboxSupervisor {
    type Result = ();

    fn handle(&mut self, _: WakeAll, _: &mut Context<Self>) {
        if self.state == State::Running {
            for worker in &self.workers {
                worker.do_send(Wake);
            }
        }
    }
}

/// Changes the dispatcher's cap on messages a second while it runs
/// ([`DispatcherConfig::max_rate`]): `Some(n)` paces at `n` from now on (starting at the new
/// cap, whatever pushback had slowed the old one to), `None` stops pacing. A cap that is not a
/// number above zero is refused with [`ConfigError::BadMaxRate`](crate::ConfigError::BadMaxRate),
/// and the old one stays.
///
/// ```no_run
/// use actix_outbox::dispatcher::{GetPace, SetMaxRate};
/// # async fn f(dispatcher: actix::Addr<actix_outbox::OutboxSupervisor>) -> Result<(), Box<dyn std::error::Error>> {
/// dispatcher.send(SetMaxRate(Some(500.0))).await??;
/// assert_eq!(dispatcher.send(GetPace).await?.max_rate, Some(500.0));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Result<(), ConfigError>")]
pub struct SetMaxRate(pub Option<f64>);

impl Handler<SetMaxRate> for OutboxSupervisor {
    type Result = Result<(), ConfigError>;

    fn handle(&mut self, SetMaxRate(cap): SetMaxRate, _: &mut Context<Self>) -> Self::Result {
        if let Some(rate) = cap {
            crate::config::check_max_rate(rate)?;
        }
        let was = self.shared.pace.report().max_rate;
        self.shared.pace.set_cap(cap);
        self.shared.metrics.pace_gauges(&self.shared.pace.report());
        match cap {
            Some(rate) => info!(max_rate = rate, was = ?was, "max rate set"),
            None => info!(was = ?was, "max rate removed: not paced"),
        }
        // Workers waiting for tokens at the old rate ask again at the new one.
        if self.state == State::Running {
            for worker in &self.workers {
                worker.do_send(Wake);
            }
        }
        Ok(())
    }
}

/// Ask for the dispatcher's pace: its cap on messages a second and the pace pushback holds it
/// at now.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "PaceReport")]
pub struct GetPace;

impl Handler<GetPace> for OutboxSupervisor {
    type Result = MessageResult<GetPace>;

    fn handle(&mut self, _: GetPace, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.shared.pace.report())
    }
}

/// Graceful shutdown: stop claiming at once, let every publish already started finish and be
/// finalized, then answer. Every message a worker claims starts publishing immediately, so
/// nothing claimed is left unstarted. The answer comes within the publish timeout plus one
/// finalize round trip, with nothing left `processing` under this dispatcher's owner ids.
/// Whatever the database does (down, or silent), the answer comes within the publish timeout
/// plus 2 s (or the pool's query timeout, if that is longer, for a claim already running): a
/// finalize that the database does not take by then is given up, and its rows wait for their
/// lease to expire.
///
/// Safe to send more than once: later requests wait for the same drain, or answer at once
/// when it is over. The supervisor stays alive afterwards to answer [`GetMetrics`].
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Handler<Shutdown> for OutboxSupervisor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        match self.state {
            State::Stopped => {
                let _ = tx.send(());
            }
            State::Draining => self.shutdown_waiters.push(tx),
            State::Running => {
                self.state = State::Draining;
                // Publishes end within their timeout; their finalizes get a little more, then
                // give up on a database that does not answer (the rows wait for their lease).
                let _ = self.shared.drain_by.set(Instant::now() + self.shared.config.publish_timeout + DRAIN_GRACE);
                self.shutdown_waiters.push(tx);
                if let Some(listener) = self.listener.take() {
                    ctx.cancel_future(listener);
                }
                info!(
                    outbox = self.shared.config.name.as_deref(),
                    "outbox dispatcher shutting down: claiming stopped, draining in-flight publishes"
                );
                let drains: Vec<_> = self.workers.iter().map(|w| w.send(Drain)).collect();
                let finalizer = self.finalizer.clone();
                let drained = async move {
                    for drain in drains {
                        if let Err(e) = drain.await {
                            warn!(error = %e, "a worker died while draining; its rows wait for lease expiry");
                        }
                    }
                    if let Some(slot) = finalizer {
                        let _ = slot.get().send(Flushed).await;
                    }
                };
                ctx.spawn(drained.into_actor(self).map(|(), act, _| {
                    act.state = State::Stopped;
                    info!(outbox = act.shared.config.name.as_deref(), metrics = ?act.shared.metrics.snapshot(),
                        "outbox dispatcher stopped");
                    for waiter in act.shutdown_waiters.drain(..) {
                        let _ = waiter.send(());
                    }
                }));
            }
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

#[cfg(feature = "test-util")]
/// Makes worker `n`'s claim actor panic, so that tests and drills can watch the supervisor
/// replace it. Not for production use.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct CrashWorker(pub usize);

#[cfg(feature = "test-util")]
/// Makes the finalize actor panic, so that tests and drills can watch the supervisor replace
/// it (while draining too). Not for production use.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct CrashFinalizer;

#[cfg(feature = "test-util")]
impl Handler<CrashFinalizer> for OutboxSupervisor {
    type Result = ();

    fn handle(&mut self, _: CrashFinalizer, _: &mut Context<Self>) {
        if let Some(slot) = &self.finalizer {
            slot.do_send(super::finalize::Crash);
        }
    }
}

#[cfg(feature = "test-util")]
impl Handler<CrashWorker> for OutboxSupervisor {
    type Result = ();

    fn handle(&mut self, msg: CrashWorker, _: &mut Context<Self>) {
        if let Some(w) = self.workers.get(msg.0) {
            w.do_send(super::claim::Crash);
        }
    }
}
