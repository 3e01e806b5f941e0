//! `InboxConsumer`: consumes the queue, applies each delivery in its own transaction (inbox row
//! first, then the handler), and only then acknowledges it.
//!
//! Deliveries go to one of `concurrency` lanes, chosen by aggregate, so that messages of one
//! aggregate are handled one after the other in arrival order while other aggregates proceed.
//! Each lane runs one delivery at a time as a future of this actor. A delivery stays "in hand"
//! from its arrival until it is acknowledged, forwarded (a retry copy or a dead letter, then
//! acknowledged), given back (`nack` with requeue, at shutdown only) or abandoned (its channel
//! died, so the broker delivers it again).
//!
//! The broker link lives on a thread of its own (see `link`); when its consumer stream ends
//! without a shutdown, the link is dropped and a new one is made after a backoff. Deliveries
//! still in hand finish on their old channel: their acknowledgement fails, the broker delivers
//! them again, and the inbox row of any that committed makes the new copy a duplicate.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use diesel_async::AsyncConnection;
use futures_util::{FutureExt, StreamExt};
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicNackOptions};
use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Channel};
use tokio::sync::{oneshot, watch};
use tracing::{Instrument, debug, error, info, info_span, warn};

use super::config::{InboxConfig, LateEvents};
use super::handler::{FailureClass, HandlerError, InboxHandler};
use super::link::{Link, PublishFailure, publish_confirmed};
use super::message::{
    ATTEMPT_HEADER, CONSUMER_HEADER, ERROR_HEADER, EXCHANGE_HEADER, InboxMessage, LAST_ERROR_HEADER, QUEUE_HEADER,
    ROUTING_KEY_HEADER,
};
use super::metrics::Counters;
use super::store::{self, AggregateOrder};
use crate::amqp::Reconnect;
use crate::backoff::half_jitter;
use crate::error::StoreError;
use crate::store::PgPool;

/// How long a shutdown waits for the broker to confirm the consumer's cancellation (and so for
/// the last prefetched deliveries to arrive) before it goes on without it.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest reason carried in a header.
const MAX_REASON_BYTES: usize = 4096;
/// Bound on an acknowledgement (lapin's settle of a channel that died can be slow to come).
const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// Once a shutdown started, how much longer a delivery may wait for a pooled connection before
/// it is given back to the broker (a healthy pool answers far sooner; a dead database would
/// otherwise hold the shutdown for the pool's whole checkout timeout).
const DRAIN_CHECKOUT_GRACE: Duration = Duration::from_secs(2);
/// What a whole transaction may take beyond the handler's timeout (the inbox's statements and
/// the commit) before the database counts as unreachable: a connection that went silent
/// without closing would otherwise hold its delivery for ever.
const STATEMENTS_GRACE: Duration = Duration::from_secs(30);

/// What every consumer actor of one supervisor shares.
pub(crate) struct Shared {
    pub(crate) config: InboxConfig,
    pub(crate) pool: PgPool,
    pub(crate) handler: Arc<dyn InboxHandler>,
    pub(crate) counters: Counters,
    /// The last attempt (on any lane) found the database unreachable; cleared by the next
    /// success. During a shutdown, deliveries are then given back without trying.
    pub(crate) database_out: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("config", &self.config).field("pool", &self.pool).finish_non_exhaustive()
    }
}

/// Stop consuming, finish what is in hand, close the link; resolves when all that is done.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// Panics inside the actor, so that tests and drills can watch the supervisor replace it.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Crash;

/// What the link's consumer stream yields, tagged with the link's generation.
enum LinkEvent {
    Delivery(u64, Box<Result<Delivery, lapin::Error>>),
    /// The stream ended: the consumer was cancelled (by us or by the broker) or its channel died.
    Ended(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    /// Shutdown asked: no new link, the consumer cancelled, deliveries in hand finishing.
    Draining,
    /// Everything settled; the link is closing.
    Closing,
    Stopped,
}

struct Session {
    link: Link,
    tag: ShortString,
    generation: u64,
    /// The consumer stream has not ended yet.
    consuming: bool,
    since: Instant,
}

/// Where a delivery came from and how to settle it.
struct Envelope {
    /// The link it came on.
    generation: u64,
    acker: Acker,
    channel: Channel,
    properties: BasicProperties,
    /// The exchange and routing key it was first published with.
    exchange: String,
    routing_key: String,
    attempt: u32,
}

/// A usable delivery waiting for, or going through, its lane.
struct Job {
    envelope: Envelope,
    message: InboxMessage,
}

#[derive(Default)]
struct Lane {
    busy: bool,
    queue: VecDeque<Job>,
}

/// How a delivery left our hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Handled,
    LateFlagged,
    Duplicate,
    LateSkipped,
    Retried,
    DeadLettered,
    /// Given back unhandled at shutdown.
    Requeued,
    /// Its channel died before it could be acknowledged: the broker delivers it again.
    Abandoned,
}

/// What a lane's run of one job produced.
enum Processed {
    Settled(Settled),
    /// A retryable failure with attempts left: republish after `delay` (off the lane).
    Retry {
        job: Box<Job>,
        delay: Duration,
        reason: String,
    },
}

pub(crate) struct InboxConsumer {
    shared: Arc<Shared>,
    state: State,
    session: Option<Session>,
    /// Links opened by this actor so far.
    generation: u64,
    connecting: Option<SpawnHandle>,
    reconnect_timer: Option<SpawnHandle>,
    /// The reconnect backoff, counting link failures.
    reconnect: Reconnect,
    lanes: Vec<Lane>,
    in_hand: usize,
    /// Deliveries in hand per link generation.
    held: HashMap<u64, usize>,
    /// Links whose stream ended, kept until the deliveries they carried are settled (their
    /// acknowledgements fail on the dead channel, but only while its runtime lives).
    retired: HashMap<u64, Link>,
    draining: watch::Sender<bool>,
    drain_waiters: Vec<oneshot::Sender<()>>,
}

impl std::fmt::Debug for InboxConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxConsumer")
            .field("consumer", &self.shared.config.consumer)
            .field("queue", &self.shared.config.queue)
            .field("state", &self.state)
            .field("in_hand", &self.in_hand)
            .finish()
    }
}

impl InboxConsumer {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        let lanes = (0..shared.config.concurrency).map(|_| Lane::default()).collect();
        Self {
            reconnect: Reconnect::new(shared.config.reconnect_min, shared.config.reconnect_max),
            shared,
            state: State::Running,
            session: None,
            generation: 0,
            connecting: None,
            reconnect_timer: None,
            lanes,
            in_hand: 0,
            held: HashMap::new(),
            retired: HashMap::new(),
            draining: watch::channel(false).0,
            drain_waiters: Vec::new(),
        }
    }

    fn connect(&mut self, ctx: &mut Context<Self>) {
        if self.state != State::Running || self.connecting.is_some() || self.session.is_some() {
            return;
        }
        let config = &self.shared.config;
        let tag = consumer_tag(&config.consumer, self.generation + 1);
        let open = Link::open(config.clone(), tag);
        self.connecting = Some(ctx.spawn(open.into_actor(self).map(|opened, act, ctx| act.opened(opened, ctx))));
    }

    fn opened(&mut self, opened: Result<(Link, lapin::Consumer), String>, ctx: &mut Context<Self>) {
        self.connecting = None;
        let (link, consumer) = match opened {
            Ok(opened) => opened,
            Err(reason) => {
                warn!(consumer = %self.shared.config.consumer, queue = %self.shared.config.queue, reason = %reason,
                    "inbox consumer could not connect; trying again");
                self.schedule_reconnect(ctx);
                return;
            }
        };
        if self.state != State::Running {
            ctx.spawn(link.close().into_actor(self));
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        if generation > 1 {
            Counters::add(&self.shared.counters.reconnects, 1);
            info!(queue = %self.shared.config.queue, "inbox consumer reconnected");
        } else {
            info!(consumer = %self.shared.config.consumer, queue = %self.shared.config.queue,
                prefetch = self.shared.config.prefetch, concurrency = self.shared.config.concurrency,
                "inbox consumer consuming");
        }
        self.shared.counters.set_connected(true);
        let tag = consumer.tag();
        let events = consumer
            .map(move |delivery| LinkEvent::Delivery(generation, Box::new(delivery)))
            .chain(futures_util::stream::once(async move { LinkEvent::Ended(generation) }));
        ctx.add_stream(events);
        self.session = Some(Session { link, tag, generation, consuming: true, since: Instant::now() });
    }

    fn schedule_reconnect(&mut self, ctx: &mut Context<Self>) {
        if self.state != State::Running {
            return;
        }
        let delay = self.reconnect.next_delay();
        debug!(delay = ?delay, "inbox consumer reconnects after a pause");
        self.reconnect_timer = Some(ctx.run_later(delay, |act, ctx| {
            act.reconnect_timer = None;
            act.connect(ctx);
        }));
    }

    fn stream_ended(&mut self, generation: u64, ctx: &mut Context<Self>) {
        let Some(session) = &mut self.session else { return };
        if session.generation != generation {
            return;
        }
        session.consuming = false;
        if self.state == State::Running {
            let session = self.session.take().expect("checked above");
            self.shared.counters.set_connected(false);
            warn!(queue = %self.shared.config.queue, in_hand = self.in_hand,
                "inbox consumer lost its broker link; unacknowledged deliveries come again; reconnecting");
            self.reconnect.lost_after(session.since.elapsed());
            if self.held.get(&generation).copied().unwrap_or(0) > 0 {
                self.retired.insert(generation, session.link);
            }
            self.schedule_reconnect(ctx);
        } else {
            self.check_drained(ctx);
        }
    }

    fn received(&mut self, mut delivery: Delivery, ctx: &mut Context<Self>) {
        // Deliveries come from the current session's stream (checked by the caller).
        let Some((channel, generation)) = self.session.as_ref().map(|s| (s.link.channel.clone(), s.generation)) else {
            return;
        };
        Counters::add(&self.shared.counters.received, 1);
        self.in_hand += 1;
        *self.held.entry(generation).or_default() += 1;
        let parsed = InboxMessage::from_delivery(&delivery, self.shared.config.raw_bodies);
        let body = std::mem::take(&mut delivery.data);
        let attempt = parsed.as_ref().map_or(1, |m| m.attempt);
        let (exchange, routing_key) = match &parsed {
            Ok(m) => (m.exchange.clone(), m.routing_key.clone()),
            Err(_) => (delivery.exchange.as_str().to_owned(), delivery.routing_key.as_str().to_owned()),
        };
        let envelope = Envelope {
            generation,
            acker: delivery.acker,
            channel,
            properties: delivery.properties,
            exchange,
            routing_key,
            attempt,
        };
        match parsed {
            Ok(mut message) => {
                message.body = body;
                let lane = lane_of(&message, self.lanes.len());
                self.lanes[lane].queue.push_back(Job { envelope, message });
                if !self.lanes[lane].busy {
                    self.run_lane(lane, ctx);
                }
            }
            Err(reason) => {
                Counters::add(&self.shared.counters.unusable, 1);
                warn!(queue = %self.shared.config.queue, reason = %reason, "unusable message: dead-lettering it");
                let (shared, drain) = (self.shared.clone(), self.draining.subscribe());
                let work = async move {
                    let reason = format!("unusable message: {reason}");
                    forward(&shared, &envelope, &body, Forward::DeadLetter(&reason), drain).await
                };
                ctx.spawn(work.into_actor(self).map(move |settled, act, ctx| act.settled(generation, settled, ctx)));
            }
        }
    }

    /// Starts the lane's next job, or marks it idle.
    fn run_lane(&mut self, lane: usize, ctx: &mut Context<Self>) {
        let Some(job) = self.lanes[lane].queue.pop_front() else {
            self.lanes[lane].busy = false;
            return;
        };
        self.lanes[lane].busy = true;
        let span = info_span!("inbox", message_id = job.message.message_id, attempt = job.message.attempt,
            event_type = %job.message.event_type);
        let generation = job.envelope.generation;
        let work = process(self.shared.clone(), job, self.draining.subscribe()).instrument(span);
        ctx.spawn(work.into_actor(self).map(move |processed, act, ctx| {
            match processed {
                Processed::Settled(settled) => act.settled(generation, settled, ctx),
                Processed::Retry { job, delay, reason } => act.retry_later(job, delay, reason, ctx),
            }
            act.run_lane(lane, ctx);
        }));
    }

    /// Republishes `job` for its next attempt after `delay`, off its lane (it stays in hand).
    fn retry_later(&mut self, job: Box<Job>, delay: Duration, reason: String, ctx: &mut Context<Self>) {
        let (shared, mut drain) = (self.shared.clone(), self.draining.subscribe());
        let generation = job.envelope.generation;
        debug!(message_id = job.message.message_id, attempt = job.message.attempt, delay = ?delay, reason = %reason,
            "retryable failure; republishing for the next attempt after the delay");
        let work = async move {
            // A shutdown republishes at once: the attempt is counted and the next consumer waits
            // no longer than the backoff it would have waited here.
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = drain.wait_for(|draining| *draining) => {}
            }
            forward(&shared, &job.envelope, &job.message.body, Forward::Retry(&reason), drain).await
        };
        ctx.spawn(work.into_actor(self).map(move |settled, act, ctx| act.settled(generation, settled, ctx)));
    }

    fn settled(&mut self, generation: u64, settled: Settled, ctx: &mut Context<Self>) {
        self.in_hand -= 1;
        if let Some(held) = self.held.get_mut(&generation) {
            *held -= 1;
            if *held == 0 {
                self.held.remove(&generation);
                // A retired link is closed once nothing it carried is in hand.
                self.retired.remove(&generation);
            }
        }
        let c = &self.shared.counters;
        match settled {
            Settled::Handled => Counters::add(&c.handled, 1),
            Settled::LateFlagged => {
                Counters::add(&c.handled, 1);
                Counters::add(&c.late_flagged, 1);
            }
            Settled::Duplicate => Counters::add(&c.duplicates, 1),
            Settled::LateSkipped => Counters::add(&c.late_skipped, 1),
            Settled::Retried => Counters::add(&c.retried, 1),
            Settled::DeadLettered => Counters::add(&c.dead_lettered, 1),
            Settled::Requeued => Counters::add(&c.requeued, 1),
            Settled::Abandoned => {}
        }
        self.check_drained(ctx);
    }

    fn drain(&mut self, ctx: &mut Context<Self>) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        if self.state == State::Stopped {
            let _ = tx.send(());
            return rx;
        }
        self.drain_waiters.push(tx);
        if self.state != State::Running {
            return rx;
        }
        self.state = State::Draining;
        let _ = self.draining.send(true);
        if let Some(timer) = self.reconnect_timer.take() {
            ctx.cancel_future(timer);
        }
        // An unfinished connect is dropped: its thread sees nobody waiting and closes it.
        if let Some(connecting) = self.connecting.take() {
            ctx.cancel_future(connecting);
        }
        info!(queue = %self.shared.config.queue, in_hand = self.in_hand,
            "inbox consumer shutting down: cancelling the consumer, finishing deliveries in hand");
        if let Some(session) = &self.session
            && session.consuming
        {
            let (channel, tag) = (session.link.channel.clone(), session.tag.clone());
            let cancel = async move { channel.basic_cancel(tag, BasicCancelOptions::default()).await };
            ctx.spawn(cancel.into_actor(self).map(|cancelled, _, _| {
                if let Err(e) = cancelled {
                    debug!(error = %e, "basic.cancel failed; the consumer stream ends with its channel");
                }
            }));
            ctx.run_later(CANCEL_TIMEOUT, |act, ctx| {
                if let Some(session) = &mut act.session
                    && session.consuming
                {
                    warn!("the broker did not confirm the consumer's cancellation in time; closing anyway");
                    session.consuming = false;
                    act.check_drained(ctx);
                }
            });
        }
        self.check_drained(ctx);
        rx
    }

    /// Ends a shutdown once nothing is in hand and no delivery can still arrive.
    fn check_drained(&mut self, ctx: &mut Context<Self>) {
        if self.state != State::Draining || self.in_hand > 0 {
            return;
        }
        if self.session.as_ref().is_some_and(|s| s.consuming) {
            return;
        }
        self.state = State::Closing;
        self.shared.counters.set_connected(false);
        let link = self.session.take().map(|s| s.link);
        let close = async move {
            if let Some(link) = link {
                link.close().await;
            }
        };
        ctx.spawn(close.into_actor(self).map(|(), act, _| {
            act.state = State::Stopped;
            info!(queue = %act.shared.config.queue, "inbox consumer stopped");
            for waiter in act.drain_waiters.drain(..) {
                let _ = waiter.send(());
            }
        }));
    }
}

impl Actor for InboxConsumer {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.connect(ctx);
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.shared.counters.set_connected(false);
    }
}

impl StreamHandler<LinkEvent> for InboxConsumer {
    fn handle(&mut self, event: LinkEvent, ctx: &mut Context<Self>) {
        match event {
            LinkEvent::Delivery(generation, delivery) => match *delivery {
                Ok(delivery) => {
                    if self.session.as_ref().is_some_and(|s| s.generation == generation) {
                        self.received(delivery, ctx);
                    }
                }
                Err(e) => debug!(error = %e, "inbox consumer stream failed"),
            },
            LinkEvent::Ended(generation) => self.stream_ended(generation, ctx),
        }
    }

    /// A link's stream ending is handled by [`LinkEvent::Ended`]; the actor lives on.
    fn finished(&mut self, _: &mut Context<Self>) {}
}

impl Handler<Drain> for InboxConsumer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Drain, ctx: &mut Context<Self>) -> Self::Result {
        let done = self.drain(ctx);
        Box::pin(async move {
            let _ = done.await;
        })
    }
}

impl Handler<Crash> for InboxConsumer {
    type Result = ();

    fn handle(&mut self, _: Crash, _: &mut Context<Self>) {
        panic!("inbox consumer crash requested");
    }
}

/// The consumer tag shown by the broker: `<consumer>@<host>:<pid>#<n>`, or a tag of the
/// broker's choosing when that would be too long.
fn consumer_tag(consumer: &str, generation: u64) -> String {
    let tag = format!("{consumer}@{}#{generation}", crate::config::default_owner());
    if ShortString::try_new(tag.as_str()).is_ok() { tag } else { String::new() }
}

/// The lane of `message`: by aggregate, so that one aggregate's messages keep their order.
fn lane_of(message: &InboxMessage, lanes: usize) -> usize {
    let mut h = DefaultHasher::new();
    if message.has_aggregate() {
        (&message.source, &message.aggregate_type, &message.aggregate_id).hash(&mut h);
    } else {
        (&message.source, message.message_id).hash(&mut h);
    }
    (h.finish() % lanes.max(1) as u64) as usize
}

/// How one attempt ended.
enum Attempt {
    /// Committed (or nothing to commit): acknowledge.
    Done(Settled),
    /// The database did not answer (or the inbox's own statements failed): hold and try again.
    Outage(String),
    /// The handler failed (rolled back).
    Failed { reason: String, retryable: bool },
}

/// Why the handler did not finish, noted inside the transaction.
enum HandlerFailure {
    Error(HandlerError),
    Panic(String),
    TimedOut,
}

/// Runs one delivery to its end on its lane: attempts (held and repeated while the database is
/// out), then acknowledges, dead-letters, or hands back a retry.
async fn process(shared: Arc<Shared>, job: Job, mut drain: watch::Receiver<bool>) -> Processed {
    let config = &shared.config;
    let mut outages = 0_i32;
    loop {
        if !job.envelope.acker.usable() {
            debug!("delivery's channel is gone; the broker delivers it again");
            return Processed::Settled(Settled::Abandoned);
        }
        if *drain.borrow() && shared.database_out.load(Ordering::Relaxed) {
            requeue(&job.envelope.acker).await;
            return Processed::Settled(Settled::Requeued);
        }
        match attempt(&shared, &job.message, &drain).await {
            Attempt::Done(settled) => {
                shared.database_out.store(false, Ordering::Relaxed);
                if settled == Settled::LateSkipped {
                    info!(aggregate_type = %job.message.aggregate_type, aggregate_id = %job.message.aggregate_id,
                        "late message skipped: a newer message of its aggregate was applied first");
                }
                ack(&job.envelope.acker).await;
                return Processed::Settled(settled);
            }
            Attempt::Outage(reason) => {
                Counters::add(&shared.counters.outage_waits, 1);
                shared.database_out.store(true, Ordering::Relaxed);
                if *drain.borrow() {
                    warn!(reason = %reason, "database unavailable during shutdown; giving the delivery back");
                    requeue(&job.envelope.acker).await;
                    return Processed::Settled(Settled::Requeued);
                }
                let delay = half_jitter(outages, config.outage_backoff_min, config.outage_backoff_max);
                outages = outages.saturating_add(1);
                warn!(reason = %reason, retry_in = ?delay,
                    "database unavailable; holding the delivery and trying again (no attempt spent)");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = drain.changed() => {}
                }
            }
            Attempt::Failed { reason, retryable } => {
                let attempt = job.message.attempt;
                if retryable && attempt < config.max_attempts {
                    let delay = crate::backoff::full_jitter(
                        i32::try_from(attempt - 1).unwrap_or(i32::MAX),
                        config.retry_base,
                        config.retry_cap,
                    );
                    return Processed::Retry { job: Box::new(job), delay, reason };
                }
                let reason = if retryable {
                    format!("retries exhausted after {attempt} attempts; last error: {reason}")
                } else {
                    format!("permanent failure on attempt {attempt}: {reason}")
                };
                warn!(reason = %reason, "dead-lettering the message");
                let settled =
                    forward(&shared, &job.envelope, &job.message.body, Forward::DeadLetter(&reason), drain).await;
                return Processed::Settled(settled);
            }
        }
    }
}

/// One transaction: the order check (ordered consumers), the inbox row, and — for a new
/// message that is not a skipped late one — the handler. Commits only if all of it succeeded.
async fn attempt(shared: &Shared, message: &InboxMessage, drain: &watch::Receiver<bool>) -> Attempt {
    let config = &shared.config;
    let mut draining = drain.clone();
    let checkout = tokio::select! {
        checkout = shared.pool.get() => checkout,
        () = async {
            let _ = draining.wait_for(|draining| *draining).await;
            tokio::time::sleep(DRAIN_CHECKOUT_GRACE).await;
        } => return Attempt::Outage("no database connection during shutdown".into()),
    };
    let mut conn = match checkout {
        Ok(conn) => conn,
        Err(e) => return Attempt::Outage(StoreError::from(e).to_string()),
    };
    let consumer = config.consumer.as_str();
    let mut failure: Option<HandlerFailure> = None;
    let failure_slot = &mut failure;
    let transaction = conn.transaction(async |c| {
        let mut newest = None;
        if config.ordered && message.has_aggregate() {
            let order =
                store::advance_aggregate(c, consumer, store::AggregateRef::of(message), message.message_id).await?;
            if let AggregateOrder::Late { newest: n } = order {
                newest = Some(n);
            }
        }
        let message: Cow<'_, InboxMessage> = match newest {
            None => Cow::Borrowed(message),
            Some(n) => {
                let mut late = message.clone();
                late.late = true;
                late.newest_applied = Some(n);
                Cow::Owned(late)
            }
        };
        if !store::record(c, consumer, &message).await? {
            return Ok(Settled::Duplicate);
        }
        if message.late && config.late_events == LateEvents::Skip {
            return Ok(Settled::LateSkipped);
        }
        // The handler is called inside the guarded future, so that a panic while building
        // its future is caught as well as one while polling it.
        let handler = shared.handler.clone();
        let call = AssertUnwindSafe(async { handler.handle(c, &message).await }).catch_unwind();
        match tokio::time::timeout(config.handler_timeout, call).await {
            Ok(Ok(Ok(()))) => Ok(if message.late { Settled::LateFlagged } else { Settled::Handled }),
            Ok(Ok(Err(e))) => {
                *failure_slot = Some(HandlerFailure::Error(e));
                Err(diesel::result::Error::RollbackTransaction)
            }
            Ok(Err(panic)) => {
                *failure_slot = Some(HandlerFailure::Panic(panic_text(&*panic)));
                Err(diesel::result::Error::RollbackTransaction)
            }
            Err(_) => {
                *failure_slot = Some(HandlerFailure::TimedOut);
                Err(diesel::result::Error::RollbackTransaction)
            }
        }
    });
    // Dropping a transaction that did not finish drops its connection (the pool discards a
    // connection left inside a transaction): nothing it did commits, unless its COMMIT had gone
    // out, in which case the next try finds the message recorded.
    let bound = config.handler_timeout + STATEMENTS_GRACE;
    let Ok(result) = tokio::time::timeout(bound, transaction).await else {
        return Attempt::Outage(format!("the database did not answer within {}", humantime::format_duration(bound)));
    };
    match (result, failure) {
        (Ok(settled), _) => Attempt::Done(settled),
        (Err(_), Some(HandlerFailure::Error(e))) => match e.class() {
            FailureClass::Outage => Attempt::Outage(format!("the handler lost its connection: {e}")),
            FailureClass::Retryable => Attempt::Failed { reason: e.to_string(), retryable: true },
            FailureClass::Permanent => Attempt::Failed { reason: e.to_string(), retryable: false },
        },
        (Err(_), Some(HandlerFailure::Panic(why))) => {
            Counters::add(&shared.counters.panics, 1);
            error!(panic = %why, "inbox handler panicked; rolled back, retried like a retryable failure");
            Attempt::Failed { reason: format!("handler panicked: {why}"), retryable: true }
        }
        (Err(_), Some(HandlerFailure::TimedOut)) => Attempt::Failed {
            reason: format!("handler timed out after {}", humantime::format_duration(config.handler_timeout)),
            retryable: true,
        },
        // Our own statements (or the commit) failed: the database, not the message, is at fault.
        (Err(e), None) => Attempt::Outage(format!("inbox transaction failed: {e}")),
    }
}

/// Where a forwarded copy goes.
#[derive(Clone, Copy)]
enum Forward<'a> {
    /// Back to the queue (default exchange) for the next attempt; the reason of this failure.
    Retry(&'a str),
    /// To the dead-letter exchange, with the reason.
    DeadLetter(&'a str),
}

/// Publishes a copy (confirmed), then acknowledges the original. A copy the broker refuses is
/// held and tried again after a backoff (given back at shutdown); a broken channel abandons the
/// delivery to the broker's redelivery. Either way nothing is lost.
async fn forward(
    shared: &Shared,
    envelope: &Envelope,
    body: &[u8],
    to: Forward<'_>,
    mut drain: watch::Receiver<bool>,
) -> Settled {
    let config = &shared.config;
    let dead_letter_exchange = config.dead_letter_exchange_name();
    let (exchange, properties, success) = match to {
        Forward::Retry(reason) => {
            let headers = [
                (ATTEMPT_HEADER, AMQPValue::LongInt(i32::try_from(envelope.attempt + 1).unwrap_or(i32::MAX))),
                (LAST_ERROR_HEADER, long_string(reason)),
            ];
            ("", with_headers(envelope, &headers), Settled::Retried)
        }
        Forward::DeadLetter(reason) => {
            let headers = [
                (ERROR_HEADER, long_string(reason)),
                (ATTEMPT_HEADER, AMQPValue::LongInt(i32::try_from(envelope.attempt).unwrap_or(i32::MAX))),
                (CONSUMER_HEADER, long_string(&config.consumer)),
                (QUEUE_HEADER, long_string(&config.queue)),
            ];
            (dead_letter_exchange.as_str(), with_headers(envelope, &headers), Settled::DeadLettered)
        }
    };
    let mut refusals = 0_i32;
    loop {
        if !envelope.acker.usable() {
            return Settled::Abandoned;
        }
        match publish_confirmed(&envelope.channel, exchange, &config.queue, properties.clone(), body).await {
            Ok(()) => {
                ack(&envelope.acker).await;
                return success;
            }
            Err(PublishFailure::Link(e)) => {
                debug!(error = %e, "forwarding failed with the channel; the broker delivers the original again");
                return Settled::Abandoned;
            }
            Err(PublishFailure::Refused(e)) => {
                if *drain.borrow() {
                    warn!(error = %e, "forwarding refused during shutdown; giving the delivery back");
                    requeue(&envelope.acker).await;
                    return Settled::Requeued;
                }
                let delay = half_jitter(refusals, config.outage_backoff_min, config.outage_backoff_max);
                refusals = refusals.saturating_add(1);
                error!(error = %e, exchange = %exchange, retry_in = ?delay,
                    "the broker refused a forwarded copy; holding the delivery and trying again");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = drain.changed() => {}
                }
            }
        }
    }
}

/// The original's properties with `headers` added, and its first exchange and routing key kept.
fn with_headers(envelope: &Envelope, headers: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut table = envelope.properties.headers().clone().unwrap_or_default();
    table.insert(EXCHANGE_HEADER.into(), long_string(&envelope.exchange));
    table.insert(ROUTING_KEY_HEADER.into(), long_string(&envelope.routing_key));
    for (name, value) in headers {
        table.insert((*name).into(), value.clone());
    }
    envelope.properties.clone().with_headers(table)
}

fn long_string(text: &str) -> AMQPValue {
    let mut end = text.len().min(MAX_REASON_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    AMQPValue::LongString(text[..end].into())
}

async fn ack(acker: &Acker) {
    match tokio::time::timeout(ACK_TIMEOUT, acker.ack(BasicAckOptions::default())).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => debug!("acknowledgement skipped: the channel is gone; the broker delivers the message again"),
        Ok(Err(e)) => debug!(error = %e, "acknowledgement failed; the broker delivers the message again"),
        Err(_) => warn!("acknowledgement not settled in time; the broker delivers the message again if it was lost"),
    }
}

async fn requeue(acker: &Acker) {
    let nack = acker.nack(BasicNackOptions { multiple: false, requeue: true });
    match tokio::time::timeout(ACK_TIMEOUT, nack).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => debug!(error = %e, "nack failed; the broker delivers the message again anyway"),
        Err(_) => warn!("nack not settled in time; the broker delivers the message again when the channel closes"),
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_aggregate_keeps_one_lane() {
        let a = InboxMessage::new(1, "e", serde_json::Value::Null).with_aggregate("order", "42");
        let b = InboxMessage::new(99, "e", serde_json::Value::Null).with_aggregate("order", "42");
        assert_eq!(lane_of(&a, 8), lane_of(&b, 8));
        let lanes: std::collections::HashSet<_> =
            (0..200).map(|i| lane_of(&InboxMessage::new(i, "e", serde_json::Value::Null), 8)).collect();
        assert_eq!(lanes.len(), 8, "messages without an aggregate spread over every lane");
    }

    #[test]
    fn long_reasons_are_cut_on_a_char_boundary() {
        let reason = "é".repeat(MAX_REASON_BYTES);
        match long_string(&reason) {
            AMQPValue::LongString(s) => assert!(s.as_bytes().len() <= MAX_REASON_BYTES),
            other => panic!("{other:?}"),
        }
    }
}
