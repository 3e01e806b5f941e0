//! `FinalizeActor`: applies fenced writes in batches and reports who lost their lease.
//!
//! Publish actors send one [`Finalize`] each and wait for its [`Fenced`] answer. The actor
//! group-commits: while one flush runs, new requests queue, and the next flush takes them all
//! (one statement per outcome kind), so a busy dispatcher finalizes hundreds of rows per round
//! trip while an idle one finalizes a lone row at once.
//!
//! A database that fails (an outage, a failover) does not cost the rows their lease: a flush
//! keeps its fences and retries with capped, jittered backoff for as long as the leases of its
//! rows run, so that rows already published become `done` when the database is back, instead
//! of waiting for their lease to expire and being published again. The outage is logged once
//! (see [`DbHealth`](super::shared::DbHealth)).
//!
//! The actor's address lives in a [`FinalizerSlot`]: when it dies, the supervisor puts a new one
//! there (while draining too), and a publish whose request died with the old one sends it again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use rand::RngExt;
use tokio::sync::oneshot;
use tracing::{debug, error, warn};

use super::shared::Shared;
use crate::config::{Fifo, Retention};
use crate::error::StoreError;
use crate::metrics::Metrics;
use crate::model::{Fence, Status};
use crate::step::Step;
use crate::store;

/// Whether a fenced write took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fenced {
    /// The row was written.
    Won,
    /// The row had been taken over (or was no longer processing): nothing written.
    Lost,
    /// The database kept failing until the lease ran out; the row stays `processing` until its
    /// lease expires.
    Failed,
}

/// Apply one fenced write and answer on `reply`. A reply dropped unanswered means the actor died
/// holding it (send it again to its replacement).
///
/// The answer travels on a channel of the request's own rather than as the handler's result:
/// one channel per row instead of actix's request channel plus a boxed response future.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Finalize {
    pub(crate) step: Step,
    /// Retry a failing database until then (the claim's lease, local clock).
    pub(crate) lease_deadline: Instant,
    pub(crate) reply: Reply,
}

/// Where a [`Finalize`] is answered.
pub(crate) type Reply = oneshot::Sender<Fenced>;

/// Extend one claim's lease (a publish running long).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Heartbeat(pub(crate) Fence);

/// Resolves once every queued write has been flushed.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Flushed;

#[cfg(feature = "test-util")]
/// Panics inside the finalizer's handler, to exercise the supervisor's restart path.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Crash;

#[cfg(feature = "test-util")]
impl Handler<Crash> for FinalizeActor {
    type Result = ();

    fn handle(&mut self, _: Crash, _: &mut Context<Self>) {
        panic!("finalize actor crashed on request ({} writes queued)", self.queue.len());
    }
}

/// Where the current finalize actor is, for everyone who sends to it.
#[derive(Debug)]
pub(crate) struct FinalizerSlot(Mutex<Addr<FinalizeActor>>);

/// How long a publish waits before sending its write again to a replaced finalizer (the
/// supervisor's watchdog replaces a dead one within 200 ms).
const RESEND_PAUSE: Duration = Duration::from_millis(50);

impl FinalizerSlot {
    pub(crate) fn new(addr: Addr<FinalizeActor>) -> Self {
        Self(Mutex::new(addr))
    }

    /// The current finalizer.
    pub(crate) fn get(&self) -> Addr<FinalizeActor> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sends `message` to the current finalizer without waiting for an answer. The send happens
    /// under the slot's lock: no copy of the address (two allocations each) per message.
    pub(crate) fn do_send<M>(&self, message: M)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        FinalizeActor: Handler<M>,
    {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).do_send(message);
    }

    /// Puts a new finalizer in place of a dead one.
    pub(crate) fn set(&self, addr: Addr<FinalizeActor>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = addr;
    }

    /// Applies `step`, sending it again to the replacement when the finalizer died holding it.
    pub(crate) async fn finalize(&self, step: Step, lease_deadline: Instant) -> Fenced {
        loop {
            let (reply, answer) = oneshot::channel();
            self.do_send(Finalize { step: step.clone(), lease_deadline, reply });
            match answer.await {
                Ok(fenced) => return fenced,
                Err(_) if Instant::now() < lease_deadline => {
                    debug!("the finalizer died holding this write; sending it to its replacement");
                    tokio::time::sleep(RESEND_PAUSE).await;
                }
                Err(_) => return Fenced::Failed,
            }
        }
    }
}

pub(crate) struct FinalizeActor {
    shared: Arc<Shared>,
    queue: Vec<Finalize>,
    heartbeats: Vec<Fence>,
    flushing: bool,
    /// The flush a lone write waits for while the rest of its claim's rows report (see
    /// [`GATHER`]).
    gathering: Option<SpawnHandle>,
    idle_waiters: Vec<oneshot::Sender<()>>,
}

/// How long a `done` mark that finds the finalizer idle waits for the other rows in flight
/// before it is flushed alone (other outcomes go at once).
///
/// A claim's rows are confirmed by the broker in a few groups, a millisecond or two apart, and
/// flushing each group as it came cost a statement (and a commit) for each group: several a
/// claim in steady traffic. Waiting until every row in flight has reported, or this long,
/// makes it one statement a claim. It delays only the `done` mark: the message has left, and a
/// consumer's latency does not change. Under the FIFO gate nothing waits (an aggregate's next
/// row waits for this one's `done`).
pub(crate) const GATHER: Duration = Duration::from_millis(3);

impl FinalizeActor {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            queue: Vec::new(),
            heartbeats: Vec::new(),
            flushing: false,
            gathering: None,
            idle_waiters: Vec::new(),
        }
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        if self.flushing {
            return;
        }
        if self.queue.is_empty() && self.heartbeats.is_empty() {
            for waiter in self.idle_waiters.drain(..) {
                let _ = waiter.send(());
            }
            return;
        }
        if let Some(timer) = self.gathering.take() {
            ctx.cancel_future(timer);
        }
        self.flushing = true;
        let take = self.queue.len().min(self.shared.config.finalize_batch);
        let batch: Vec<_> = self.queue.drain(..take).collect();
        let heartbeats = std::mem::take(&mut self.heartbeats);
        let shared = self.shared.clone();
        ctx.spawn(async move { apply(&shared, batch, heartbeats).await }.into_actor(self).map(|(), act, ctx| {
            act.flushing = false;
            act.flush(ctx);
        }));
    }
}

impl std::fmt::Debug for FinalizeActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinalizeActor").field("queued", &self.queue.len()).field("flushing", &self.flushing).finish()
    }
}

impl Actor for FinalizeActor {
    type Context = Context<Self>;
}

impl Handler<Finalize> for FinalizeActor {
    type Result = ();

    fn handle(&mut self, msg: Finalize, ctx: &mut Context<Self>) {
        // The reply is dropped unanswered only if the actor dies first.
        let done = matches!(msg.step, Step::Done(_));
        self.queue.push(msg);
        if self.flushing {
            // The flush running takes it next.
            return;
        }
        // Only `done` marks wait: a retry, a release or a dead row changes what claims and
        // probes find next, and is rare in steady traffic.
        if !done || self.gathered() {
            self.flush(ctx);
        } else if self.gathering.is_none() {
            self.gathering = Some(ctx.run_later(GATHER, |act, ctx| {
                act.gathering = None;
                act.flush(ctx);
            }));
        }
    }
}

impl FinalizeActor {
    /// Whether the queued writes go now rather than wait for more (see [`GATHER`]): every row
    /// in flight has reported, or a claim's batch is queued, or the FIFO gate is on.
    fn gathered(&self) -> bool {
        let config = &self.shared.config;
        let queued = self.queue.len();
        config.fifo != Fifo::Off
            || queued >= config.batch.min(config.finalize_batch)
            || queued as u64 >= Metrics::value(&self.shared.metrics.in_flight)
    }
}

impl Handler<Heartbeat> for FinalizeActor {
    type Result = ();

    fn handle(&mut self, msg: Heartbeat, ctx: &mut Context<Self>) {
        self.heartbeats.push(msg.0);
        self.flush(ctx);
    }
}

impl Handler<Flushed> for FinalizeActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Flushed, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.idle_waiters.push(tx);
        self.flush(ctx);
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

/// First pause before retrying a failed statement; it doubles (with jitter) up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(50);
/// Longest pause between two tries, so that a database that comes back is used within it.
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Runs `f` on a pooled connection, retrying transient failures with capped, jittered backoff
/// until `deadline` (the earliest lease of the rows written), or the shutdown's deadline if
/// that comes first. Each try is bounded by the pool's query timeout: a silent link costs a try,
/// and the next one runs on another connection. The flag says whether an earlier try failed
/// mid-way: its write may have committed before the connection dropped, so rows the returned
/// try did not win may be rows that try already wrote (see [`settled_before`]).
async fn with_retry<T, F>(shared: &Shared, what: &str, deadline: Instant, mut f: F) -> (Result<T, StoreError>, bool)
where
    F: AsyncFnMut(&mut diesel_async::AsyncPgConnection) -> Result<T, StoreError>,
{
    let mut tries = 0_u32;
    let mut ceiling = RETRY_MIN;
    loop {
        let deadline = shared.drain_by.get().map_or(deadline, |&by| by.min(deadline));
        let drain_by = shared.drain_by.get().copied();
        let began = Instant::now();
        let result = match shared.pool.checkout_until(drain_by).await {
            Ok(mut conn) => shared.pool.unit_until(&mut conn, drain_by, async |c| f(c).await).await,
            Err(e) => Err(e),
        };
        match result {
            Err(e) if e.is_transient() && Instant::now() + ceiling < deadline => {
                tries += 1;
                Metrics::add(&shared.metrics.finalize_retries, 1);
                shared.db.failed(what, &e);
                let pause = ceiling.mul_f64(rand::rng().random_range(0.5..=1.0));
                debug!(error = %e, tries, retry_in = ?pause, "{what} failed; retrying with the same fences");
                tokio::time::sleep(pause).await;
                ceiling = (ceiling * 2).min(RETRY_MAX);
            }
            other => {
                if other.is_ok() {
                    shared.db.answered(began);
                }
                return (other, tries > 0);
            }
        }
    }
}

/// After a retried write: the rows of `fences` outside `won` that an earlier try wrote, by how
/// they stand now (see [`store::settled`]) in a state that `wrote` accepts. Without this, a
/// write whose commit outlived its connection would be reported as a lost lease.
async fn settled_before(
    shared: &Shared,
    fences: impl Iterator<Item = Fence>,
    won: &HashSet<i64>,
    wrote: impl Fn(Option<Status>) -> bool,
) -> Vec<(i64, Option<Status>)> {
    let unsure: Vec<Fence> = fences.filter(|f| !won.contains(&f.id)).collect();
    if unsure.is_empty() {
        return Vec::new();
    }
    let deadline = Instant::now() + RETRY_MAX * 10;
    let (settled, _) =
        with_retry(shared, "read back a retried write", deadline, async |c| store::settled(c, &unsure).await).await;
    match settled {
        Ok(rows) => {
            let rows: Vec<_> = rows.into_iter().filter(|&(_, now)| wrote(now)).collect();
            if !rows.is_empty() {
                debug!(rows = rows.len(), "an earlier try of a retried write had committed");
            }
            rows
        }
        Err(e) => {
            warn!(error = %e, rows = unsure.len(), "cannot read back a retried write; its rows count as lost leases");
            Vec::new()
        }
    }
}

/// After a retried `mark done`, `delete done rows` or `mark dead`: adds to the ids won those of
/// `fences` that an earlier try had already written, as `wrote` recognises them.
async fn add_settled(
    shared: &Shared,
    result: &mut Result<Vec<i64>, StoreError>,
    fences: impl Iterator<Item = Fence>,
    wrote: impl Fn(Option<Status>) -> bool,
) {
    if let Ok(won) = result {
        let seen = won.iter().copied().collect();
        let earlier = settled_before(shared, fences, &seen, wrote).await;
        won.extend(earlier.into_iter().map(|(id, _)| id));
    }
}

async fn apply(shared: &Shared, batch: Vec<Finalize>, mut heartbeats: Vec<Fence>) {
    let metrics = &shared.metrics;
    let mut done = Vec::new();
    let mut resched = Vec::new();
    let mut dead = Vec::new();
    let mut replies = std::collections::HashMap::with_capacity(batch.len());
    let deadline = batch.iter().map(|f| f.lease_deadline).min().unwrap_or_else(Instant::now);
    for Finalize { step: op, reply, .. } in batch {
        let fence = op.fence();
        replies.insert(fence, reply);
        match op {
            Step::Done(f) => done.push(f),
            Step::Reschedule(r) => resched.push(r),
            Step::Dead(b) => dead.push(b),
        }
    }

    // A heartbeat queued beside its row's outcome is moot: the outcome ends the lease (and,
    // applied after it, the heartbeat would find the row finalized and report a lost lease).
    heartbeats.retain(|fence| !replies.contains_key(fence));

    // `won` is None when the statement failed: the rows' fate is unknown until lease expiry.
    let mut answer = |fences: &mut dyn Iterator<Item = Fence>, won: Option<&[i64]>| {
        // A set, not `won.contains`: a flush of n rows would otherwise cost n² comparisons.
        let won: Option<HashSet<i64>> = won.map(|w| w.iter().copied().collect());
        for fence in fences {
            let fenced = match &won {
                Some(won) if won.contains(&fence.id) => Fenced::Won,
                Some(_) => {
                    Metrics::add(&metrics.lost_leases, 1);
                    warn!(
                        outbox_id = fence.id,
                        lease_version = fence.lease_version,
                        "lost lease: the row was taken over or finalized by someone else; nothing written"
                    );
                    Fenced::Lost
                }
                None => Fenced::Failed,
            };
            if let Some(reply) = replies.remove(&fence) {
                let _ = reply.send(fenced);
            }
        }
    };

    if !done.is_empty() {
        let delete = shared.config.retention == Retention::Delete;
        let what = if delete { "delete done rows" } else { "mark done" };
        let (mut result, in_doubt) = with_retry(shared, what, deadline, async |c| {
            if delete { store::delete_done(c, &done).await } else { store::mark_done(c, &done).await }
        })
        .await;
        if in_doubt {
            // Deleted rows are gone; kept ones are `done`.
            let wrote = if delete { None } else { Some(Status::Done) };
            add_settled(shared, &mut result, done.iter().copied(), |now| now == wrote).await;
        }
        match &result {
            Ok(won) => {
                Metrics::add(&metrics.finalizes, 1);
                Metrics::add(&metrics.done, won.len());
            }
            Err(e) => report_failure(shared, "mark done", done.len(), e),
        }
        answer(&mut done.iter().copied(), result.as_deref().ok());
    }
    if !resched.is_empty() {
        let (mut result, in_doubt) =
            with_retry(shared, "reschedule", deadline, async |c| store::reschedule(c, &resched).await).await;
        if in_doubt && let Ok(rows) = &mut result {
            let seen = rows.iter().map(|r| r.id).collect();
            let fences = resched.iter().map(|r| r.fence);
            let earlier =
                settled_before(shared, fences, &seen, |s| matches!(s, Some(Status::Pending | Status::Dead))).await;
            rows.extend(
                earlier.into_iter().filter_map(|(id, status)| Some(store::Rescheduled { id, status: status? })),
            );
        }
        let ids: Option<Vec<i64>> = match &result {
            Ok(rows) => {
                Metrics::add(&metrics.finalizes, 1);
                // A deferral refunds and may age out; a release (an outage, a row never sent)
                // refunds and never does.
                let deferred: HashSet<i64> =
                    resched.iter().filter(|r| r.dead_if_older_than.is_some()).map(|r| r.fence.id).collect();
                let released: HashSet<i64> = resched
                    .iter()
                    .filter(|r| r.refund_attempt && r.dead_if_older_than.is_none())
                    .map(|r| r.fence.id)
                    .collect();
                let writes: HashMap<i64, &store::Reschedule> = resched.iter().map(|r| (r.fence.id, r)).collect();
                for row in rows {
                    let counter = match row.status {
                        Status::Dead => &metrics.dead,
                        _ if deferred.contains(&row.id) => &metrics.deferred,
                        _ if released.contains(&row.id) => &metrics.released,
                        _ => {
                            // One line per retry at the default level: the row says what
                            // failed (`last_error`) only until its next outcome is written.
                            if let Some(r) = writes.get(&row.id) {
                                warn!(outbox_id = row.id, lease_version = r.fence.lease_version,
                                    retry_in = %humantime::format_duration(round_ms(r.delay)), error = %r.error,
                                    "publish failed; the row is pending again");
                            }
                            &metrics.retried
                        }
                    };
                    Metrics::add(counter, 1);
                }
                Some(rows.iter().map(|r| r.id).collect())
            }
            Err(e) => {
                report_failure(shared, "reschedule", resched.len(), e);
                None
            }
        };
        answer(&mut resched.iter().map(|r| r.fence), ids.as_deref());
    }
    if !dead.is_empty() {
        let (mut result, in_doubt) =
            with_retry(shared, "mark dead", deadline, async |c| store::mark_dead(c, &dead).await).await;
        if in_doubt {
            add_settled(shared, &mut result, dead.iter().map(|b| b.fence), |now| now == Some(Status::Dead)).await;
        }
        match &result {
            Ok(won) => {
                Metrics::add(&metrics.finalizes, 1);
                Metrics::add(&metrics.dead, won.len());
                for b in dead.iter().filter(|b| won.contains(&b.fence.id)) {
                    warn!(outbox_id = b.fence.id, lease_version = b.fence.lease_version, error = %b.error, "row is dead");
                }
            }
            Err(e) => report_failure(shared, "mark dead", dead.len(), e),
        }
        answer(&mut dead.iter().map(|b| b.fence), result.as_deref().ok());
    }
    if !heartbeats.is_empty() {
        let lease = shared.config.lease;
        // Extending a lease again is harmless, so a retried heartbeat needs no read-back.
        let deadline = Instant::now() + lease / 3;
        match with_retry(shared, "lease heartbeat", deadline, async |c| {
            store::extend_leases(c, &heartbeats, lease).await
        })
        .await
        .0
        {
            Ok(won) => {
                for f in heartbeats.iter().filter(|f| !won.contains(&f.id)) {
                    Metrics::add(&metrics.lost_leases, 1);
                    warn!(
                        outbox_id = f.id,
                        lease_version = f.lease_version,
                        "lost lease during a slow publish: another worker owns the row now; this publish is a duplicate"
                    );
                }
                debug!(extended = won.len(), "lease heartbeat");
            }
            Err(e) => report_failure(shared, "lease heartbeat", heartbeats.len(), &e),
        }
    }
}

fn report_failure(shared: &Shared, what: &str, rows: usize, e: &StoreError) {
    Metrics::add(&shared.metrics.finalize_errors, 1);
    error!(error = %e, rows, "{what} failed; the rows stay processing and are reclaimed when their lease expires");
}

/// `d` to whole milliseconds, for logs.
fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}
