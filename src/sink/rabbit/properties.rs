//! The AMQP properties and headers the sink gives a message: the table of the
//! [`wire`](crate::wire) format, built from an [`OutboxMessage`] and the sink's [`Format`].

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::error::PublishError;
use crate::model::OutboxMessage;
use crate::wire::{
    AGGREGATE_ID, AGGREGATE_TYPE, ATTEMPT, CE_ID, CE_PREFIX, CE_SOURCE, CE_SPECVERSION, CE_SUBJECT, CE_TIME, CE_TYPE,
    CONTENT_TYPE, DEDUPLICATION, MAX_PRODUCER_HEADER_BYTES, SOURCE, is_reserved,
};

/// Which of the sink's own headers a message carries.
#[derive(Debug, Clone)]
pub(crate) struct Format {
    /// The `app_id` property.
    pub(crate) app_id: ShortString,
    /// The header table: [`SOURCE`], [`AGGREGATE_TYPE`], [`AGGREGATE_ID`], [`ATTEMPT`].
    pub(crate) outbox_headers: bool,
    /// [`DEDUPLICATION`].
    pub(crate) deduplication_header: bool,
    /// The `cloudEvents:*` attributes (see [CloudEvents](crate::wire#cloudevents)).
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

/// The AMQP properties and headers of `message` (the table of [`wire`](crate::wire)).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::value_str;

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
}
