//! [`InboxMessage`]: what the handler sees of a delivery, and how a delivery becomes one.

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};

/// Header carrying the consumer's own attempt count on the copies it republishes for a retry
/// (absent on a first delivery, which is attempt 1).
pub const ATTEMPT_HEADER: &str = "x-inbox-attempt";
/// Header carrying why a message was dead-lettered.
pub const ERROR_HEADER: &str = "x-inbox-error";
/// Header carrying why the previous attempt of a retried copy failed.
pub const LAST_ERROR_HEADER: &str = "x-inbox-last-error";
/// Header naming the consumer that dead-lettered a message.
pub const CONSUMER_HEADER: &str = "x-inbox-consumer";
/// Header naming the queue a dead-lettered message was consumed from.
pub const QUEUE_HEADER: &str = "x-inbox-queue";
/// Header keeping the exchange a message was first published to, on republished copies.
pub const EXCHANGE_HEADER: &str = "x-inbox-exchange";
/// Header keeping the routing key a message was first published with, on republished copies.
pub const ROUTING_KEY_HEADER: &str = "x-inbox-routing-key";

/// One message as the handler sees it.
///
/// The consumer builds it from a delivery: the AMQP `message_id` (the producer's outbox id,
/// decimal), the `type` property, the `x-aggregate-type`, `x-aggregate-id` and `x-attempt`
/// headers that the outbox's RabbitMQ sink sets, and the body.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct InboxMessage {
    /// The message id: the key of exactly-once, shared by every copy of the message.
    pub message_id: i64,
    /// The AMQP `type` property (the outbox's event type); empty when the message had none.
    pub event_type: String,
    /// The `x-aggregate-type` header; empty when the message had none.
    pub aggregate_type: String,
    /// The `x-aggregate-id` header; empty when the message had none.
    pub aggregate_id: String,
    /// This consumer's attempt at the message: 1 the first time, one more on each copy the
    /// consumer republishes after a retryable failure. Redeliveries by the broker (after a
    /// lost connection or a crash) do not count.
    pub attempt: u32,
    /// Whether the broker redelivered this copy (an earlier delivery of it was not
    /// acknowledged, e.g. the consumer crashed or its connection dropped).
    pub redelivered: bool,
    /// The producer's attempt that published this copy (`x-attempt`), when present.
    pub publish_attempt: Option<i64>,
    /// Ordered consumers only: a message of the same aggregate with a higher id was applied
    /// before this one arrived. Seen by the handler only under
    /// [`LateEvents::Flag`](super::LateEvents::Flag).
    pub late: bool,
    /// For a late message: the highest message id applied for its aggregate.
    pub newest_applied: Option<i64>,
    /// The exchange the message was first published to (kept across the consumer's retries).
    pub exchange: String,
    /// The routing key the message was first published with (kept across retries).
    pub routing_key: String,
    /// Every header of the delivery.
    pub headers: FieldTable,
    /// The body parsed as JSON; `Null` when the body is empty or not JSON (see `body`).
    pub payload: serde_json::Value,
    /// The body as received.
    pub body: Vec<u8>,
}

impl InboxMessage {
    /// A message with this id, event type and payload and every other field empty (attempt 1),
    /// for testing handlers without a broker.
    pub fn new(message_id: i64, event_type: impl Into<String>, payload: serde_json::Value) -> Self {
        let body = serde_json::to_vec(&payload).unwrap_or_default();
        Self {
            message_id,
            event_type: event_type.into(),
            aggregate_type: String::new(),
            aggregate_id: String::new(),
            attempt: 1,
            redelivered: false,
            publish_attempt: None,
            late: false,
            newest_applied: None,
            exchange: String::new(),
            routing_key: String::new(),
            headers: FieldTable::default(),
            payload,
            body,
        }
    }

    /// Sets the aggregate.
    #[must_use]
    pub fn with_aggregate(mut self, aggregate_type: impl Into<String>, aggregate_id: impl Into<String>) -> Self {
        self.aggregate_type = aggregate_type.into();
        self.aggregate_id = aggregate_id.into();
        self
    }

    /// Whether the message names an aggregate (either header present and not empty).
    pub fn has_aggregate(&self) -> bool {
        !self.aggregate_type.is_empty() || !self.aggregate_id.is_empty()
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers.inner().get(name)
    }

    /// A header's value as text (a long or short string header).
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(value_str)
    }

    /// A header's value as an integer (any integer type, or a decimal string).
    pub fn header_int(&self, name: &str) -> Option<i64> {
        self.header(name).and_then(value_int)
    }

    /// Reads a delivery. `Err` says why it has no usable message id (or carries text that
    /// PostgreSQL cannot store); such a message is dead-lettered, never handled.
    pub(crate) fn from_delivery(delivery: &Delivery) -> Result<Self, String> {
        let properties = &delivery.properties;
        let headers = properties.headers().clone().unwrap_or_default();
        let header_str = |name: &str| headers.inner().get(name).and_then(value_str).map(str::to_owned);
        let header_int = |name: &str| headers.inner().get(name).and_then(value_int);

        let message_id = match properties.message_id() {
            None => return Err("the message has no message_id property".into()),
            Some(id) => id
                .as_str()
                .trim()
                .parse::<i64>()
                .map_err(|_| format!("message_id {:?} is not a decimal 64-bit integer", id.as_str()))?,
        };
        if let Some(outbox_id) = header_int("x-outbox-id")
            && outbox_id != message_id
        {
            return Err(format!("message_id {message_id} disagrees with header x-outbox-id {outbox_id}"));
        }
        let event_type = properties.kind().as_ref().map(|k| k.as_str().to_owned()).unwrap_or_default();
        let aggregate_type = header_str("x-aggregate-type").unwrap_or_default();
        let aggregate_id = header_str("x-aggregate-id").unwrap_or_default();
        for (what, text) in
            [("type", &event_type), ("x-aggregate-type", &aggregate_type), ("x-aggregate-id", &aggregate_id)]
        {
            if text.contains('\0') {
                return Err(format!("{what} contains a NUL character, which PostgreSQL text cannot hold"));
            }
        }
        let attempt = header_int(ATTEMPT_HEADER).map_or(1, |a| u32::try_from(a.max(1)).unwrap_or(u32::MAX));
        let exchange = header_str(EXCHANGE_HEADER).unwrap_or_else(|| delivery.exchange.as_str().to_owned());
        let routing_key = header_str(ROUTING_KEY_HEADER).unwrap_or_else(|| delivery.routing_key.as_str().to_owned());
        let payload = serde_json::from_slice(&delivery.data).unwrap_or(serde_json::Value::Null);
        Ok(Self {
            message_id,
            event_type,
            aggregate_type,
            aggregate_id,
            attempt,
            redelivered: delivery.redelivered,
            publish_attempt: header_int("x-attempt"),
            late: false,
            newest_applied: None,
            exchange,
            routing_key,
            headers,
            payload,
            body: delivery.data.clone(),
        })
    }
}

fn value_str(value: &AMQPValue) -> Option<&str> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

fn value_int(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => value_str(value)?.trim().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::BasicProperties;

    use super::*;

    fn delivery(properties: BasicProperties, body: &[u8]) -> Delivery {
        let mut d = Delivery::mock(1, "outbox".into(), "order.created".into(), false, body.to_vec());
        d.properties = properties;
        d
    }

    #[test]
    fn reads_what_the_outbox_sink_sends() {
        let mut headers = FieldTable::default();
        headers.insert("x-outbox-id".into(), AMQPValue::LongLongInt(42));
        headers.insert("x-aggregate-type".into(), AMQPValue::LongString("order".into()));
        headers.insert("x-aggregate-id".into(), AMQPValue::LongString("o-1".into()));
        headers.insert("x-attempt".into(), AMQPValue::LongInt(2));
        let props = BasicProperties::default().with_message_id("42".into()).with_type("order.created".into());
        let m = InboxMessage::from_delivery(&delivery(props.with_headers(headers), br#"{"n":1}"#)).unwrap();
        assert_eq!((m.message_id, m.event_type.as_str()), (42, "order.created"));
        assert_eq!((m.aggregate_type.as_str(), m.aggregate_id.as_str()), ("order", "o-1"));
        assert_eq!((m.attempt, m.publish_attempt), (1, Some(2)));
        assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("outbox", "order.created"));
        assert_eq!(m.payload, serde_json::json!({"n": 1}));
    }

    #[test]
    fn refuses_messages_without_a_usable_id() {
        let none = InboxMessage::from_delivery(&delivery(BasicProperties::default(), b"{}")).unwrap_err();
        assert!(none.contains("no message_id"), "{none}");
        let text = BasicProperties::default().with_message_id("abc".into());
        assert!(InboxMessage::from_delivery(&delivery(text, b"{}")).unwrap_err().contains("not a decimal"));
        let mut headers = FieldTable::default();
        headers.insert("x-outbox-id".into(), AMQPValue::LongLongInt(7));
        let disagree = BasicProperties::default().with_message_id("8".into()).with_headers(headers);
        assert!(InboxMessage::from_delivery(&delivery(disagree, b"{}")).unwrap_err().contains("disagrees"));
        let nul = BasicProperties::default().with_message_id("9".into()).with_type("a\0b".into());
        assert!(InboxMessage::from_delivery(&delivery(nul, b"{}")).unwrap_err().contains("NUL"));
    }

    #[test]
    fn retried_copies_keep_their_attempt_and_first_route() {
        let mut headers = FieldTable::default();
        headers.insert(ATTEMPT_HEADER.into(), AMQPValue::LongInt(3));
        headers.insert(EXCHANGE_HEADER.into(), AMQPValue::LongString("outbox".into()));
        headers.insert(ROUTING_KEY_HEADER.into(), AMQPValue::LongString("order.paid".into()));
        let props = BasicProperties::default().with_message_id("5".into()).with_headers(headers);
        let mut d = delivery(props, b"not json");
        d.exchange = "".into();
        d.routing_key = "the-queue".into();
        let m = InboxMessage::from_delivery(&d).unwrap();
        assert_eq!(m.attempt, 3);
        assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("outbox", "order.paid"));
        assert_eq!(m.payload, serde_json::Value::Null);
        assert_eq!(m.body, b"not json");
    }
}
