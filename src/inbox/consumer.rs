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

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::BasicCancelOptions;
use lapin::types::ShortString;
use tokio::sync::{oneshot, watch};
use tracing::{Instrument, debug, info, info_span, warn};

use super::attempt::{Processed, process};
use super::delivery::{Envelope, Job, Settled};
use super::link::Link;
use super::message::InboxMessage;
use super::metrics::Counters;
use super::settle::{Forward, forward};
use super::shared::Shared;
use crate::amqp::Reconnect;

/// How long a shutdown waits for the broker to confirm the consumer's cancellation (and so for
/// the last prefetched deliveries to arrive) before it goes on without it.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(5);
/// Stop consuming, finish what is in hand, close the link; resolves when all that is done.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// Panics inside the actor, so that tests and drills can watch the supervisor replace it.
#[cfg(feature = "test-util")]
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

#[derive(Default)]
struct Lane {
    busy: bool,
    queue: VecDeque<Job>,
}

pub(crate) struct InboxConsumer {
    shared: Arc<Shared>,
    state: State,
    session: Option<Session>,
    /// Links opened by this actor so far.
    generation: u64,
    /// The node of [`InboxConfig::urls`](super::InboxConfig::urls) the next link tries first:
    /// the one after the node of the last link, so that a node that went down is tried last.
    next_node: usize,
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
            next_node: 0,
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
        let open = Link::open(config.clone(), tag, self.next_node);
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
        self.next_node = (link.node + 1) % self.shared.config.urls.len().max(1);
        let generation = self.generation;
        if generation > 1 {
            Counters::add(&self.shared.counters.reconnects, 1);
            info!(queue = %self.shared.config.queue, node = %crate::url::mask_url(&self.shared.config.urls[link.node]),
                "inbox consumer reconnected");
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
        let Some((channel, forwards, generation)) =
            self.session.as_ref().map(|s| (s.link.channel.clone(), s.link.forwards.clone(), s.generation))
        else {
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
            forwards,
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
        if crate::lifecycle::system_gone() {
            ctx.stop();
            return;
        }
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

#[cfg(feature = "test-util")]
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
}
