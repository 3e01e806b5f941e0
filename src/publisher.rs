//! The publish extension point: a [`Publisher`] implementation, or a user's own actix actor
//! that handles [`Publish`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use actix::{Message, Recipient};

use crate::error::PublishError;
use crate::model::OutboxMessage;

/// What a publish returns: `Ok(())` once the sink has the message durably, or how it failed.
pub type PublishResult = Result<(), PublishError>;

/// The future a [`Publisher`] returns. It runs on the dispatcher's actix arbiter, so it need
/// not be `Send`.
pub type PublishFuture = Pin<Box<dyn Future<Output = PublishResult> + 'static>>;

/// How a sink is doing as a whole, as far as it knows (see [`Publisher::state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SinkState {
    /// Taking messages.
    Up,
    /// Connected, but the other side holds publishes back for now (RabbitMQ's
    /// `connection.blocked`, raised by a memory or disk alarm). What was sent is held, not lost:
    /// the dispatcher claims nothing new and lets the publishes in flight wait past the publish
    /// timeout (keeping their leases alive) instead of timing them out and publishing again.
    Blocked(String),
    /// Cannot take messages (link down, reconnecting): the dispatcher claims nothing and puts
    /// back, attempt refunded, whatever it had claimed but not handed over.
    Down(String),
}

impl SinkState {
    /// Whether the sink takes messages.
    pub fn is_up(&self) -> bool {
        matches!(self, SinkState::Up)
    }
}

impl std::fmt::Display for SinkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SinkState::Up => f.write_str("up"),
            SinkState::Blocked(why) => write!(f, "blocked: {why}"),
            SinkState::Down(why) => write!(f, "down: {why}"),
        }
    }
}

/// A sink: sends one claimed message somewhere and says how it went.
///
/// The dispatcher calls it outside any database transaction, bounded by the publish timeout
/// (an elapsed timeout counts as [`PublishError::Retryable`], or as
/// [`PublishError::Unavailable`] when the sink says it is down), and many calls run at once. A
/// panic is treated as a crash of that publish: the row is left `processing` and is reclaimed
/// when its lease expires, spending an attempt. Return errors you can classify; panic on what
/// you cannot.
///
/// # Outages
///
/// Tell a failure of the message from a failure of the sink: return
/// [`PublishError::Unavailable`] when the sink itself cannot take messages (no connection,
/// reconnecting, the transport broke mid-publish). The row goes back with its attempt refunded,
/// the dispatcher stops claiming, and it probes the sink with one message at a time until one
/// gets through, then resumes at full speed. That is all a simple sink needs. A sink that knows
/// its own health can also report it through [`Publisher::state`], so that the dispatcher
/// pauses before a message fails, and waits instead of timing out while the sink is
/// [`SinkState::Blocked`].
///
/// ```
/// use std::sync::Arc;
/// use actix_outbox::sink::PublishFuture;
/// use actix_outbox::{OutboxMessage, PublishError, Publisher};
///
/// #[derive(Debug)]
/// struct Stdout;
///
/// impl Publisher for Stdout {
///     fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
///         Box::pin(async move {
///             if message.event_type.is_empty() {
///                 return Err(PublishError::Permanent("no event type".into()));
///             }
///             println!("{} {} {}", message.id, message.event_type, message.payload);
///             Ok(())
///         })
///     }
/// }
/// ```
pub trait Publisher: Send + Sync + std::fmt::Debug + 'static {
    /// Publishes `message`. The message's `id` is its stable identity across attempts.
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture;

    /// The sink's health right now. Called often (every 100 ms and at each publish timeout), so
    /// it must be cheap and must not block. The default, for sinks that cannot tell, is
    /// [`SinkState::Up`]: the dispatcher then learns of an outage from
    /// [`PublishError::Unavailable`] alone.
    fn state(&self) -> SinkState {
        SinkState::Up
    }
}

impl<P: Publisher + ?Sized> Publisher for Arc<P> {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        (**self).publish(message)
    }

    fn state(&self) -> SinkState {
        (**self).state()
    }
}

/// The message a user's publish actor handles when it is plugged in with [`ActorPublisher`].
#[derive(Debug, Clone, Message)]
#[rtype(result = "PublishResult")]
pub struct Publish {
    /// The claimed message to publish.
    pub message: Arc<OutboxMessage>,
}

/// Plugs a user's own actix actor in as the publish step: every claimed message is sent to the
/// actor as a [`Publish`], and its reply is the outcome.
///
/// ```
/// use actix::prelude::*;
/// use actix_outbox::PublishResult;
/// use actix_outbox::sink::{ActorPublisher, Publish};
///
/// struct Webhook;
/// impl Actor for Webhook {
///     type Context = Context<Self>;
/// }
/// impl Handler<Publish> for Webhook {
///     type Result = ResponseFuture<PublishResult>;
///     fn handle(&mut self, msg: Publish, _: &mut Context<Self>) -> Self::Result {
///         Box::pin(async move {
///             let _ = msg.message.id; // POST it somewhere, keyed by the id
///             Ok(())
///         })
///     }
/// }
///
/// # actix::System::new().block_on(async {
/// let sink = ActorPublisher::new(Webhook.start().recipient());
/// # let _ = sink;
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct ActorPublisher {
    recipient: Recipient<Publish>,
}

impl ActorPublisher {
    /// Sends each message to `recipient`.
    pub fn new(recipient: Recipient<Publish>) -> Self {
        Self { recipient }
    }
}

impl Publisher for ActorPublisher {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let recipient = self.recipient.clone();
        Box::pin(async move {
            match recipient.send(Publish { message }).await {
                Ok(result) => result,
                // The sink actor is gone (it panicked or stopped): nothing was published, and
                // a later attempt may find it restarted. Not the message's fault.
                Err(e) => Err(PublishError::Unavailable(format!("publish actor unavailable: {e}"))),
            }
        })
    }
}

/// A [`Publisher`] made of an async closure: the shortest sink of one's own. The closure
/// owns what it needs (a client, a queue), and each publish borrows it, so nothing is cloned
/// per message by hand; the dispatcher pays what it pays for any [`Publisher`], one boxed
/// future per publish. Its [`state`](Publisher::state) is always [`SinkState::Up`]: return
/// [`PublishError::Unavailable`] when the sink is down, or implement [`Publisher`] to report
/// health.
///
/// ```
/// use std::sync::Arc;
/// use actix_outbox::{OutboxMessage, PublishError, sink};
///
/// let endpoint = String::from("https://hooks.example.com/orders");
/// let webhook = sink::publisher_fn(async move |message: Arc<OutboxMessage>| {
///     if message.event_type.is_empty() {
///         return Err(PublishError::Permanent("no event type".into()));
///     }
///     println!("POST {endpoint} {} {}", message.id, message.payload);
///     Ok(())
/// });
/// # let _ = webhook;
/// ```
pub fn publisher_fn<F>(publish: F) -> FnPublisher<F>
where
    F: AsyncFn(Arc<OutboxMessage>) -> PublishResult + Send + Sync + 'static,
{
    FnPublisher(Arc::new(publish))
}

/// The [`Publisher`] that [`publisher_fn`] makes.
pub struct FnPublisher<F>(Arc<F>);

impl<F> Clone for FnPublisher<F> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<F> std::fmt::Debug for FnPublisher<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnPublisher")
    }
}

impl<F> Publisher for FnPublisher<F>
where
    F: AsyncFn(Arc<OutboxMessage>) -> PublishResult + Send + Sync + 'static,
{
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let publish = self.0.clone();
        Box::pin(async move { publish(message).await })
    }
}
