//! [`RabbitConfig`]: how the sink connects and what it publishes, with its defaults and checks.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::ShortString;

use super::binding::{self, QueueBinding, QueueKind};
use super::properties::{self, Format};
use super::{ExchangeKind, RabbitError};
use crate::amqp;
use crate::config::{name_setters, pair_setter, setters};
use crate::error::PublishError;
use crate::model::OutboxMessage;
use crate::url::mask_url;
use crate::wire;

/// The exchange published to by default.
const DEFAULT_EXCHANGE: &str = "outbox";
/// The `app_id` property set on every message by default.
const DEFAULT_APP_ID: &str = "actix-outbox";
/// How long one attempt to connect (TCP, handshake, confirms, exchange declaration) may take by
/// default.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// First delay before reconnecting after the link is lost, by default.
const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest delay between two reconnection attempts, by default.
const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(10);
/// How long a broker may confirm nothing while publishes wait before the link is taken for
/// dead, by default.
const DEFAULT_UNRESPONSIVE_AFTER: Duration = Duration::from_secs(5);

/// Computes a message's routing key; see [`RabbitConfig::routing_key`].
pub type RoutingKeyFn = dyn Fn(&OutboxMessage) -> String + Send + Sync;

/// Whether messages are also CloudEvents; see [`RabbitConfig::cloudevents`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloudEventsMode {
    /// Plain outbox messages (the default).
    #[default]
    Off,
    /// Every message is a CloudEvent in the binary content mode of the CloudEvents AMQP
    /// protocol binding 1.0: `cloudEvents:*` application properties, the body the event's data
    /// (see [`wire`](crate::wire#cloudevents)).
    Binary,
}

impl std::str::FromStr for CloudEventsMode {
    type Err = String;

    /// `off` or `binary`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "binary" => Ok(Self::Binary),
            other => Err(format!("unknown CloudEvents mode {other:?}; expected `off` or `binary`")),
        }
    }
}

/// One piece of a parsed routing key template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    AggregateType,
    AggregateId,
    EventType,
    Source,
}

/// A parsed [`RabbitConfig::routing_key_template`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct Template(Vec<Piece>);

impl Template {
    /// Parses `template`: text with the placeholders `{aggregate_type}`, `{aggregate_id}`,
    /// `{event_type}` and `{source}`; `{{` and `}}` stand for braces.
    fn parse(template: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut chars = template.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|&(_, n)| n) == Some('{') => {
                    chars.next();
                    text.push('{');
                }
                '}' if chars.peek().map(|&(_, n)| n) == Some('}') => {
                    chars.next();
                    text.push('}');
                }
                '{' => {
                    let rest = &template[at + 1..];
                    let Some(end) = rest.find(['}', '{']).filter(|&end| rest[end..].starts_with('}')) else {
                        return Err(format!(
                            "routing key template {template:?}: the brace at byte {at} is not closed \
                             (write {{{{ for a literal brace)"
                        ));
                    };
                    let name = &rest[..end];
                    let piece = match name {
                        "aggregate_type" => Piece::AggregateType,
                        "aggregate_id" => Piece::AggregateId,
                        "event_type" => Piece::EventType,
                        "source" => Piece::Source,
                        other => {
                            return Err(format!(
                                "routing key template {template:?}: unknown placeholder {{{other}}}; \
                                 known: {{aggregate_type}}, {{aggregate_id}}, {{event_type}}, {{source}}"
                            ));
                        }
                    };
                    if !text.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut text)));
                    }
                    pieces.push(piece);
                    for _ in 0..name.chars().count() + 1 {
                        chars.next();
                    }
                }
                '}' => {
                    return Err(format!(
                        "routing key template {template:?}: the brace at byte {at} closes nothing \
                         (write }}}} for a literal brace)"
                    ));
                }
                c => text.push(c),
            }
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        Ok(Self(pieces))
    }

    fn render(&self, message: &OutboxMessage) -> String {
        let mut key = String::new();
        for piece in &self.0 {
            key.push_str(match piece {
                Piece::Text(t) => t,
                Piece::AggregateType => &message.aggregate_type,
                Piece::AggregateId => &message.aggregate_id,
                Piece::EventType => &message.event_type,
                Piece::Source => &message.source,
            });
        }
        key
    }
}

/// How a [`RabbitSink`](super::RabbitSink) connects and what it publishes.
///
/// Start from [`RabbitConfig::new`] (every default set there) and chain setters:
///
/// ```
/// use std::time::Duration;
/// use actix_outbox::sink::{ExchangeKind, RabbitConfig};
///
/// let config = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
///     .exchange("orders")
///     .exchange_kind(ExchangeKind::Direct)
///     .app_id("billing")
///     .routing_key(|m| format!("{}.{}", m.aggregate_type, m.event_type))
///     .reconnect_backoff(Duration::from_millis(50), Duration::from_secs(5))
///     .bind_queue("billing.orders", "order.#");
/// config.validate().unwrap();
/// assert!(format!("{config:?}").contains("guest:***@"), "the password never reaches a log");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct RabbitConfig {
    /// The AMQP URLs of the broker, one per node of a cluster (at least one), e.g.
    /// `amqp://guest:guest@127.0.0.1:5672/%2f` (the `%2f` is the vhost `/`). The sink connects
    /// to the first; each later connection attempt (after a failed one, or after the link was
    /// lost) moves on to the next, in turn. Query options are honoured by lapin;
    /// `?heartbeat=10` bounds how long a broker that went silent without closing the TCP
    /// connection (a dead host, a stuck network path) looks alive.
    pub urls: Vec<String>,
    /// The exchange every message is published to. Default `outbox`.
    pub exchange: String,
    /// The exchange's type, used when the sink declares it. Default [`ExchangeKind::Topic`].
    pub exchange_kind: ExchangeKind,
    /// Whether the sink declares the exchange (durable, of [`RabbitConfig::exchange_kind`]) each
    /// time it connects. Turn it off when the exchange is managed elsewhere; publishing to an
    /// exchange that does not exist then fails retryably (the broker closes the channel with
    /// 404) until someone creates it. Default `true`.
    pub declare_exchange: bool,
    /// Durable queues the sink declares and binds to the exchange each time it connects, after
    /// the exchange; see [`RabbitConfig::bind_queue`]. Default none.
    pub bindings: Vec<QueueBinding>,
    /// The `app_id` property of every message. Default `actix-outbox`.
    pub app_id: String,
    /// Bound on one connection attempt (TCP connect, AMQP handshake, confirm mode, exchange
    /// and queue declarations). Default 10 s.
    pub connect_timeout: Duration,
    /// Delay before the first reconnection attempt after the link is lost; it doubles on every
    /// failed attempt up to [`RabbitConfig::reconnect_max`], with jitter. Default 100 ms.
    pub reconnect_min: Duration,
    /// Longest delay between reconnection attempts. Default 10 s.
    pub reconnect_max: Duration,
    /// The connection name shown in RabbitMQ's management UI. Default: the `app_id`.
    pub connection_name: Option<String>,
    /// A link whose broker has confirmed nothing for this long while publishes wait (and that
    /// is not blocked by the broker) is taken for dead: the sink reports itself
    /// [`SinkState::Down`](crate::sink::SinkState::Down), drops the link and reconnects, and the waiting publishes fail as
    /// [`PublishError::Unavailable`] (attempt refunded). Keep it below the dispatcher's publish
    /// timeout. Default 5 s.
    pub unresponsive_after: Duration,
    /// Whether each message carries the sink's header table (`x-outbox-source`,
    /// `x-aggregate-type`, `x-aggregate-id`, `x-attempt`; see [`wire`](crate::wire)). Default
    /// `true`.
    ///
    /// Without it ("lean" messages) a message still has its `message_id` (the outbox id),
    /// `type`, `content_type`, `timestamp`, `app_id` and the producer's own headers, and a
    /// message whose row has no producer headers goes with no header table at all. That is
    /// cheaper for the broker, chiefly while messages pile up in a queue (RabbitMQ keeps every
    /// queued message's decoded header table in memory). Turn it off only when no consumer
    /// needs the source or the aggregate: the inbox (`actix_outbox::inbox`) keys on the source (a lean
    /// message counts as one of an unnamed producer, whose ids must then be unique by
    /// themselves) and orders by the aggregate.
    pub outbox_headers: bool,
    /// Whether each message carries `x-deduplication-header` = `<source>/<id>`, the key that
    /// RabbitMQ's message-deduplication plugin reads (see [`wire::DEDUPLICATION`]). Turn it on
    /// for brokers that run the plugin. Default `false`.
    pub deduplication_header: bool,
    /// Whether every message is also a CloudEvent; see [`CloudEventsMode`]. Default
    /// [`CloudEventsMode::Off`].
    pub cloudevents: CloudEventsMode,
    pub(super) routing_key: Option<Arc<RoutingKeyFn>>,
    /// What [`RabbitConfig::routing_key_template`] was given, and why it does not parse.
    template: Option<(String, Option<String>)>,
}

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("urls", &self.urls.iter().map(|u| mask_url(u)).collect::<Vec<_>>())
            .field("exchange", &self.exchange)
            .field("exchange_kind", &self.exchange_kind)
            .field("declare_exchange", &self.declare_exchange)
            .field("bindings", &self.bindings)
            .field("app_id", &self.app_id)
            .field("connect_timeout", &self.connect_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("connection_name", &self.connection_name)
            .field("unresponsive_after", &self.unresponsive_after)
            .field("outbox_headers", &self.outbox_headers)
            .field("deduplication_header", &self.deduplication_header)
            .field("cloudevents", &self.cloudevents)
            .field(
                "routing_key",
                &match (&self.template, &self.routing_key) {
                    (Some((template, _)), _) => template.as_str(),
                    (None, Some(_)) => "custom",
                    (None, None) => "event_type",
                },
            )
            .finish()
    }
}

impl RabbitConfig {
    /// A configuration for the broker at `url`, with every other setting at its default (each
    /// also named on its field):
    ///
    /// | setting | default |
    /// | --- | --- |
    /// | [`exchange`](RabbitConfig::exchange) | `outbox` |
    /// | [`exchange_kind`](RabbitConfig::exchange_kind) | [`ExchangeKind::Topic`] |
    /// | [`declare_exchange`](RabbitConfig::declare_exchange) | `true` |
    /// | [`bindings`](RabbitConfig::bindings) | none |
    /// | [`app_id`](RabbitConfig::app_id) | `actix-outbox` |
    /// | [`connect_timeout`](RabbitConfig::connect_timeout) | 10 s |
    /// | [`reconnect_min`](RabbitConfig::reconnect_min), [`reconnect_max`](RabbitConfig::reconnect_max) | 100 ms, 10 s |
    /// | [`connection_name`](RabbitConfig::connection_name) | `None`: the `app_id` |
    /// | [`unresponsive_after`](RabbitConfig::unresponsive_after) | 5 s |
    /// | [`outbox_headers`](RabbitConfig::outbox_headers) | `true` |
    /// | [`deduplication_header`](RabbitConfig::deduplication_header) | `false` |
    /// | [`cloudevents`](RabbitConfig::cloudevents) | [`CloudEventsMode::Off`] |
    /// | [`routing_key`](RabbitConfig::routing_key) | the event type |
    ///
    /// ```
    /// let config = actix_outbox::sink::RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f");
    /// assert_eq!((config.exchange.as_str(), config.app_id.as_str()), ("outbox", "actix-outbox"));
    /// ```
    pub fn new(url: impl Into<String>) -> Self {
        Self::cluster([url.into()])
    }

    /// A configuration for a cluster whose nodes are at `urls` (tried in turn; see
    /// [`RabbitConfig::urls`]), with every other setting at its default.
    ///
    /// ```
    /// let config = actix_outbox::sink::RabbitConfig::cluster(["amqp://rabbit-1:5672/%2f", "amqp://rabbit-2:5672/%2f"]);
    /// assert_eq!(config.urls.len(), 2);
    /// ```
    pub fn cluster<U: Into<String>>(urls: impl IntoIterator<Item = U>) -> Self {
        Self {
            urls: urls.into_iter().map(Into::into).collect(),
            exchange: DEFAULT_EXCHANGE.to_owned(),
            exchange_kind: ExchangeKind::Topic,
            declare_exchange: true,
            bindings: Vec::new(),
            app_id: DEFAULT_APP_ID.to_owned(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            reconnect_min: DEFAULT_RECONNECT_MIN,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            connection_name: None,
            unresponsive_after: DEFAULT_UNRESPONSIVE_AFTER,
            outbox_headers: true,
            deduplication_header: false,
            cloudevents: CloudEventsMode::Off,
            routing_key: None,
            template: None,
        }
    }

    /// Sets [`RabbitConfig::outbox_headers`].
    #[must_use]
    pub fn outbox_headers(mut self, on: bool) -> Self {
        self.outbox_headers = on;
        self
    }

    /// Sets [`RabbitConfig::deduplication_header`].
    #[must_use]
    pub fn deduplication_header(mut self, on: bool) -> Self {
        self.deduplication_header = on;
        self
    }

    /// The AMQP properties and headers this configuration gives `message` (the format of
    /// [`wire`]), or the permanent failure of a message that cannot be sent (an event type or
    /// a producer header that AMQP cannot carry).
    pub fn properties(&self, message: &OutboxMessage) -> Result<BasicProperties, PublishError> {
        properties::properties(message, &self.format())
    }

    /// Sets [`RabbitConfig::cloudevents`].
    #[must_use]
    pub fn cloudevents(mut self, mode: CloudEventsMode) -> Self {
        self.cloudevents = mode;
        self
    }

    pub(super) fn format(&self) -> Format {
        Format {
            // validate() checked its length.
            app_id: ShortString::try_new(self.app_id.as_str()).unwrap_or_default(),
            outbox_headers: self.outbox_headers,
            deduplication_header: self.deduplication_header,
            cloudevents: self.cloudevents == CloudEventsMode::Binary,
        }
    }

    setters! {
        /// Sets [`RabbitConfig::unresponsive_after`].
        unresponsive_after: Duration,
        /// Sets [`RabbitConfig::exchange_kind`].
        exchange_kind: ExchangeKind,
        /// Sets [`RabbitConfig::declare_exchange`].
        declare_exchange: bool,
        /// Sets [`RabbitConfig::connect_timeout`].
        connect_timeout: Duration,
    }
    pair_setter! {
        /// Sets [`RabbitConfig::reconnect_min`] and [`RabbitConfig::reconnect_max`].
        reconnect_backoff(reconnect_min, reconnect_max): Duration
    }
    name_setters! {
        /// Sets [`RabbitConfig::connection_name`].
        connection_name,
    }

    /// Sets [`RabbitConfig::exchange`].
    #[must_use]
    pub fn exchange(mut self, name: impl Into<String>) -> Self {
        self.exchange = name.into();
        self
    }

    /// Declares the durable [`QueueKind::Quorum`] queue `queue` and binds it to the exchange
    /// with `pattern` (for a topic exchange, e.g. `order.#`), each time the sink connects: a
    /// message whose routing key matches then has somewhere to go instead of coming back
    /// unroutable and going dead. Call it again for more patterns or more queues.
    ///
    /// Meant for development and simple deployments, where the publisher may own its
    /// consumers' queues; where queues are managed elsewhere (definitions, another service),
    /// leave them there. The sink declares the exchange first (unless
    /// [`RabbitConfig::declare_exchange`] is off: the exchange must then exist when the sink
    /// connects). A queue that already exists with other arguments (of the other type, not
    /// durable, with arguments such as `x-expires` of its own) fails the connection with
    /// [`RabbitError::Refused`] naming the queue and what differs; a queue that exists as the
    /// sink declares it is left as it is, messages included. The sink never deletes a queue or
    /// a binding.
    ///
    /// ```
    /// use actix_outbox::sink::{QueueKind, RabbitConfig};
    ///
    /// let config = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
    ///     .bind_queue("billing.orders", "order.#")
    ///     .bind_queue("billing.orders", "refund.#")
    ///     .bind_queue_with("audit", "#", QueueKind::Classic);
    /// assert_eq!(config.bindings.len(), 3);
    /// assert_eq!(config.bindings[0].kind, QueueKind::Quorum);
    /// ```
    #[must_use]
    pub fn bind_queue(self, queue: impl Into<String>, pattern: impl Into<String>) -> Self {
        self.bind_queue_with(queue, pattern, QueueKind::default())
    }

    /// Like [`RabbitConfig::bind_queue`], with the queue's type: [`QueueKind::Classic`] for a
    /// queue that exists already as a classic one (a queue's type cannot change), or where
    /// quorum queues are not wanted. Every binding of one queue must give the same type.
    #[must_use]
    pub fn bind_queue_with(mut self, queue: impl Into<String>, pattern: impl Into<String>, kind: QueueKind) -> Self {
        self.bindings.push(QueueBinding::new(queue.into(), pattern.into(), kind));
        self
    }

    /// Sets [`RabbitConfig::app_id`].
    #[must_use]
    pub fn app_id(mut self, app_id: impl Into<String>) -> Self {
        self.app_id = app_id.into();
        self
    }

    /// Replaces the routing key (by default the message's `event_type`) with `f(message)`,
    /// for the messages whose event names no key of its own
    /// ([`NewEvent::routing_key`](crate::NewEvent::routing_key) wins). A key longer than 255
    /// bytes makes that message fail permanently. Replaces a
    /// [`RabbitConfig::routing_key_template`].
    #[must_use]
    pub fn routing_key(mut self, f: impl Fn(&OutboxMessage) -> String + Send + Sync + 'static) -> Self {
        self.routing_key = Some(Arc::new(f));
        self.template = None;
        self
    }

    /// Replaces the routing key (by default the message's `event_type`) with `template`, for
    /// the messages whose event names no key of its own
    /// ([`NewEvent::routing_key`](crate::NewEvent::routing_key) wins). The placeholders
    /// `{aggregate_type}`, `{aggregate_id}`, `{event_type}` and `{source}` stand for the
    /// message's; `{{` and `}}` for literal braces. The template is parsed here once: an
    /// unknown placeholder or an unbalanced brace makes [`RabbitConfig::validate`] (so
    /// [`RabbitSink::connect`](super::RabbitSink::connect)) fail with [`RabbitError::Config`]
    /// saying which. Replaces a [`RabbitConfig::routing_key`] function.
    ///
    /// ```
    /// use actix_outbox::OutboxMessage;
    /// use actix_outbox::sink::RabbitConfig;
    ///
    /// let config = RabbitConfig::new("amqp://h").routing_key_template("{aggregate_type}.{event_type}");
    /// let payload = serde_json::value::to_raw_value(&serde_json::json!({})).unwrap();
    /// let message = OutboxMessage::new(7, "order", "42", "paid", payload);
    /// assert_eq!(config.routing_key_of(&message), "order.paid");
    /// let bad = RabbitConfig::new("amqp://h").routing_key_template("{tenant}.{event_type}").validate().unwrap_err();
    /// assert!(bad.to_string().contains("unknown placeholder {tenant}"), "{bad}");
    /// ```
    #[must_use]
    pub fn routing_key_template(mut self, template: impl Into<String>) -> Self {
        let template = template.into();
        match Template::parse(&template) {
            Ok(parsed) => {
                self.routing_key = Some(Arc::new(move |m: &OutboxMessage| parsed.render(m)));
                self.template = Some((template, None));
            }
            Err(why) => {
                self.routing_key = None;
                self.template = Some((template, Some(why)));
            }
        }
        self
    }

    /// The routing key of `message` under this configuration: the event's own
    /// ([`NewEvent::routing_key`](crate::NewEvent::routing_key)), else the configured function or
    /// template, else the event type.
    pub fn routing_key_of(&self, message: &OutboxMessage) -> String {
        routing_key_of(self.routing_key.as_deref(), message)
    }

    /// Checks the URL and the rules that span fields. [`RabbitSink::connect`](super::RabbitSink::connect) calls it first.
    pub fn validate(&self) -> Result<(), RabbitError> {
        let invalid = |why: String| Err(RabbitError::Config(why));
        if self.urls.is_empty() {
            return invalid("at least one AMQP URL is needed".into());
        }
        for url in &self.urls {
            if let Err(e) = amqp::check_url(url) {
                return invalid(e);
            }
        }
        if self.unresponsive_after.is_zero() {
            return invalid("unresponsive_after must be above zero".into());
        }
        if let Some((_, Some(why))) = &self.template {
            return invalid(why.clone());
        }
        if ShortString::try_new(self.exchange.as_str()).is_err() {
            return invalid(format!("exchange name is {} bytes long; AMQP allows 255", self.exchange.len()));
        }
        if ShortString::try_new(self.app_id.as_str()).is_err() {
            return invalid(format!("app_id is {} bytes long; AMQP allows 255", self.app_id.len()));
        }
        if self.exchange.is_empty() && self.declare_exchange {
            return invalid("the default exchange (\"\") cannot be declared; set declare_exchange(false)".into());
        }
        if let Err(why) = binding::check(&self.bindings, &self.exchange) {
            return invalid(why);
        }
        if self.connect_timeout.is_zero() {
            return invalid("connect timeout must be above zero".into());
        }
        if self.reconnect_min.is_zero() || self.reconnect_min > self.reconnect_max {
            return invalid(format!(
                "reconnect backoff must satisfy 0 < min ({:?}) <= max ({:?})",
                self.reconnect_min, self.reconnect_max
            ));
        }
        Ok(())
    }
}

/// The routing key of `message`: its event's own, else `configured`'s, else the event type.
pub(super) fn routing_key_of(configured: Option<&RoutingKeyFn>, message: &OutboxMessage) -> String {
    if let Some(key) = message.headers.get(wire::ROUTING_KEY) {
        return key.clone();
    }
    match configured {
        Some(f) => f(message),
        None => message.event_type.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> OutboxMessage {
        let payload = serde_json::value::to_raw_value(&serde_json::json!({})).unwrap();
        let mut m = OutboxMessage::new(7, "order", "o-1", "paid", payload);
        m.source = "db/shop".into();
        m
    }

    #[test]
    fn templates_render_every_placeholder_and_escaped_braces() {
        let t = Template::parse("{source}:{aggregate_type}.{aggregate_id}.{event_type}{{x}}").unwrap();
        assert_eq!(t.render(&message()), "db/shop:order.o-1.paid{x}");
        assert_eq!(Template::parse("fixed").unwrap().render(&message()), "fixed");
        assert_eq!(Template::parse("").unwrap().render(&message()), "");
        assert_eq!(Template::parse("é{event_type}é").unwrap().render(&message()), "épaidé");
    }

    #[test]
    fn templates_refuse_unknown_placeholders_and_unbalanced_braces() {
        let unknown = Template::parse("{aggregate_type}.{tenant}").unwrap_err();
        assert!(unknown.contains("unknown placeholder {tenant}"), "{unknown}");
        let open = Template::parse("a.{event_type").unwrap_err();
        assert!(open.contains("brace at byte 2 is not closed"), "{open}");
        let nested = Template::parse("{event_{type}}").unwrap_err();
        assert!(nested.contains("brace at byte 0 is not closed"), "{nested}");
        let close = Template::parse("a}b").unwrap_err();
        assert!(close.contains("brace at byte 1 closes nothing"), "{close}");
        let empty = Template::parse("{}").unwrap_err();
        assert!(empty.contains("unknown placeholder {}"), "{empty}");
    }

    #[test]
    fn the_events_key_wins_over_the_template_which_wins_over_the_event_type() {
        let plain = RabbitConfig::new("amqp://h");
        let templated = plain.clone().routing_key_template("{aggregate_type}.{event_type}");
        let mut own = message();
        own.headers.insert(wire::ROUTING_KEY.into(), "mine".into());
        assert_eq!(plain.routing_key_of(&message()), "paid");
        assert_eq!(templated.routing_key_of(&message()), "order.paid");
        assert_eq!(templated.routing_key_of(&own), "mine");
        let bad = plain.routing_key_template("{nope}");
        assert!(matches!(bad.validate(), Err(RabbitError::Config(ref m)) if m.contains("{nope}")));
        assert!(format!("{bad:?}").contains(r#"routing_key: "{nope}""#), "{bad:?}");
    }

    #[test]
    fn validates() {
        assert!(RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f").validate().is_ok());
        let bad = RabbitConfig::new("http://nope").validate().unwrap_err();
        assert!(matches!(bad, RabbitError::Config(_)), "{bad}");
        let long = RabbitConfig::new("amqp://h").exchange("x".repeat(256)).validate().unwrap_err();
        assert!(long.to_string().contains("256 bytes"), "{long}");
        let backoff = RabbitConfig::new("amqp://h")
            .reconnect_backoff(Duration::from_secs(2), Duration::from_secs(1))
            .validate()
            .unwrap_err();
        assert!(backoff.to_string().contains("reconnect backoff"), "{backoff}");
        assert!(RabbitConfig::new("amqp://h").exchange("").validate().is_err());
        assert!(RabbitConfig::new("amqp://h").exchange("").declare_exchange(false).validate().is_ok());
        let bound = RabbitConfig::new("amqp://h").bind_queue("orders", "order.#");
        assert!(bound.clone().declare_exchange(false).validate().is_ok(), "the exchange may be managed elsewhere");
        let e = bound.clone().bind_queue("", "#").validate().unwrap_err();
        assert!(e.to_string().contains("needs a name"), "{e}");
        let e = bound.clone().exchange("").declare_exchange(false).validate().unwrap_err();
        assert!(e.to_string().contains("default exchange"), "{e}");
        let debug = format!("{bound:?}");
        assert!(
            debug.contains(r#"bindings: [QueueBinding { queue: "orders", pattern: "order.#", kind: Quorum }]"#),
            "{debug}"
        );
    }
}
