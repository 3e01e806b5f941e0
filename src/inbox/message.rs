//! [`InboxMessage`]: what the handler sees of a delivery, and how a delivery becomes one.

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};

use crate::wire::{self, value_int, value_str};

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
/// The consumer builds it from a delivery in the outbox's [wire format](crate::wire): the AMQP
/// `message_id` (the producer's outbox id, decimal), the `type` property, the
/// `x-outbox-source`, `x-aggregate-type`, `x-aggregate-id` and `x-attempt` headers that the
/// outbox's RabbitMQ sink sets, and the body. A CloudEvent in the AMQP binding's binary mode
/// (from any producer) is read too: where the message has no `message_id`, `type` or
/// `x-outbox-source`, its `cloudEvents:id` (a decimal integer), `cloudEvents:type` and
/// `cloudEvents:source` stand in, and a `cloudEvents:subject` of the form
/// `<aggregate_type>/<aggregate_id>` stands in for the aggregate headers (see
/// [`wire`](crate::wire#cloudevents)).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct InboxMessage {
    /// The producing outbox (the `x-outbox-source` header, else `cloudEvents:source`); empty
    /// when the message had neither.
    /// With [`InboxMessage::message_id`] it is the key of exactly-once: ids are unique only
    /// within one source, so a message without a source must come from a producer whose ids
    /// are unique by themselves.
    pub source: String,
    /// The message id, shared by every copy of the message.
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
    /// The body parsed as JSON. `None` when the message says it is not JSON (a `content_type`
    /// other than `application/json` or `*+json`) or says nothing and is not JSON, or, under
    /// [`InboxConfig::raw_bodies`](super::InboxConfig::raw_bodies), whenever it does not parse.
    /// A message whose `content_type` says JSON but whose body does not parse is dead-lettered
    /// unless the consumer asked for raw bodies: a handler never sees an invented `null`.
    pub payload: Option<serde_json::Value>,
    /// The body as received.
    pub body: Vec<u8>,
}

impl InboxMessage {
    /// A message with this id, event type and payload and every other field empty (attempt 1),
    /// for testing handlers without a broker.
    pub fn new(message_id: i64, event_type: impl Into<String>, payload: serde_json::Value) -> Self {
        let body = serde_json::to_vec(&payload).unwrap_or_default();
        Self {
            source: String::new(),
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
            payload: Some(payload),
            body,
        }
    }

    /// Sets the source.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
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

    /// Reads a delivery. `Err` says why it has no usable message id, carries text that
    /// PostgreSQL cannot store, or says it is JSON and is not (unless `raw_bodies`); such a
    /// message is dead-lettered, never handled.
    pub(crate) fn from_delivery(delivery: &Delivery, raw_bodies: bool) -> Result<Self, String> {
        let properties = &delivery.properties;
        let headers = properties.headers().clone().unwrap_or_default();
        let header_str = |name: &str| headers.inner().get(name).and_then(value_str).map(str::to_owned);
        let header_int = |name: &str| headers.inner().get(name).and_then(value_int);

        // A CloudEvent of the AMQP binding (wire#cloudevents) names itself in `cloudEvents:*`
        // application properties (`cloudEvents_*` in the binding's later revision): read where
        // the outbox's own properties are absent.
        let ce = |name: &str| header_str(name).or_else(|| header_str(&name.replacen(':', "_", 1)));
        let message_id =
            match properties.message_id().as_ref().map(|id| id.as_str().to_owned()).or_else(|| ce(wire::CE_ID)) {
                None => return Err("the message has no message_id property (nor cloudEvents:id)".into()),
                Some(id) => id
                    .trim()
                    .parse::<i64>()
                    .map_err(|_| format!("message_id {id:?} is not a decimal 64-bit integer"))?,
            };
        let event_type =
            properties.kind().as_ref().map(|k| k.as_str().to_owned()).or_else(|| ce(wire::CE_TYPE)).unwrap_or_default();
        let source = header_str(wire::SOURCE).or_else(|| ce(wire::CE_SOURCE)).unwrap_or_default();
        let subject = ce(wire::CE_SUBJECT);
        let subject = subject.as_deref().and_then(|s| s.split_once('/'));
        let aggregate_type =
            header_str(wire::AGGREGATE_TYPE).or_else(|| subject.map(|(t, _)| t.to_owned())).unwrap_or_default();
        let aggregate_id =
            header_str(wire::AGGREGATE_ID).or_else(|| subject.map(|(_, i)| i.to_owned())).unwrap_or_default();
        for (what, text) in [
            ("type", &event_type),
            (wire::SOURCE, &source),
            (wire::AGGREGATE_TYPE, &aggregate_type),
            (wire::AGGREGATE_ID, &aggregate_id),
        ] {
            if text.contains('\0') {
                return Err(format!("{what} contains a NUL character, which PostgreSQL text cannot hold"));
            }
        }
        let attempt = header_int(ATTEMPT_HEADER).map_or(1, |a| u32::try_from(a.max(1)).unwrap_or(u32::MAX));
        let exchange = header_str(EXCHANGE_HEADER).unwrap_or_else(|| delivery.exchange.as_str().to_owned());
        let routing_key = header_str(ROUTING_KEY_HEADER).unwrap_or_else(|| delivery.routing_key.as_str().to_owned());
        let payload = match serde_json::from_slice(&delivery.data) {
            Ok(value) => Some(value),
            Err(e) => match properties.content_type() {
                Some(t) if wire::is_json_content_type(t.as_str()) && !raw_bodies => {
                    return Err(format!("content_type {:?} but the body is not JSON: {e}", t.as_str()));
                }
                _ => None,
            },
        };
        Ok(Self {
            source,
            message_id,
            event_type,
            aggregate_type,
            aggregate_id,
            attempt,
            redelivered: delivery.redelivered,
            publish_attempt: header_int(wire::ATTEMPT),
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
        let payload = serde_json::value::to_raw_value(&serde_json::json!({"n": 1})).unwrap();
        let mut sent = crate::OutboxMessage::new(42, "order", "o-1", "order.created", payload);
        sent.source = "7/shop/public.outbox".into();
        sent.attempts = 2;
        let props = crate::sink::RabbitConfig::new("amqp://localhost").properties(&sent).unwrap();
        let m = InboxMessage::from_delivery(&delivery(props, br#"{"n":1}"#), false).unwrap();
        assert_eq!(
            (m.source.as_str(), m.message_id, m.event_type.as_str()),
            ("7/shop/public.outbox", 42, "order.created")
        );
        assert_eq!((m.aggregate_type.as_str(), m.aggregate_id.as_str()), ("order", "o-1"));
        assert_eq!((m.attempt, m.publish_attempt), (1, Some(2)));
        assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("outbox", "order.created"));
        assert_eq!(m.payload, Some(serde_json::json!({"n": 1})));
    }

    #[test]
    fn a_message_without_a_source_has_an_empty_one() {
        let props = BasicProperties::default().with_message_id("3".into());
        let m = InboxMessage::from_delivery(&delivery(props, b"{}"), false).unwrap();
        assert_eq!((m.source.as_str(), m.message_id), ("", 3));
    }

    #[test]
    fn refuses_messages_without_a_usable_id() {
        let none = InboxMessage::from_delivery(&delivery(BasicProperties::default(), b"{}"), false).unwrap_err();
        assert!(none.contains("no message_id"), "{none}");
        let text = BasicProperties::default().with_message_id("abc".into());
        assert!(InboxMessage::from_delivery(&delivery(text, b"{}"), false).unwrap_err().contains("not a decimal"));
        let nul = BasicProperties::default().with_message_id("9".into()).with_type("a\0b".into());
        assert!(InboxMessage::from_delivery(&delivery(nul, b"{}"), false).unwrap_err().contains("NUL"));
    }

    #[test]
    fn a_body_that_says_json_and_is_not_is_refused_unless_raw() {
        let json = BasicProperties::default().with_message_id("4".into()).with_content_type("application/json".into());
        for body in [&b"{not json"[..], b"\xff\xfe", b""] {
            let e = InboxMessage::from_delivery(&delivery(json.clone(), body), false).unwrap_err();
            assert!(e.contains("body is not JSON"), "{e}");
            let raw = InboxMessage::from_delivery(&delivery(json.clone(), body), true).unwrap();
            assert_eq!((raw.payload, raw.body.as_slice()), (None, body));
        }
        let text = BasicProperties::default().with_message_id("5".into()).with_content_type("text/plain".into());
        let m = InboxMessage::from_delivery(&delivery(text, b"hello"), false).unwrap();
        assert_eq!((m.payload, m.body.as_slice()), (None, &b"hello"[..]), "a body that never claimed to be JSON");
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
        let m = InboxMessage::from_delivery(&d, false).unwrap();
        assert_eq!(m.attempt, 3);
        assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("outbox", "order.paid"));
        assert_eq!(m.payload, None);
        assert_eq!(m.body, b"not json");
    }
}
