//! `PublishActor`: one per claimed message. Calls the sink outside any transaction, bounded by
//! the publish timeout; turns a panic into a crash report; hands the outcome to the finalizer.
//!
//! The sink's health is part of every publish:
//! - a row claimed while the sink went away (the gate closed after the claim) is handed back,
//!   attempt refunded, without calling the sink;
//! - [`PublishError::Unavailable`] closes the gate (claiming pauses) and a delivery opens it;
//! - [`PublishError::Refused`] (a nack) slows the claims (see `pace`), and the row goes back
//!   with its attempt refunded;
//! - at the publish timeout, a sink that says it is [`SinkState::Blocked`] still holds what it
//!   was sent: the publish keeps waiting, its lease kept alive by a heartbeat, instead of
//!   timing out and being published again; a sink that says it is [`SinkState::Down`] turns the
//!   timeout into [`PublishError::Unavailable`].

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures_util::FutureExt;
use tracing::{Instrument, Level, debug, error, span};

use super::finalize::{Fenced, FinalizerSlot, Heartbeat};
use super::pace::Answer;
use super::shared::Shared;
use super::window::Slot;
use crate::error::PublishError;
use crate::metrics::Metrics;
use crate::model::OutboxMessage;
use crate::publisher::{PublishResult, SinkState};
use crate::step::{decide, release};

/// The level of the per-message `publish` span (fields `outbox_id`, `lease_version`, `attempt`,
/// `event_type`).
///
/// `DEBUG`, so that the default `info` logging does not pay for a span per message: an
/// enabled span costs the dispatcher a large share of its CPU per message (docs/benchmarks.md),
/// because the text formatter renders its fields for every message. The
/// events at `info` and above inside it name the row themselves. With the `opentelemetry`
/// feature it is `INFO`: there it is the message's span in the producer's trace.
const PUBLISH_SPAN_LEVEL: Level = if cfg!(feature = "opentelemetry") { Level::INFO } else { Level::DEBUG };

/// Sent to the claim actor when a message no longer counts against its in-flight window.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct PublishFinished {
    /// The payload bytes the message held against the worker's byte budget.
    pub(crate) bytes: usize,
}

pub(crate) struct PublishActor {
    message: Arc<OutboxMessage>,
    /// The index of the worker that claimed it.
    worker: usize,
    shared: Arc<Shared>,
    finalizer: Arc<FinalizerSlot>,
    /// The claim actor, shared by every message of one claimed batch (an address per message
    /// would cost three allocations each).
    owner: Rc<Recipient<PublishFinished>>,
    /// Shared by the publish and its heartbeat timer.
    lease: Rc<LeaseState>,
    /// The message's place in the dispatcher's window, moved into the publish when it starts.
    slot: Option<Slot>,
}

/// What the publish and its heartbeat timer both know of the claim's lease.
struct LeaseState {
    /// Until when the claim's lease surely runs (local clock, a lower bound; a heartbeat moves
    /// it on): the finalizer retries a failing database until then.
    deadline: Cell<Instant>,
    /// The outcome is decided: no heartbeat may follow it (applied after the outcome, it would
    /// find the row finalized and report a lost lease).
    decided: Cell<bool>,
}

impl std::fmt::Debug for PublishActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishActor").field("id", &self.message.id).finish()
    }
}

impl PublishActor {
    pub(crate) fn new(
        message: OutboxMessage,
        worker: usize,
        shared: Arc<Shared>,
        finalizer: Arc<FinalizerSlot>,
        owner: Rc<Recipient<PublishFinished>>,
        lease_deadline: Instant,
        slot: Slot,
    ) -> Self {
        Self {
            message: Arc::new(message),
            worker,
            shared,
            finalizer,
            owner,
            lease: Rc::new(LeaseState { deadline: Cell::new(lease_deadline), decided: Cell::new(false) }),
            slot: Some(slot),
        }
    }
}

/// How the sink call ended.
enum Attempt {
    Finished(PublishResult),
    /// The sink panicked: we do not know whether the message left.
    Crashed(String),
}

impl Actor for PublishActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if crate::lifecycle::system_gone() {
            ctx.stop();
            return;
        }
        let message = self.message.clone();
        let span = span!(PUBLISH_SPAN_LEVEL, "publish", outbox_id = message.id, lease_version = message.lease_version,
            attempt = message.attempts, event_type = %message.event_type);
        // The producer's trace context (`NewEvent::with_trace_context`) parents the publish.
        #[cfg(feature = "opentelemetry")]
        crate::trace::set_parent_from(&span, &message.headers);

        // A sink slower than a third of the lease keeps its claim alive (fenced). When the
        // publish timeout ends every publish before that mark (the default: 10 s against 20 s),
        // no heartbeat could ever fire, so the timer is not armed at all: one timer less per
        // message. A publish held past its timeout by a blocked broker sends its own heartbeats.
        let heartbeat_every = self.shared.config.lease / 3;
        if self.shared.config.publish_timeout >= heartbeat_every {
            let fence = message.fence();
            ctx.run_interval(heartbeat_every, move |act, _| {
                if act.lease.decided.get() {
                    return;
                }
                act.lease.deadline.set(Instant::now() + act.shared.config.lease);
                act.finalizer.do_send(Heartbeat(fence));
            });
        }

        let shared = self.shared.clone();
        let finalizer = self.finalizer.clone();
        let owner = self.owner.clone();
        let lease = self.lease.clone();
        let worker = self.worker;
        let bytes = message.payload_bytes();
        let slot = self.slot.take();
        let work = async move {
            let step = if shared.gate.may_publish() {
                match call_sink(&shared, &message, &finalizer, &lease.deadline).await {
                    Attempt::Crashed(why) => {
                        Metrics::add(&shared.metrics.publish_crashes, 1);
                        error!(outbox_id = message.id, lease_version = message.lease_version, panic = %why,
                            "sink panicked; the row stays processing until its lease expires");
                        None
                    }
                    Attempt::Finished(result) => {
                        match &result {
                            Ok(()) => {
                                Metrics::add(&shared.metrics.published, 1);
                                shared.metrics.delivery_lag(message.created_at);
                                shared.gate.delivered();
                            }
                            Err(e) if e.is_unavailable() => {
                                if shared.gate.unavailable(&e.to_string()) {
                                    Metrics::add(&shared.metrics.sink_outages, 1);
                                }
                            }
                            Err(_) => {}
                        }
                        debug!(outcome = ?result, "published");
                        Some(decide(&message, &result, &shared.config))
                    }
                }
            } else {
                debug!("the sink is unavailable: handing the row back unsent");
                Some(release(message.fence(), "released unsent: the sink was unavailable".into()))
            };
            lease.decided.set(true);
            if let Some(step) = step {
                match finalizer.finalize(step, lease.deadline.get()).await {
                    Fenced::Won | Fenced::Lost => {}
                    Fenced::Failed => error!(
                        outbox_id = message.id,
                        lease_version = message.lease_version,
                        "finalize failed; the row waits for lease expiry"
                    ),
                }
            }
            // The message is dropped with this future: its bytes are free. The gauges go down
            // here rather than in the claim actor, which may have died (and been replaced) since.
            shared.publishing(worker).remove(&message.fence());
            drop(message);
            Metrics::sub(&shared.metrics.in_flight, 1);
            Metrics::sub(&shared.metrics.in_flight_bytes, bytes);
            // Room in the window before the claim actor hears of it and claims again.
            drop(slot);
            owner.do_send(PublishFinished { bytes });
        }
        .instrument(span);
        ctx.spawn(work.into_actor(self).map(|(), _, ctx| ctx.stop()));
    }
}

/// Calls the sink, bounded by the publish timeout, which a blocked sink suspends.
async fn call_sink(
    shared: &Shared,
    message: &Arc<OutboxMessage>,
    finalizer: &FinalizerSlot,
    lease_deadline: &Cell<Instant>,
) -> Attempt {
    let timeout = shared.config.publish_timeout;
    // The sink is called inside the guarded future, so a panic while building its future is
    // caught as well as one while polling it.
    let call = {
        let (publisher, message) = (shared.publisher.clone(), message.clone());
        async move { publisher.publish(message).await }
    };
    let mut call = pin!(AssertUnwindSafe(call).catch_unwind());
    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut held = Duration::ZERO;
    let started = Instant::now();
    loop {
        match tokio::time::timeout_at(deadline, call.as_mut()).await {
            Ok(Ok(result)) => {
                let took = started.elapsed();
                shared.metrics.publish_seconds(took.as_secs_f64());
                let answer = match &result {
                    Err(PublishError::Retryable(_) | PublishError::Unavailable(_)) => Answer::PushedBack,
                    Err(PublishError::Refused(_)) => {
                        Metrics::add(&shared.metrics.refused, 1);
                        Answer::Refused
                    }
                    Ok(()) | Err(PublishError::Permanent(_) | PublishError::Defer { .. }) => Answer::Taken,
                };
                answered(shared, answer, took);
                return Attempt::Finished(result);
            }
            Err(_elapsed) => match shared.publisher.state() {
                SinkState::Blocked(why) => {
                    // What the sink was sent is held, not lost: wait, and keep the claim alive
                    // (the heartbeat is fenced, so a lost lease is reported, never overwritten).
                    held += timeout;
                    debug!(blocked = %why, held = ?held, "publish held by a blocked sink; still waiting");
                    finalizer.do_send(Heartbeat(message.fence()));
                    lease_deadline.set(Instant::now() + shared.config.lease);
                    deadline += timeout;
                }
                SinkState::Down(why) => {
                    answered(shared, Answer::PushedBack, started.elapsed());
                    return Attempt::Finished(Err(PublishError::Unavailable(format!(
                        "no answer within {} and the sink is down: {why}",
                        humantime::format_duration(timeout)
                    ))));
                }
                // Just unblocked: what it held is still being confirmed; give it a timeout more.
                SinkState::Up if shared.gate.blocked_within(timeout) => {
                    debug!("publish held by a sink that was blocked until just now; still waiting");
                    deadline += timeout;
                }
                SinkState::Up => {
                    answered(shared, Answer::PushedBack, started.elapsed());
                    return Attempt::Finished(Err(PublishError::Retryable(format!(
                        "publish timed out after {}",
                        humantime::format_duration(timeout)
                    ))));
                }
            },
            Ok(Err(panic)) => return Attempt::Crashed(panic_text(&*panic)),
        }
    }
}

/// Counts a sink answer for the pace's pushback and the window's delay.
fn answered(shared: &Shared, answer: Answer, took: Duration) {
    shared.pace.answered(answer, took);
    shared.window.answered(took);
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}
