//! `ClaimActor`: one per worker. Reaps and claims batches, starts a publish actor per claimed
//! message, and paces itself.
//!
//! Pacing: a full batch means a backlog, so the worker claims again at once, as long as its
//! in-flight window (`max_in_flight`) has room for a whole batch; the next claim thus overlaps
//! the publishing of the last. A short batch means the table is drained, so the worker waits a
//! jittered poll interval or until a [`Wake`] arrives. A window without room for a batch waits
//! for publishes to finish (never a partial claim: see [`ClaimActor::claim`]); so does a claim
//! that the dispatcher's window, shared by the workers, has no room for (see `window`): the
//! window wakes the worker when a batch fits. Under the FIFO gate, a finished publish also
//! triggers a claim, since it may have unblocked the next row of its aggregate.
//!
//! The sink gate comes first: while the sink is unavailable the worker claims nothing, and
//! when the supervisor asks it to [`Probe`], it claims a single row to try the sink with. A
//! claim that fails on the database backs off (100 ms doubling to 1 s, jittered), so a database
//! outage costs a few cheap attempts a second and claiming resumes within a second of its end.
//!
//! New rows: the dispatcher's cursor (see `cursor`) is held by one claim at a time; a worker
//! that finds it held waits until the holder hands it back and wakes it. A claim takes the due
//! rows that wait (retries, releases, expired leases) first, then the new rows after the cursor,
//! and moves the cursor on. Under `Fifo::All`, the worker keeps where its last scan of
//! aggregates for free heads stopped ([`ClaimParams::heads_after`]), so that its scans take
//! turns over all the aggregates.

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;
use tracing::{debug, error, warn};

use super::finalize::FinalizerSlot;
use super::gate::Claimable;
use super::publish::{PublishActor, PublishFinished};
use super::shared::Shared;
use super::wake::Wake;
use crate::backoff::jittered;
use crate::error::StoreError;
use crate::metrics::Metrics;
use crate::model::OutboxMessage;
use crate::store::{self, AggregateKey, ClaimParams, HeadsScan};

/// Stop claiming; resolves when nothing this worker claimed is still in flight.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// Claim one row to try the sink with (the sink gate is probing).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub(crate) struct Probe;

/// First pause after a claim failed on the database; it doubles up to [`CLAIM_RETRY_MAX`].
const CLAIM_RETRY_MIN: Duration = Duration::from_millis(100);
/// Longest pause between claims while the database fails.
const CLAIM_RETRY_MAX: Duration = Duration::from_secs(1);

#[cfg(feature = "test-util")]
/// Panics inside the worker's handler, to exercise the supervisor's restart path.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Crash;

pub(crate) struct ClaimActor {
    worker: usize,
    owner: String,
    shared: Arc<Shared>,
    finalizer: Arc<FinalizerSlot>,
    /// Claimed messages not yet finalized.
    in_flight: usize,
    /// Their payload bytes, against the worker's byte budget.
    in_flight_bytes: usize,
    /// A claim statement is running.
    claiming: bool,
    /// The last claim filled its batch: claim again as soon as the window has room.
    backlog: bool,
    /// A wake-up arrived while a claim was running (its snapshot may predate the new rows):
    /// claim again as soon as it returns.
    woken: bool,
    /// The pending poll timer.
    timer: Option<SpawnHandle>,
    /// Under `Fifo::All`: the aggregate after which the next scan for free heads starts.
    heads_after: Option<AggregateKey>,
    /// The supervisor asked for a probe: the next claim takes one row, gate closed or not.
    probe: bool,
    /// Claims that failed on the database in a row (paces the retries).
    failures: u32,
    /// A claim failed on a broken connection: it may have committed, leasing rows whose answer
    /// never came. The next claim first hands them back.
    unanswered: bool,
    /// Stop claiming; answer `drain_waiters` when `in_flight` reaches 0.
    draining: bool,
    drain_waiters: Vec<oneshot::Sender<()>>,
}

impl std::fmt::Debug for ClaimActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimActor").field("owner", &self.owner).field("in_flight", &self.in_flight).finish()
    }
}

impl ClaimActor {
    pub(crate) fn new(worker: usize, shared: Arc<Shared>, finalizer: Arc<FinalizerSlot>) -> Self {
        Self {
            worker,
            owner: shared.config.worker_owner(worker),
            shared,
            finalizer,
            in_flight: 0,
            in_flight_bytes: 0,
            claiming: false,
            backlog: false,
            woken: false,
            timer: None,
            heads_after: None,
            probe: false,
            failures: 0,
            unanswered: false,
            draining: false,
            drain_waiters: Vec::new(),
        }
    }

    /// For the replacement of a claim actor that died: the claim it may have had running could
    /// have committed without its answer reaching anyone, so the first claim hands back the
    /// worker's rows that no publish holds (see `store::release_unanswered`).
    pub(crate) fn replacing_a_dead_one(mut self) -> Self {
        self.unanswered = true;
        self
    }

    /// The next poll: `poll_interval`, jittered; longer while another dispatcher leads the
    /// insert wake-ups (see `listener`), whose calls for help wake this one's workers when
    /// there is a backlog.
    fn schedule_poll(&mut self, ctx: &mut Context<Self>) {
        let every = self.shared.config.poll_interval;
        let every = if self.shared.wakeups.following() { every * super::listener::FOLLOWER_POLL_FACTOR } else { every };
        self.schedule_claim(ctx, jittered(every));
    }

    fn schedule_claim(&mut self, ctx: &mut Context<Self>, delay: Duration) {
        if let Some(timer) = self.timer.take() {
            ctx.cancel_future(timer);
        }
        self.timer = Some(ctx.run_later(delay, |act, ctx| {
            act.timer = None;
            act.claim(ctx);
        }));
    }

    fn claim(&mut self, ctx: &mut Context<Self>) {
        if self.claiming || self.draining {
            return;
        }
        let probe = std::mem::take(&mut self.probe);
        if !probe && self.shared.gate.claimable() == Claimable::No {
            // The supervisor wakes every worker when the sink is back; the poll is a fallback.
            self.schedule_poll(ctx);
            return;
        }
        let config = &self.shared.config;
        let room = config.in_flight_limit().saturating_sub(self.in_flight);
        if probe && room == 0 {
            self.shared.gate.probe_aborted();
            return;
        }
        // Claim a whole batch or wait: claiming whatever room the last finished publish freed
        // degenerates into a stream of one-row claims, each costing a full statement, and the
        // database ceiling falls with them.
        // `validate()` keeps the window at least one batch wide, so an empty window always fits.
        if room < config.batch && !probe {
            // PublishFinished claims again once a batch fits.
            self.backlog = true;
            return;
        }
        // The same for bytes: wait until a quarter of the worker's byte budget is free, rather
        // than claim one row whenever a little room opens (a worker holding nothing claims
        // whatever the budget: its first row goes whatever its size).
        let budget = config.worker_byte_budget();
        let bytes_room = budget.saturating_sub(self.in_flight_bytes);
        if self.in_flight > 0 && bytes_room < budget / 4 && !probe {
            self.backlog = true;
            return;
        }
        // Under a rate cap, the rows this claim may take (a probe's row is not paced).
        let batch = if probe {
            1
        } else {
            match self.shared.pace.take(room.min(config.batch)) {
                Ok(rows) => rows,
                Err(wait) => {
                    // The timer (or a finished publish, or a wake-up) asks again.
                    self.backlog = true;
                    self.schedule_claim(ctx, wait);
                    return;
                }
            }
        };
        // The dispatcher's window, shared with the other workers (a probe's row always fits).
        let mut reservation = if probe {
            self.shared.window.reserve(batch)
        } else {
            match self.shared.window.admit(batch, self.worker, || ctx.address().recipient()) {
                Some(reservation) => reservation,
                None => {
                    // The window wakes this worker when a batch fits again.
                    self.shared.pace.refund(batch);
                    self.backlog = true;
                    return;
                }
            }
        };
        // The cursor over new rows, held by one claim of the dispatcher at a time.
        let Some(mut lease) = self.shared.cursor.take(self.worker, || ctx.address().recipient()) else {
            // The holder wakes this worker when it hands the cursor back.
            if probe {
                self.probe = true;
            } else {
                self.shared.pace.refund(batch);
            }
            drop(reservation);
            self.backlog = true;
            return;
        };
        if let Some(timer) = self.timer.take() {
            ctx.cancel_future(timer);
        }
        self.claiming = true;
        let shared = self.shared.clone();
        let owner = self.owner.clone();
        let heads_after = self.heads_after.clone();
        // A lower bound of the database's `now()` at the claim: the leases run at least until
        // this plus the lease.
        let lease_deadline = Instant::now() + config.lease;
        let began = Instant::now();
        let unanswered =
            self.unanswered.then(|| self.shared.publishing(self.worker).iter().map(|f| f.id).collect::<Vec<_>>());
        // What was handed back is reported even when the claim after it fails.
        let query = async move {
            // Each statement within the pool's query timeout: a silent link fails the claim
            // (the connection dropped) instead of holding the worker.
            let mut conn = match shared.pool.checkout().await {
                Ok(conn) => conn,
                Err(e) => return (None, Err(e)),
            };
            let pool = &shared.pool;
            let released = match unanswered {
                Some(publishing) => {
                    match pool.unit(&mut conn, async |c| store::release_unanswered(c, &owner, &publishing).await).await
                    {
                        Ok(ids) => Some(ids),
                        Err(e) => return (None, Err(e)),
                    }
                }
                None => None,
            };
            let source = match shared.source(&mut conn).await {
                Ok(source) => source,
                Err(e) => return (released, Err(e)),
            };
            if let Err(e) = shared.fifo_index(&mut conn).await {
                return (released, Err(e));
            }
            let claimed = pool
                .unit(&mut conn, async |c| {
                    if lease.cursor().is_none() {
                        lease.start_at(store::horizon(c).await?);
                    }
                    let params = ClaimParams {
                        owner: &owner,
                        batch,
                        max_bytes: bytes_room,
                        lease: shared.config.lease,
                        max_attempts: shared.config.max_attempts,
                        fifo: &shared.config.fifo,
                        cursor: lease.cursor(),
                        heads_after: heads_after.as_ref(),
                    };
                    store::claim(c, &params).await
                })
                .await
                .map(|mut claim| {
                    if let Some((snapshot, taken)) = &claim.cursor
                        && !lease.advance(snapshot, taken)
                    {
                        warn!(snapshot = %snapshot,
                        "the database's transaction ids went back (a failover to a standby that had not received \
                         everything, or a restore): new rows are looked for again from the outbox's horizon");
                    }
                    for message in &mut claim.messages {
                        message.source = source.clone();
                    }
                    claim
                });
            // The cursor goes back (moved on, or as it was if the claim failed) before the
            // answer is handled.
            drop(lease);
            (released, claimed)
        };
        ctx.spawn(query.into_actor(self).map(move |(released, result): (_, Result<_, StoreError>), act, ctx| {
            act.claiming = false;
            if let Some(released) = released {
                act.unanswered = false;
                if !released.is_empty() {
                    Metrics::add(&act.shared.metrics.released, released.len());
                    warn!(worker = %act.owner, rows = released.len(), first_id = released.iter().min(),
                        "a claim's answer was lost with its connection: the rows it leased are pending again");
                }
            }
            match result {
                Ok(claim) => {
                    act.failures = 0;
                    act.shared.db.answered(began);
                    if probe && claim.messages.is_empty() {
                        // Nothing to try the sink with: nothing is lost by opening the gate, and
                        // the next rows find out.
                        act.shared.gate.delivered();
                    }
                    let metrics = &act.shared.metrics;
                    if claim.evicted > 0 {
                        debug!(worker = %act.owner, rows = claim.evicted, "new rows held back by the FIFO gate now wait");
                    }
                    let n = claim.messages.len();
                    if !probe {
                        act.shared.pace.refund(batch - n);
                    }
                    if !probe {
                        act.shared.wakeups.claimed(n, batch);
                    }
                    Metrics::add(&metrics.claimed, n);
                    Metrics::add(&metrics.claims, 1);
                    Metrics::add(&metrics.in_flight, n);
                    if n > 0 {
                        debug!(worker = %act.owner, claimed = n, first_id = claim.messages[0].id,
                            last_id = claim.messages[n - 1].id, "claimed batch");
                    }
                    let bytes: usize = claim.messages.iter().map(OutboxMessage::payload_bytes).sum();
                    act.in_flight_bytes += bytes;
                    Metrics::add(&metrics.in_flight_bytes, bytes);
                    // One address of this actor for the whole batch, shared by its publishes.
                    let owner = Rc::new(ctx.address().recipient());
                    act.shared.publishing(act.worker).extend(claim.messages.iter().map(OutboxMessage::fence));
                    for message in claim.messages {
                        debug!(
                            outbox_id = message.id,
                            lease_version = message.lease_version,
                            attempt = message.attempts,
                            "claimed"
                        );
                        act.in_flight += 1;
                        PublishActor::new(
                            message,
                            act.worker,
                            act.shared.clone(),
                            act.finalizer.clone(),
                            owner.clone(),
                            lease_deadline,
                            reservation.slot(),
                        )
                        .start();
                    }
                    // What the claim did not get is room again before the next claim asks.
                    drop(reservation);
                    match claim.heads {
                        HeadsScan::NotRun => {}
                        HeadsScan::ReachedEnd => act.heads_after = None,
                        HeadsScan::StoppedAfter(key) => act.heads_after = Some(key),
                    }
                    act.backlog = (n == batch || claim.cut_by_budget > 0) && !probe;
                    if act.backlog || std::mem::take(&mut act.woken) {
                        act.claim(ctx);
                    } else {
                        act.schedule_poll(ctx);
                    }
                }
                Err(e) => {
                    if !probe {
                        act.shared.pace.refund(batch);
                    }
                    Metrics::add(&act.shared.metrics.claim_errors, 1);
                    if probe {
                        act.shared.gate.probe_aborted();
                    }
                    act.backlog = false;
                    if e.is_transient() {
                        // The statement may have committed before the connection broke.
                        act.unanswered = true;
                        // What answers next may be another server.
                        act.shared.cursor.forget();
                        act.shared.db.failed("claim", &e);
                        act.failures += 1;
                        let ceiling = CLAIM_RETRY_MIN.saturating_mul(1 << act.failures.min(10)).min(CLAIM_RETRY_MAX);
                        act.schedule_claim(ctx, jittered(ceiling));
                    } else {
                        error!(worker = %act.owner, error = %e, "claim failed; retrying after the poll interval");
                        act.schedule_poll(ctx);
                    }
                }
            }
            // A drain that arrived mid-claim is answered once this claim's rows are done.
            act.answer_drain();
        }));
    }

    /// Answers the drain once nothing is in flight and no claim is running: a claim still in
    /// the database would otherwise commit rows as `processing` after the drain was answered.
    fn answer_drain(&mut self) {
        if self.draining && self.in_flight == 0 && !self.claiming {
            for waiter in self.drain_waiters.drain(..) {
                let _ = waiter.send(());
            }
        }
    }
}

impl Actor for ClaimActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if crate::lifecycle::system_gone() {
            ctx.stop();
            return;
        }
        debug!(worker = %self.owner, "claim actor started");
        self.claim(ctx);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        debug!(worker = %self.owner, index = self.worker, "claim actor stopped");
    }
}

impl Handler<Wake> for ClaimActor {
    type Result = ();

    fn handle(&mut self, _: Wake, ctx: &mut Context<Self>) {
        if self.claiming {
            self.woken = true;
        }
        self.claim(ctx);
    }
}

impl Handler<PublishFinished> for ClaimActor {
    type Result = ();

    fn handle(&mut self, finished: PublishFinished, ctx: &mut Context<Self>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(finished.bytes);
        if self.backlog {
            self.claim(ctx);
        } else if self.shared.config.fifo.is_on() {
            // Under the FIFO gate a claim comes back short while rows wait behind their heads;
            // the row just finalized may have unblocked the next row of its aggregate, so claim
            // now (or right after the running claim, whose snapshot may predate the finalize)
            // rather than after a poll interval: a hot aggregate would otherwise move one row
            // per poll interval.
            if self.claiming {
                self.woken = true;
            }
            self.claim(ctx);
        }
        self.answer_drain();
    }
}

impl Handler<Drain> for ClaimActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Drain, ctx: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        if let Some(timer) = self.timer.take() {
            ctx.cancel_future(timer);
        }
        let (tx, rx) = oneshot::channel();
        self.drain_waiters.push(tx);
        // A claim still running finishes and starts its publishes; they are waited for too.
        self.answer_drain();
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

impl Handler<Probe> for ClaimActor {
    type Result = ();

    fn handle(&mut self, _: Probe, ctx: &mut Context<Self>) {
        if self.draining {
            self.shared.gate.probe_aborted();
            return;
        }
        // A claim running now takes the probe when it returns.
        self.probe = true;
        if self.claiming {
            self.woken = true;
        }
        self.claim(ctx);
    }
}

#[cfg(feature = "test-util")]
impl Handler<Crash> for ClaimActor {
    type Result = ();

    fn handle(&mut self, _: Crash, _: &mut Context<Self>) {
        panic!("claim actor {} crashed on request", self.owner);
    }
}
