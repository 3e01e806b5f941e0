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

/// Which of the sink's own headers a message carries.
#[derive(Debug, Clone)]
pub(crate) struct Format {
    /// The `app_id` property.
    pub(crate) app_id: ShortString,
    /// The header table: [`SOURCE`], [`AGGREGATE_TYPE`], [`AGGREGATE_ID`], [`ATTEMPT`].
    pub(crate) outbox_headers: bool,
    /// [`DEDUPLICATION`].
    pub(crate) deduplication_header: bool,
    /// The `cloudEvents:*` attributes (see [CloudEvents](self#cloudevents)).
    pub(crate) cloudevents: bool,
}

/// The characters a URI reference cannot hold as they are (RFC 3986: anything but unreserved,
/// reserved and `%`-escapes), `%` itself included so that encoding is reversible.
const NOT_URI: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'\\')
    .add(b'^')
    .add(b'`')
    .add(b'{')
    .add(b'|')
    .add(b'}');

/// The outbox source as a CloudEvents `source`: a URI reference. A first path segment with a
/// `:` would read as a scheme, so a source with a `:` before any `/` that is not a valid scheme
/// gets its colons encoded.
pub(crate) fn cloudevents_source(source: &str) -> String {
    let encoded = percent_encoding::utf8_percent_encode(source, NOT_URI).to_string();
    let first = encoded.split(['/', '?', '#']).next().unwrap_or_default();
    match first.split_once(':') {
        Some((scheme, _))
            if scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            encoded
        }
        Some(_) => encoded.replacen(':', "%3A", first.matches(':').count()),
        None if encoded.is_empty() => "urn:actix-outbox:unnamed".to_owned(),
        None => encoded,
    }
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
        if is_reserved(name) || (format.cloudevents && name.starts_with(CE_PREFIX)) {
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
    if format.cloudevents {
        let text = |s: &str| AMQPValue::LongString(s.into());
        headers.insert(CE_SPECVERSION.into(), text("1.0"));
        headers.insert(CE_ID.into(), text(&id));
        headers.insert(CE_SOURCE.into(), text(&cloudevents_source(&message.source)));
        headers.insert(CE_TYPE.into(), text(&message.event_type));
        let time = message.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        headers.insert(CE_TIME.into(), text(&time));
        let subject = format!("{}/{}", message.aggregate_type, message.aggregate_id);
        headers.insert(CE_SUBJECT.into(), text(&subject));
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
        Format { app_id: "app".into(), outbox_headers, deduplication_header, cloudevents: false }
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
    fn sources_become_uri_references() {
        assert_eq!(cloudevents_source("7/shop/public.outbox"), "7/shop/public.outbox");
        assert_eq!(cloudevents_source("urn:shop:orders"), "urn:shop:orders");
        assert_eq!(cloudevents_source("my shop/100%"), "my%20shop/100%25");
        assert_eq!(cloudevents_source("1:2/x:y"), "1%3A2/x:y");
        assert_eq!(cloudevents_source(""), "urn:actix-outbox:unnamed");
    }

    #[test]
    fn cloudevents_attributes_are_strings_and_win_over_the_producers() {
        let mut m = message();
        m.headers.insert(CE_TYPE.into(), "forged".into());
        m.created_at = "2026-01-02T03:04:05.123456Z".parse().unwrap();
        let p = properties(&m, &Format { cloudevents: true, ..format(false, false) }).unwrap();
        let headers = p.headers().clone().unwrap();
        let get = |name: &str| headers.inner().get(name).and_then(value_str).map(str::to_owned);
        assert_eq!(header_names(&p), [CE_ID, CE_SOURCE, CE_SPECVERSION, CE_SUBJECT, CE_TIME, CE_TYPE]);
        assert_eq!(get(CE_ID).as_deref(), Some("42"));
        assert_eq!(get(CE_SOURCE).as_deref(), Some("7/shop/public.outbox"));
        assert_eq!(get(CE_TYPE).as_deref(), Some("order.paid"));
        assert_eq!(get(CE_TIME).as_deref(), Some("2026-01-02T03:04:05.123456Z"));
        assert_eq!(get(CE_SUBJECT).as_deref(), Some("order/o-1"));
        assert_eq!(get(CE_SPECVERSION).as_deref(), Some("1.0"));
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
