//! The RabbitMQ sink: one lapin connection with publisher confirms, shared by every
//! publish, re-established by the sink itself when it is lost.
//!
//! The user-facing notes (where the connection lives, how broker answers become outcomes) are
//! on [`RabbitSink`]; the mapping itself is `link::classify`, the only place that does it.

mod binding;
mod config;
mod confirms;
mod error;
mod link;
mod manager;
mod properties;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::oneshot;

pub use lapin::ExchangeKind;

pub use binding::{QueueBinding, QueueKind};
pub use config::{CloudEventsMode, RabbitConfig, RoutingKeyFn};
pub use error::RabbitError;
use link::LinkState;
use manager::Manager;

use crate::amqp::connection::LinkThread;
use crate::model::OutboxMessage;
use crate::publisher::{PublishFuture, Publisher, SinkState};

/// A [`Publisher`] that publishes each outbox message to a RabbitMQ exchange with publisher
/// confirms, `mandatory` and persistent, in the format of [`wire`](crate::wire): `message_id` = the outbox
/// id in decimal, the `x-outbox-source` header naming the outbox (unless
/// [`RabbitConfig::outbox_headers`] is off), then the producer's headers
/// ([`NewEvent::header`](crate::NewEvent::header)), each as a long string. **Ours win**: a
/// producer's header named `x-deduplication-header` or `x-attempt`, or starting with
/// `x-outbox-` or `x-aggregate-`, is not sent. A producer's header name longer than 255 bytes,
/// or headers taking more than [`wire::MAX_PRODUCER_HEADER_BYTES`](crate::wire::MAX_PRODUCER_HEADER_BYTES) encoded, fail the message
/// with [`PublishError::Permanent`](crate::PublishError::Permanent) saying so.
///
/// # Exchange and routing key
///
/// The routing key is the event's own ([`NewEvent::routing_key`](crate::NewEvent::routing_key)),
/// else that of [`RabbitConfig::routing_key`] or [`RabbitConfig::routing_key_template`], else
/// the event type. The exchange is the event's own ([`NewEvent::exchange`](crate::NewEvent::exchange)),
/// else [`RabbitConfig::exchange`]. A routing key or an exchange name that AMQP cannot carry (over
/// 255 bytes; an exchange name of other characters than letters, digits, `-`, `_`, `.` and `:`)
/// fails its message permanently, naming the row.
///
/// A publish to a missing exchange would make the broker close the shared channel (404), failing
/// every publish in flight on it. So the first time the sink meets an event's exchange (on each
/// connection) it checks it with a passive declare on a short-lived channel of its own: an
/// exchange that does not exist fails the message with
/// [`PublishError::Retryable`](crate::PublishError::Retryable) naming it (the row retries with backoff
/// until someone creates the exchange), and the other messages are not disturbed. Exchanges found
/// to exist are remembered for the connection; the sink never declares an event's exchange.
///
/// Delivery is at-least-once: a message whose confirm was lost (connection cut, publish timeout)
/// is published again on a later attempt with the same `message_id`, on which consumers
/// deduplicate.
///
/// Clones share one connection and one channel.
///
/// # Where the connection lives
///
/// A lapin connection is bound to the tokio runtime that created it: its socket is registered
/// with that runtime's reactor and its heartbeats use that runtime's timers. If that runtime
/// stops (an actix arbiter that is stopped, a test's runtime that ends) the connection hangs
/// silently: publishes never complete while its status still says connected.
///
/// So the sink does not borrow the caller's runtime. [`RabbitSink::connect`] starts a thread of
/// its own (`actix-outbox-amqp`) running a small current-thread tokio runtime, and the
/// connection manager runs there: it connects, enables confirms, declares the exchange (and the
/// queues of [`RabbitConfig::bind_queue`]), watches the link, and reconnects with backoff when the connection or channel is lost. The thread
/// lives exactly as long as the sink: it closes the connection and ends when the last clone of
/// the [`RabbitSink`] is dropped or [`RabbitSink::close`] is called. That makes the sink safe to
/// create from any arbiter (or from plain tokio) and to use from any other.
///
/// Each publish hands its message to the link's publishing task on that thread, which
/// publishes it on the shared channel (many publishes are in flight at once) and reads every
/// confirm of the channel in one place. That is what makes a returned message's outcome its own:
/// the broker acks several publishes at once, and lapin hands a returned message to any confirm
/// of that ack; the task credits the return to the publish whose `message_id` it carries.
///
/// # Outcomes
///
/// The broker's answer maps onto a [`PublishResult`](crate::PublishResult) in exactly one place:
///
/// | broker / client says | outcome |
/// | --- | --- |
/// | `Ack` without a returned message | `Ok` (row done) |
/// | `Ack` with a returned message (312 `NO_ROUTE` for a `mandatory` publish) | [`PublishError::Permanent`](crate::PublishError::Permanent), "unroutable", naming exchange and routing key |
/// | `Nack` | [`PublishError::Refused`](crate::PublishError::Refused): pushback (a queue at its `x-max-length` with `x-overflow = reject-publish` nacks what it cannot take), the row back after about a second with its attempt refunded and the claims slowed; a channel that nacks before the broker has acked anything on it is replaced (RabbitMQ 3.10 nacks every publish of a channel whose first publish to a quorum queue found the leader's node down) |
/// | channel or connection error, or no link while reconnecting | [`PublishError::Unavailable`](crate::PublishError::Unavailable) (attempt refunded, claiming paused), and the link is rebuilt |
/// | no confirm within the publish timeout | [`PublishError::Retryable`](crate::PublishError::Retryable) while the sink says it is up, [`PublishError::Unavailable`](crate::PublishError::Unavailable) while it says it is down; while it says it is blocked, the publish waits (applied by the dispatcher) |
///
/// lapin reports a returned message as an *ack* that carries it: the broker did accept the
/// message, it simply had nowhere to put it. lapin also logs every returned message, payload
/// included, at WARN under the target `lapin::returned_messages`; filter that target if
/// payloads must not reach the logs (the dead row's `last_error` says what happened anyway).
///
/// # Example
///
/// ```no_run
/// use actix_outbox::dispatcher::Shutdown;
/// use actix_outbox::sink::{RabbitConfig, RabbitSink};
/// use actix_outbox::{DispatcherConfig, OutboxSupervisor, connect_pool};
///
/// #[actix::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let pool = connect_pool("postgres://root@127.0.0.1:5432/app", 8).await?;
///     let sink = RabbitSink::connect(RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
///     let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink.clone())?;
///     // ... until the application stops:
///     dispatcher.send(Shutdown).await?;
///     sink.close().await;
///     Ok(())
/// }
/// ```
#[derive(Clone)]
pub struct RabbitSink {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for RabbitSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitSink")
            .field("url", &self.handle.link.url)
            .field("exchange", &self.handle.link.exchange.as_str())
            .field("connected", &self.is_connected())
            .field("reconnects", &self.reconnects())
            .finish()
    }
}

/// Owned by the sink's clones; dropping the last one stops the connection thread.
struct Handle {
    link: Arc<LinkState>,
    /// The connection manager's thread; dropping it tells the manager to close and end.
    thread: LinkThread,
}

impl RabbitSink {
    /// Validates `config`, starts the sink's connection thread and waits for the first
    /// connection (bounded by [`RabbitConfig::connect_timeout`]): connected, confirm mode on,
    /// exchange and bound queues declared. Fails if the broker cannot be reached or refuses the setup; after this
    /// first success, the sink reconnects by itself whenever the link is lost.
    pub async fn connect(config: RabbitConfig) -> Result<Self, RabbitError> {
        config.validate()?;
        let link = Arc::new(LinkState::new(&config));
        let (first_tx, first_rx) = oneshot::channel();
        let manager_link = link.clone();
        // A runtime of its own, so that no arbiter's shutdown can strand the connection.
        let thread = LinkThread::start("actix-outbox-amqp", move |stop| {
            Manager { config, next_node: 0, link: manager_link, stop }.run(first_tx)
        })
        .map_err(|e| RabbitError::Thread(e.io().to_string()))?;
        let handle = Arc::new(Handle { link, thread });
        match first_rx.await {
            Ok(Ok(())) => Ok(Self { handle }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RabbitError::Thread("the connection thread ended before connecting".into())),
        }
    }

    /// Whether the sink has a usable channel right now. While it is false, publishes fail at
    /// once as retryable.
    pub fn is_connected(&self) -> bool {
        self.handle.link.current().link.is_some()
    }

    /// How many times the sink re-established its link (a new channel, or a new connection)
    /// after losing it.
    pub fn reconnects(&self) -> u64 {
        self.handle.link.reconnects.load(Ordering::Relaxed)
    }

    /// The exchange this sink publishes to.
    pub fn exchange(&self) -> &str {
        self.handle.link.exchange.as_str()
    }

    /// Closes the connection gracefully and stops the connection thread, for every clone of
    /// this sink; later publishes fail as retryable. Shut the dispatcher down first so that no
    /// publish is in flight. Safe to call more than once. Dropping the last clone does the same
    /// without waiting.
    pub async fn close(&self) {
        self.handle.thread.close().await;
    }
}

impl Publisher for RabbitSink {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let link = self.handle.link.clone();
        Box::pin(async move { link.publish(message).await })
    }

    /// [`SinkState::Down`] while there is no link (connecting, reconnecting, closed) or the
    /// broker has confirmed nothing for [`RabbitConfig::unresponsive_after`] while publishes
    /// wait; [`SinkState::Blocked`] while the broker has blocked the connection
    /// (`connection.blocked`, a resource alarm); else [`SinkState::Up`].
    fn state(&self) -> SinkState {
        self.handle.link.state()
    }
}
