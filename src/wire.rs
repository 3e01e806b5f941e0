//! The message format on the wire: the AMQP properties and headers of every message the
//! RabbitMQ sink publishes, and how a consumer reads them back. Both sides use this module, so
//! the header names are spelled once.
//!
//! A message published for outbox row `id` of the outbox `source` carries:
//!
//! | where | value |
//! | --- | --- |
//! | `message_id` property | `id` in decimal: the same on every attempt |
//! | `type` property | the event type |
//! | `content_type` property | `application/json` |
//! | `timestamp` property | the row's `created_at`, Unix seconds |
//! | `app_id` property | [`RabbitConfig::app_id`](crate::sink::RabbitConfig::app_id) |
//! | [`SOURCE`] header | the producing outbox (see below) |
//! | [`AGGREGATE_TYPE`], [`AGGREGATE_ID`] headers | the row's aggregate |
//! | [`ATTEMPT`] header | the claim's attempt number, 1 on the first |
//! | [`DEDUPLICATION`] header | `<source>/<id>`, only when turned on, for brokers that run the message-deduplication plugin |
//! | the producer's headers | [`NewEvent::header`](crate::NewEvent::header), as long strings |
//!
//! Delivery is persistent. The body is the payload's JSON text.
//!
//! # Message identity
//!
//! An outbox id is unique in its table only: two producer databases both have a row 1. The
//! pair `(source, message_id)` is unique across every outbox, and it is what consumers
//! deduplicate on (the inbox, `actix_outbox::inbox`, does). The source is, by default,
//! `<system identifier>/<database>/<schema>.outbox`, derived when the dispatcher starts from
//! PostgreSQL's `pg_control_system()`, `current_database()` and the table's schema, so no two
//! outboxes share one without configuration; [`DispatcherConfig::source`] sets it by hand
//! (for example to keep it when a database is restored onto a new cluster).
//!
//! [`DispatcherConfig::source`]: crate::DispatcherConfig::source

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::error::PublishError;
use crate::model::OutboxMessage;

/// Header naming the outbox that produced the message (see [Message identity](self#message-identity)).
pub const SOURCE: &str = "x-outbox-source";
/// Header carrying the row's `aggregate_type`.
pub const AGGREGATE_TYPE: &str = "x-aggregate-type";
/// Header carrying the row's `aggregate_id`.
pub const AGGREGATE_ID: &str = "x-aggregate-id";
/// Header carrying the dispatcher's attempt that published this copy (1 on the first).
pub const ATTEMPT: &str = "x-attempt";
/// Header that RabbitMQ's message-deduplication plugin reads; sent only when turned on
/// ([`RabbitConfig::deduplication_header`](crate::sink::RabbitConfig::deduplication_header)),
/// as `<source>/<id>`.
pub const DEDUPLICATION: &str = "x-deduplication-header";
/// The `content_type` of every message.
pub const CONTENT_TYPE: &str = "application/json";

/// The most bytes a message's producer headers may take encoded in the AMQP field table (about
/// the sum of their names' and values' lengths, plus 7 bytes each). The content header that
/// carries them must fit in one frame (RabbitMQ's default `frame_max` is 128 KiB); a broker
/// closes the connection on a larger one, so a larger table fails its message permanently.
pub const MAX_PRODUCER_HEADER_BYTES: usize = 64 * 1024;

/// Whether a producer's header `name` is one the sink sets itself (or may set later): those win
/// over the producer's (see [`NewEvent::header`](crate::NewEvent::header)).
pub(crate) fn is_reserved(name: &str) -> bool {
    name.starts_with("x-outbox-") || name.starts_with("x-aggregate-") || name == DEDUPLICATION || name == ATTEMPT
}

/// Which of the sink's own headers a message carries.
#[derive(Debug, Clone)]
pub(crate) struct Format {
    /// The `app_id` property.
    pub(crate) app_id: ShortString,
    /// The header table: [`SOURCE`], [`AGGREGATE_TYPE`], [`AGGREGATE_ID`], [`ATTEMPT`].
    pub(crate) outbox_headers: bool,
    /// [`DEDUPLICATION`].
    pub(crate) deduplication_header: bool,
}

/// The AMQP properties and headers of `message` (the table above).
pub(crate) fn properties(message: &OutboxMessage, format: &Format) -> Result<BasicProperties, PublishError> {
    let event_type = ShortString::try_new(message.event_type.as_str())
        .map_err(|e| PublishError::Permanent(format!("event type cannot be sent as the AMQP `type` property: {e}")))?;
    let id = message.id.to_string();
    let mut headers = FieldTable::default();
    // The producer's headers first, so that ours, inserted after, win a clash; names in our
    // namespaces are left out altogether (see `is_reserved`).
    let mut encoded = 0_usize;
    for (name, value) in &message.headers {
        if is_reserved(name) {
            continue;
        }
        // Name length octet, name, type tag, value length, value.
        encoded = encoded.saturating_add(1 + name.len() + 1 + 4 + value.len());
        let key = ShortString::try_new(name.as_str()).map_err(|_| {
            PublishError::Permanent(format!(
                "header name \"{}...\" is {} bytes long; AMQP allows 255",
                name.chars().take(32).collect::<String>(),
                name.len()
            ))
        })?;
        if u32::try_from(value.len()).is_err() {
            return Err(PublishError::Permanent(format!(
                "header {name:?} has a {}-byte value; AMQP allows 4 GiB",
                value.len()
            )));
        }
        headers.insert(key, AMQPValue::LongString(value.as_str().into()));
    }
    // The properties travel in one content-header frame, which the broker refuses (closing the
    // connection) beyond its frame size: a message that can never go must not look like an outage.
    if encoded > MAX_PRODUCER_HEADER_BYTES {
        return Err(PublishError::Permanent(format!(
            "the producer's headers take {encoded} bytes encoded; at most {MAX_PRODUCER_HEADER_BYTES} fit the AMQP \
             content header"
        )));
    }
    if format.outbox_headers {
        headers.insert(SOURCE.into(), AMQPValue::LongString(message.source.as_ref().into()));
        headers.insert(AGGREGATE_TYPE.into(), AMQPValue::LongString(message.aggregate_type.as_str().into()));
        headers.insert(AGGREGATE_ID.into(), AMQPValue::LongString(message.aggregate_id.as_str().into()));
        headers.insert(ATTEMPT.into(), AMQPValue::LongInt(message.attempts));
    }
    if format.deduplication_header {
        let key = format!("{}/{id}", message.source);
        headers.insert(DEDUPLICATION.into(), AMQPValue::LongString(key.as_str().into()));
    }
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(CONTENT_TYPE.into())
        .with_message_id(id.into())
        .with_type(event_type)
        .with_timestamp(u64::try_from(message.created_at.timestamp()).unwrap_or(0))
        .with_app_id(format.app_id.clone());
    // No table at all rather than an empty one: the broker pays for a table's presence.
    Ok(if headers.inner().is_empty() { properties } else { properties.with_headers(headers) })
}

/// A header's value as text (a long or short string that is UTF-8).
#[cfg_attr(not(feature = "inbox"), allow(dead_code))]
pub(crate) fn value_str(value: &AMQPValue) -> Option<&str> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

/// A header's value as an integer (any integer type, or a decimal string).
#[cfg_attr(not(feature = "inbox"), allow(dead_code))]
pub(crate) fn value_int(value: &AMQPValue) -> Option<i64> {
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

/// Whether a `content_type` says the body is JSON (`application/json`, or any `+json` type),
/// parameters such as `; charset=utf-8` aside.
#[cfg_attr(not(feature = "inbox"), allow(dead_code))]
pub(crate) fn is_json_content_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == CONTENT_TYPE || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(outbox_headers: bool, deduplication_header: bool) -> Format {
        Format { app_id: "app".into(), outbox_headers, deduplication_header }
    }

    fn message() -> OutboxMessage {
        let payload = serde_json::value::to_raw_value(&serde_json::json!({})).unwrap();
        let mut m = OutboxMessage::new(42, "order", "o-1", "order.paid", payload);
        m.source = "7/shop/public.outbox".into();
        m
    }

    fn header_names(p: &BasicProperties) -> Vec<String> {
        p.headers().as_ref().map_or(Vec::new(), |h| h.inner().keys().map(|k| k.to_string()).collect())
    }

    #[test]
    fn the_table_names_the_source_and_no_longer_repeats_the_id() {
        let p = properties(&message(), &format(true, false)).unwrap();
        assert_eq!(header_names(&p), [AGGREGATE_ID, AGGREGATE_TYPE, ATTEMPT, SOURCE]);
        let headers = p.headers().clone().unwrap();
        assert_eq!(headers.inner().get(SOURCE).and_then(value_str), Some("7/shop/public.outbox"));
        assert_eq!(p.message_id().as_ref().map(ShortString::as_str), Some("42"));
    }

    #[test]
    fn the_deduplication_header_is_opt_in_and_keyed_by_source() {
        let p = properties(&message(), &format(false, true)).unwrap();
        assert_eq!(header_names(&p), [DEDUPLICATION]);
        let headers = p.headers().clone().unwrap();
        assert_eq!(headers.inner().get(DEDUPLICATION).and_then(value_str), Some("7/shop/public.outbox/42"));
        assert!(properties(&message(), &format(false, false)).unwrap().headers().is_none(), "lean: no table");
    }

    #[test]
    fn json_content_types() {
        for json in ["application/json", "Application/JSON; charset=utf-8", "application/cloudevents+json"] {
            assert!(is_json_content_type(json), "{json}");
        }
        for other in ["text/plain", "application/octet-stream", "application/jsonx", ""] {
            assert!(!is_json_content_type(other), "{other}");
        }
    }
}
