//! The link's state that publishes and the connection manager share: the current channel and
//! its generation, why it is down, whether the broker blocked it or went silent, and the one
//! place a publish's confirm becomes an outcome ([`classify`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lapin::types::ShortString;
use tokio::sync::{Notify, oneshot};

use super::confirms::{Desk, Outgoing};
use super::properties::{Format, properties};
use super::{RabbitConfig, RoutingKeyFn};
use crate::amqp::publisher_confirm::Confirmed;
use crate::error::PublishError;
use crate::model::OutboxMessage;
use crate::publisher::{PublishResult, SinkState};
use crate::url::mask_url;
use crate::wire;

/// What publishes and the connection manager share.
pub(super) struct LinkState {
    /// The node connected to (or last tried), password masked.
    pub(super) url: Mutex<String>,
    unresponsive_after: Duration,
    /// Why the broker blocked the connection, while it does.
    blocked: Mutex<Option<String>>,
    /// Publishes on the current link waiting for their confirm.
    waits: Mutex<Waits>,
    pub(super) exchange: ShortString,
    format: Format,
    routing_key: Option<Arc<RoutingKeyFn>>,
    current: Mutex<Current>,
    /// Highest link generation a publish found broken.
    pub(super) broken: AtomicU64,
    /// Wakes the manager when a publish finds the link broken.
    pub(super) broken_notify: Notify,
    pub(super) reconnects: AtomicU64,
}

pub(super) struct Current {
    pub(super) link: Option<Link>,
    /// Why there is no link (shown in the retryable error of publishes meanwhile).
    down_reason: String,
}

/// One channel in confirm mode, and the desk that publishes on it (see
/// [`confirms`](super::confirms)); `generation` tells a failure on it from one on its successor.
#[derive(Clone)]
pub(super) struct Link {
    pub(super) desk: Desk,
    pub(super) generation: u64,
    /// The broker has acked a publish on this channel (set by the desk, which reads the confirms
    /// in the broker's order).
    pub(super) acked: Arc<std::sync::atomic::AtomicBool>,
}

/// What a failed publish means for the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkHealth {
    Healthy,
    Broken,
}

impl LinkState {
    pub(super) fn new(config: &RabbitConfig) -> Self {
        Self {
            url: Mutex::new(mask_url(&config.urls[0])),
            unresponsive_after: config.unresponsive_after,
            blocked: Mutex::new(None),
            waits: Mutex::new(Waits { generation: 0, count: 0, since: Instant::now() }),
            // validate() checked both lengths.
            exchange: ShortString::try_new(config.exchange.as_str()).unwrap_or_default(),
            format: config.format(),
            routing_key: config.routing_key.clone(),
            current: Mutex::new(Current { link: None, down_reason: "not connected yet".into() }),
            broken: AtomicU64::new(0),
            broken_notify: Notify::new(),
            reconnects: AtomicU64::new(0),
        }
    }

    pub(super) fn current(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn url(&self) -> String {
        self.url.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(super) fn set_url(&self, url: &str) {
        *self.url.lock().unwrap_or_else(|e| e.into_inner()) = mask_url(url);
    }

    pub(super) fn set_blocked(&self, reason: Option<String>) {
        *self.blocked.lock().unwrap_or_else(|e| e.into_inner()) = reason;
    }

    pub(super) fn state(&self) -> SinkState {
        if let Some(reason) = self.blocked.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return SinkState::Blocked(format!("RabbitMQ blocked the connection: {reason}"));
        }
        if let Some(silent) = self.unresponsive() {
            return SinkState::Down(format!(
                "RabbitMQ at {} confirmed nothing for {} while publishes wait",
                self.url(),
                humantime::format_duration(Duration::from_millis(silent.as_millis() as u64))
            ));
        }
        let current = self.current();
        match current.link {
            Some(_) => SinkState::Up,
            None => SinkState::Down(format!("no link to RabbitMQ at {}: {}", self.url(), current.down_reason)),
        }
    }

    /// How long publishes on the current link have waited without any confirm, once that is
    /// past `unresponsive_after`.
    fn unresponsive(&self) -> Option<Duration> {
        let waits = self.waits();
        let silent = waits.since.elapsed();
        (waits.count > 0 && silent >= self.unresponsive_after).then_some(silent)
    }

    pub(super) fn set_link(&self, link: Link) {
        // Publishes stranded on the old link no longer say anything about the new one.
        *self.waits() = Waits { generation: link.generation, count: 0, since: Instant::now() };
        self.current().link = Some(link);
    }

    fn waits(&self) -> MutexGuard<'_, Waits> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn clear_link(&self, reason: String) {
        let mut current = self.current();
        current.link = None;
        current.down_reason = reason;
    }

    fn report_broken(&self, generation: u64) {
        self.broken.fetch_max(generation, Ordering::AcqRel);
        self.broken_notify.notify_one();
    }

    pub(super) async fn publish(&self, message: Arc<OutboxMessage>) -> PublishResult {
        let routing_key = super::config::routing_key_of(self.routing_key.as_deref(), &message);
        let key = ShortString::try_new(routing_key.as_str()).map_err(|e| {
            PublishError::Permanent(format!(
                "row {}: routing key {routing_key:?} cannot be sent over AMQP: {e}",
                message.id
            ))
        })?;
        let exchange = match message.headers.get(wire::EXCHANGE) {
            None => self.exchange.clone(),
            Some(name) => wire::check_exchange(name)
                .map(|()| ShortString::from(name.as_str()))
                .map_err(|why| PublishError::Permanent(format!("row {}: {why}", message.id)))?,
        };
        let properties = properties(&message, &self.format)?;

        let link = {
            let current = self.current();
            match &current.link {
                Some(link) => link.clone(),
                None => {
                    return Err(PublishError::Unavailable(format!(
                        "RabbitMQ link to {} is down: {}",
                        self.url(),
                        current.down_reason
                    )));
                }
            }
        };
        // Counted until its confirm arrives (or the dispatcher gives up on it), so that a broker
        // that stops answering is noticed: see `unresponsive`.
        let waiting = Waiting::start(self, link.generation);
        let (answer, answered) = oneshot::channel();
        let outgoing = Outgoing { message, routing_key: key, exchange: exchange.clone(), properties, answer };
        let confirmed = match link.desk.send(outgoing) {
            // A desk that is gone (its link was replaced, or the sink's thread stopped) drops
            // the answer: the channel it published on is no longer ours.
            Ok(()) => answered.await.ok(),
            Err(_) => None,
        };
        waiting.answered();
        let nacked = matches!(confirmed, Some(Confirmed::Nacked(_)));
        let (result, mut health) = match confirmed {
            Some(confirmed) => classify(confirmed, exchange.as_str(), &routing_key),
            None => (
                Err(PublishError::Unavailable(format!(
                    "RabbitMQ link to {} closed before the broker answered",
                    self.url()
                ))),
                LinkHealth::Broken,
            ),
        };
        // A channel that nacks before it has acked anything is replaced (the message's attempt
        // is spent all the same). RabbitMQ 3.10 nacks every publish of a channel whose first
        // publish to a quorum queue found the queue's leader's node down, forever: the channel's
        // queue client keeps asking that node, though the queue has a new leader a moment later
        // (tests/it/cluster.rs). A fresh channel asks the new leader. A channel that was acked
        // before and then nacks (a full queue with overflow=reject-publish) is kept.
        // Whether it was acked before is the desk's word, read in the broker's order: the publishes
        // of a channel resume in any order, and a nack read after a thousand acks could otherwise
        // look like the channel's first answer, and replace a channel that only found a queue full
        // (what it had in flight would fail, and be published again).
        if nacked && !link.acked.load(Ordering::Acquire) {
            health = LinkHealth::Broken;
        }
        if health == LinkHealth::Broken {
            self.report_broken(link.generation);
        }
        result
    }
}

/// The publishes of one link generation waiting for a confirm, and since when the broker has
/// said nothing to them.
struct Waits {
    generation: u64,
    count: u64,
    /// The last answer, or when the first of the waiting publishes began to wait (the silence
    /// is measured from then, not from the last answer before an idle spell).
    since: Instant,
}

/// One publish waiting for its confirm; dropping it (answered, failed or abandoned) stops the
/// count.
struct Waiting<'a> {
    link: &'a LinkState,
    generation: u64,
}

impl<'a> Waiting<'a> {
    fn start(link: &'a LinkState, generation: u64) -> Self {
        let mut waits = link.waits();
        if waits.generation == generation {
            if waits.count == 0 {
                waits.since = Instant::now();
            }
            waits.count += 1;
        }
        Self { link, generation }
    }

    /// The broker answered (whatever it said): it is alive.
    fn answered(&self) {
        let mut waits = self.link.waits();
        if waits.generation == self.generation {
            waits.since = Instant::now();
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waits = self.link.waits();
        if waits.generation == self.generation {
            waits.count = waits.count.saturating_sub(1);
        }
    }
}

/// The one place where the broker's answer (or the client's failure) becomes an outcome, and
/// where we decide whether the link must be rebuilt.
fn classify(confirmed: Confirmed, exchange: &str, routing_key: &str) -> (PublishResult, LinkHealth) {
    match confirmed {
        Confirmed::Delivered => (Ok(()), LinkHealth::Healthy),
        Confirmed::Unroutable(reply) => (
            Err(PublishError::Permanent(format!(
                "unroutable: exchange {exchange:?} has no binding for routing key {routing_key:?} \
                 (broker returned the message: {reply})"
            ))),
            LinkHealth::Healthy,
        ),
        // A nack is the broker saying it cannot take the message now (a full queue with
        // overflow=reject-publish): pushback, not the message's fault.
        Confirmed::Nacked(reply) => (
            Err(PublishError::Refused(match reply {
                Some(reply) => format!("broker nacked the message ({reply})"),
                None => format!(
                    "broker nacked the message on exchange {exchange:?} with routing key {routing_key:?} \
                     (e.g. a full queue with overflow=reject-publish)"
                ),
            })),
            LinkHealth::Healthy,
        ),
        Confirmed::NotConfirmMode => {
            (Err(PublishError::Unavailable("channel is not in confirm mode; reopening it".into())), LinkHealth::Broken)
        }
        Confirmed::Failed(e) => {
            (Err(PublishError::Unavailable(format!("RabbitMQ channel or connection failed: {e}"))), LinkHealth::Broken)
        }
        // Nothing was published: the channel is untouched.
        Confirmed::NoExchange(why) => (Err(PublishError::Retryable(why)), LinkHealth::Healthy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::publisher_confirm::Reply;

    #[test]
    fn classifies_transport_failures_as_unavailable_and_broken() {
        let err: lapin::Error = lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed).into();
        let (result, health) = classify(Confirmed::Failed(err), "outbox", "a.b");
        assert!(
            matches!(result, Err(PublishError::Unavailable(_))),
            "a transport failure is the sink's, not the message's"
        );
        assert_eq!(health, LinkHealth::Broken);
        let (result, health) = classify(Confirmed::Nacked(None), "outbox", "a.b");
        assert!(matches!(result, Err(PublishError::Refused(ref m)) if m.contains("nack")), "{result:?}");
        assert_eq!(health, LinkHealth::Healthy);
        assert_eq!(classify(Confirmed::Delivered, "outbox", "a.b").0, Ok(()));
        let returned = Reply { code: 312, text: "NO_ROUTE".into(), message_id: Some("7".into()) };
        let (result, health) = classify(Confirmed::Unroutable(returned), "outbox", "a.b");
        assert!(matches!(result, Err(PublishError::Permanent(ref m)) if m.starts_with("unroutable:")), "{result:?}");
        assert_eq!(health, LinkHealth::Healthy);
    }
}
