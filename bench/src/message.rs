//! What the benchmark sends: the body of message `n`, and the sink configuration whose AMQP
//! properties both the dispatcher's sink and the raw publisher put on it, so that the broker
//! ceiling publishes byte for byte what end to end publishes.

use std::sync::Arc;

use actix_outbox::OutboxMessage;
use actix_outbox::sink::RabbitConfig;
use lapin::BasicProperties;

use crate::{EVENT_TYPE, Opts};

/// The body of message `n`: what the seeded rows' `payload` serialises to.
pub(crate) fn body(n: i64, pad: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "n": n, "pad": pad })).expect("a JSON value serialises")
}

/// The RabbitMQ sink's configuration for this run: every default, but the nodes (one, or the
/// bench's cluster's), the exchange, the connection's name and `--no-outbox-headers`.
pub(crate) fn rabbit_config(opts: &Opts, exchange: &str) -> RabbitConfig {
    RabbitConfig::cluster(opts.amqp_url.split(','))
        .exchange(exchange)
        .connection_name("actix-outbox bench")
        .outbox_headers(!opts.no_outbox_headers)
}

/// The properties and headers the sink configured by `config` gives message `id` of aggregate
/// `aggregate_id` from outbox `source`: the raw publisher's, asked of the library rather than
/// rebuilt, so they cannot drift from what the sink sends.
pub(crate) fn properties(config: &RabbitConfig, source: &Arc<str>, id: i64, aggregate_id: &str) -> BasicProperties {
    // Only the properties are wanted: the body travels on its own (see `body`).
    let payload = serde_json::value::RawValue::NULL.to_owned();
    let mut message = OutboxMessage::new(id, "bench", aggregate_id, EVENT_TYPE, payload);
    message.source = source.clone();
    config.properties(&message).expect("a bench message (a fixed event type, no producer headers) is sendable")
}
