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
//! | `cloudEvents:*` application properties | only in [`CloudEventsMode::Binary`](crate::sink::CloudEventsMode::Binary); see [CloudEvents](self#cloudevents) |
//!
//! Delivery is persistent. The body is the payload's JSON text. The exchange and the routing
//! key are the sink's ([`RabbitConfig::exchange`](crate::sink::RabbitConfig::exchange),
//! [`RabbitConfig::routing_key_template`](crate::sink::RabbitConfig::routing_key_template)) unless the event
//! names its own ([`NewEvent::exchange`](crate::NewEvent::exchange),
//! [`NewEvent::routing_key`](crate::NewEvent::routing_key), stored as the reserved headers
//! [`EXCHANGE`] and [`ROUTING_KEY`], which are never published).
//!
//! # CloudEvents
//!
//! In [`CloudEventsMode::Binary`](crate::sink::CloudEventsMode::Binary) every message is also a
//! CloudEvent in the binary content mode of the CloudEvents AMQP protocol binding 1.0: the body
//! is the event's data, `content_type` its `datacontenttype` (`application/json`), and the
//! attributes are application properties (AMQP headers) named `cloudEvents:<attribute>`, each
//! a string:
//!
//! | header | value |
//! | --- | --- |
//! | [`CE_SPECVERSION`] | `1.0` |
//! | [`CE_ID`] | the outbox id in decimal (the `message_id`) |
//! | [`CE_SOURCE`] | the outbox's source (see [Message identity](self#message-identity)), a URI reference: characters a URI cannot hold (space, `%`, non-ASCII...) percent-encoded |
//! | [`CE_TYPE`] | the event type |
//! | [`CE_TIME`] | the row's `created_at`, RFC 3339 in UTC with microseconds |
//! | [`CE_SUBJECT`] | `<aggregate_type>/<aggregate_id>` |
//!
//! The inbox reads [`CE_SOURCE`], [`CE_ID`] and [`CE_TYPE`] when the message has no
//! [`SOURCE`] header, `message_id` or `type` property, so it deduplicates CloudEvents of any
//! producer whose ids are decimal integers. It accepts the `cloudEvents_` prefix as well, which
//! later revisions of the binding prefer (some brokers and SDKs reject `:` in property names);
//! the sink writes `cloudEvents:`, the spelling of the binding 1.0 (the tests read it back
//! with the Rust `cloudevents-sdk`).
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

use lapin::types::AMQPValue;

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
/// The reserved producer header that names a message's routing key
/// ([`NewEvent::routing_key`](crate::NewEvent::routing_key)); never published.
pub const ROUTING_KEY: &str = "x-outbox-routing-key";
/// The reserved producer header that names a message's exchange
/// ([`NewEvent::exchange`](crate::NewEvent::exchange)); never published.
pub const EXCHANGE: &str = "x-outbox-exchange";
/// CloudEvents `specversion` attribute, as an AMQP application property.
pub const CE_SPECVERSION: &str = "cloudEvents:specversion";
/// CloudEvents `id` attribute, as an AMQP application property.
pub const CE_ID: &str = "cloudEvents:id";
/// CloudEvents `source` attribute, as an AMQP application property.
pub const CE_SOURCE: &str = "cloudEvents:source";
/// CloudEvents `type` attribute, as an AMQP application property.
pub const CE_TYPE: &str = "cloudEvents:type";
/// CloudEvents `time` attribute, as an AMQP application property.
pub const CE_TIME: &str = "cloudEvents:time";
/// CloudEvents `subject` attribute, as an AMQP application property.
pub const CE_SUBJECT: &str = "cloudEvents:subject";
/// The prefix of every CloudEvents attribute in the AMQP binding.
pub const CE_PREFIX: &str = "cloudEvents:";
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

/// Whether RabbitMQ accepts `name` as the exchange an event names ([`EXCHANGE`]): at most 255
/// bytes of letters, digits, `-`, `_`, `.` and `:`, not empty (the default exchange is the
/// sink's to choose).
pub(crate) fn check_exchange(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the event names an empty exchange; leave it out to use the sink's".into());
    }
    if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "-_.:".contains(*c))) {
        return Err(format!(
            "exchange name {name:?} holds {bad:?}; RabbitMQ allows letters, digits, '-', '_', '.' and ':'"
        ));
    }
    if name.len() > 255 {
        return Err(format!("exchange name is {} bytes long; AMQP allows 255", name.len()));
    }
    Ok(())
}

/// Whether AMQP can carry `key` as a routing key: at most 255 bytes.
pub(crate) fn check_routing_key(key: &str) -> Result<(), String> {
    if key.len() > 255 {
        return Err(format!("routing key is {} bytes long; AMQP allows 255", key.len()));
    }
    Ok(())
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
