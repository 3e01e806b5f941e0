//! The consumer side without a broker: one message through an inbox handler's transaction.

use std::time::Duration;

use crate::error::StoreError;
use crate::inbox::attempt::{Attempt, transact};
use crate::inbox::delivery::Settled;
use crate::inbox::{InboxConfig, InboxHandler, InboxMessage, LateEvents};
use crate::model::OutboxMessage;
use crate::sink::RabbitConfig;
use crate::store::PgPool;

/// What the consumer would do with a delivery of the message, after its transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivered {
    /// The handler ran and its writes committed with the message's inbox row.
    Applied,
    /// The message was already recorded for this consumer: the handler was not called.
    Duplicate,
    /// An ordered consumer found a newer message of the aggregate applied: recorded, and under
    /// `LateEvents::Skip` not handled.
    SkippedLate,
    /// An ordered consumer under `LateEvents::Flag` handed the late message to the handler,
    /// which applied it.
    AppliedLate,
    /// The handler failed with attempts left: rolled back, and the consumer would try again
    /// after a backoff.
    Retried {
        /// The failure.
        reason: String,
    },
    /// The handler failed for good (permanently, or on its last attempt): rolled back, and the
    /// consumer would dead-letter the message.
    DeadLettered {
        /// The failure.
        reason: String,
    },
    /// The database did not answer (or a statement of the inbox failed): the consumer would hold
    /// the delivery and try again, no attempt spent.
    DatabaseUnavailable {
        /// What failed.
        reason: String,
    },
}

/// The consumer [`deliver`] plays: its name, and the settings of an [`InboxConfig`] that decide
/// what becomes of a message in its transaction (whether it is ordered, what it does with late
/// messages, its attempts, its handler's timeout). No broker is involved, so it has no URL or
/// queue.
///
/// [`deliver`] takes one, or what makes one: a consumer's name (every setting at
/// [`InboxConfig::new`]'s default) or a consumer's real [`InboxConfig`] (its URL and queue are
/// not used).
///
/// ```
/// use actix_outbox::inbox::LateEvents;
/// use actix_outbox::testkit::TestConsumer;
///
/// let billing = TestConsumer::new("billing").ordered(true).late_events(LateEvents::Flag);
/// assert_eq!(billing.name(), "billing");
/// ```
#[derive(Debug, Clone)]
pub struct TestConsumer {
    config: InboxConfig,
}

impl TestConsumer {
    /// The consumer named `consumer`, every setting at its default (unordered, 5 attempts, a
    /// 30 s handler timeout).
    pub fn new(consumer: impl Into<String>) -> Self {
        // The URL and the queue are the broker's part, which `deliver` leaves out.
        Self { config: InboxConfig::new(consumer, "", "") }
    }

    /// The consumer's name: the inbox records each message under it.
    pub fn name(&self) -> &str {
        &self.config.consumer
    }

    /// Sets [`InboxConfig::ordered`]: each aggregate's messages are checked for order.
    #[must_use]
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.config.ordered = ordered;
        self
    }

    /// Sets [`InboxConfig::late_events`]: what an ordered consumer does with a late message.
    #[must_use]
    pub fn late_events(mut self, late: LateEvents) -> Self {
        self.config.late_events = late;
        self
    }

    /// Sets [`InboxConfig::max_attempts`]: a retryable failure on a message's last attempt
    /// dead-letters it.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts;
        self
    }

    /// Sets [`InboxConfig::handler_timeout`].
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.config.handler_timeout = timeout;
        self
    }
}

/// A consumer of this name, every setting at its default.
impl From<&str> for TestConsumer {
    fn from(consumer: &str) -> Self {
        Self::new(consumer)
    }
}

/// The consumer a real configuration describes (its URL and queue are not used).
impl From<&InboxConfig> for TestConsumer {
    fn from(config: &InboxConfig) -> Self {
        Self { config: config.clone() }
    }
}

impl From<&TestConsumer> for TestConsumer {
    fn from(consumer: &TestConsumer) -> Self {
        consumer.clone()
    }
}

/// Runs `message` through `handler` as the inbox consumer `consumer` does with a delivery: one
/// transaction on a connection of `pool` that records the message under the consumer's name
/// (and, for an ordered consumer, checks and advances its aggregate's order), calls the
/// handler for a new message, and commits only if all of it succeeded; a handler's panic or
/// timeout rolls back like a retryable failure. Only the broker is missing: nothing is
/// acknowledged, republished or dead-lettered.
///
/// `consumer` is the consumer's name, a [`TestConsumer`] with settings of its own, or a real
/// [`InboxConfig`].
///
/// ```no_run
/// # async fn example(db: actix_outbox::testkit::TestDatabase) {
/// use actix_outbox::inbox::{InboxMessage, handler_fn};
/// use actix_outbox::testkit::{Delivered, TestConsumer, deliver};
///
/// let handler = handler_fn(|_conn, _message| Box::pin(async { Ok(()) }));
/// let message = InboxMessage::new(41, "order.placed", serde_json::json!({"total": 12}));
/// assert_eq!(deliver(db.pool(), "billing", &handler, &message).await.unwrap(), Delivered::Applied);
/// assert_eq!(deliver(db.pool(), "billing", &handler, &message).await.unwrap(), Delivered::Duplicate);
/// // Another consumer applies it once too.
/// let shipping = TestConsumer::new("shipping").ordered(true);
/// assert_eq!(deliver(db.pool(), &shipping, &handler, &message).await.unwrap(), Delivered::Applied);
/// # }
/// ```
///
/// `Err` only when no connection could be checked out of `pool`.
pub async fn deliver(
    pool: &PgPool,
    consumer: impl Into<TestConsumer>,
    handler: &impl InboxHandler,
    message: &InboxMessage,
) -> Result<Delivered, StoreError> {
    let config = consumer.into().config;
    let mut conn = pool.checkout().await?;
    Ok(match transact(&mut conn, &config, handler, message, pool).await {
        Attempt::Done(Settled::Duplicate) => Delivered::Duplicate,
        Attempt::Done(Settled::LateSkipped) => Delivered::SkippedLate,
        Attempt::Done(Settled::LateFlagged) => Delivered::AppliedLate,
        Attempt::Done(_) => Delivered::Applied,
        Attempt::Outage(reason) => Delivered::DatabaseUnavailable { reason },
        Attempt::Failed { reason, retryable, .. } if retryable && message.attempt < config.max_attempts => {
            Delivered::Retried { reason }
        }
        Attempt::Failed { reason, .. } => Delivered::DeadLettered { reason },
    })
}

/// The message an inbox consumer receives for `message` as the RabbitMQ sink publishes it:
/// the outbox id as message id, the event type, the source, the aggregate, the publish attempt,
/// the payload, and the headers of the wire format (none when the sink would refuse them, for a
/// header name longer than AMQP allows, say). With a [`MemorySink`](super::MemorySink),
/// this carries a drained outbox's messages to an inbox handler without a broker.
pub fn inbox_message(message: &OutboxMessage) -> InboxMessage {
    let payload: serde_json::Value = serde_json::from_str(message.payload.get()).unwrap_or(serde_json::Value::Null);
    let mut inbox = InboxMessage::new(message.id, message.event_type.clone(), payload)
        .with_source(message.source.to_string())
        .with_aggregate(message.aggregate_type.clone(), message.aggregate_id.clone());
    inbox.publish_attempt = Some(i64::from(message.attempts));
    inbox.body = message.payload.get().as_bytes().to_vec();
    // What a sink of the default configuration sends (its URL is not used).
    if let Ok(properties) = RabbitConfig::new("amqp://localhost").properties(message) {
        inbox.headers = properties.headers().clone().unwrap_or_default();
    }
    inbox
}
