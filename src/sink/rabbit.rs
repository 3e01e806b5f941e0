//! The RabbitMQ sink: one lapin connection with publisher confirms, shared by every
//! publish, re-established by the sink itself when it is lost.
//!
//! The user-facing notes (where the connection lives, how broker answers become outcomes) are
//! on [`RabbitSink`]; the mapping itself is [`classify`], the only place that does it.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Event};
use tokio::sync::{Notify, oneshot};
use tracing::{debug, info, warn};

pub use lapin::ExchangeKind;

use crate::amqp::connection::{LinkThread, Stop};
use crate::amqp::publisher_confirm::{self, Confirmed};
use crate::amqp::{self, Reconnect, connection_closer};
use crate::error::PublishError;
use crate::model::OutboxMessage;
use crate::publisher::{PublishFuture, PublishResult, Publisher, SinkState};
use crate::url::mask_url;
use crate::wire;

/// The exchange published to by default.
pub const DEFAULT_EXCHANGE: &str = "outbox";
/// The `app_id` property set on every message by default.
pub const DEFAULT_APP_ID: &str = "actix-outbox";
/// How long one attempt to connect (TCP, handshake, confirms, exchange declaration) may take by
/// default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// First delay before reconnecting after the link is lost, by default.
pub const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest delay between two reconnection attempts, by default.
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(10);
/// How long a broker may confirm nothing while publishes wait before the link is taken for
/// dead, by default.
pub const DEFAULT_UNRESPONSIVE_AFTER: Duration = Duration::from_secs(5);

/// How often the connection manager looks at the connection's and channel's status, on top of
/// reacting at once to connection events and failed publishes. Catches a channel the broker
/// closed while nothing was being published.
const LINK_CHECK_PERIOD: Duration = Duration::from_millis(250);

/// Computes a message's routing key; see [`RabbitConfig::routing_key`].
pub type RoutingKeyFn = dyn Fn(&OutboxMessage) -> String + Send + Sync;

/// How a [`RabbitSink`] connects and what it publishes.
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
///     .reconnect_backoff(Duration::from_millis(50), Duration::from_secs(5));
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
    /// The exchange every message is published to. Default [`DEFAULT_EXCHANGE`] (`outbox`).
    pub exchange: String,
    /// The exchange's type, used when the sink declares it. Default [`ExchangeKind::Topic`].
    pub exchange_kind: ExchangeKind,
    /// Whether the sink declares the exchange (durable, of [`RabbitConfig::exchange_kind`]) each
    /// time it connects. Turn it off when the exchange is managed elsewhere; publishing to an
    /// exchange that does not exist then fails retryably (the broker closes the channel with
    /// 404) until someone creates it. Default `true`.
    pub declare_exchange: bool,
    /// The `app_id` property of every message. Default [`DEFAULT_APP_ID`].
    pub app_id: String,
    /// Bound on one connection attempt (TCP connect, AMQP handshake, confirm mode, exchange
    /// declaration). Default 10 s.
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
    /// [`SinkState::Down`], drops the link and reconnects, and the waiting publishes fail as
    /// [`PublishError::Unavailable`] (attempt refunded). Keep it below the dispatcher's publish
    /// timeout. Default [`DEFAULT_UNRESPONSIVE_AFTER`] (5 s).
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
    /// needs the source or the aggregate: the [inbox](crate::inbox) keys on the source (a lean
    /// message counts as one of an unnamed producer, whose ids must then be unique by
    /// themselves) and orders by the aggregate.
    pub outbox_headers: bool,
    /// Whether each message carries `x-deduplication-header` = `<source>/<id>`, the key that
    /// RabbitMQ's message-deduplication plugin reads (see [`wire::DEDUPLICATION`]). Turn it on
    /// for brokers that run the plugin. Default `false`.
    pub deduplication_header: bool,
    routing_key: Option<Arc<RoutingKeyFn>>,
}

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("urls", &self.urls.iter().map(|u| mask_url(u)).collect::<Vec<_>>())
            .field("exchange", &self.exchange)
            .field("exchange_kind", &self.exchange_kind)
            .field("declare_exchange", &self.declare_exchange)
            .field("app_id", &self.app_id)
            .field("connect_timeout", &self.connect_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("connection_name", &self.connection_name)
            .field("unresponsive_after", &self.unresponsive_after)
            .field("outbox_headers", &self.outbox_headers)
            .field("deduplication_header", &self.deduplication_header)
            .field("routing_key", &if self.routing_key.is_some() { "custom" } else { "event_type" })
            .finish()
    }
}

impl RabbitConfig {
    /// A configuration for the broker at `url`, with every other setting at its default.
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
            app_id: DEFAULT_APP_ID.to_owned(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            reconnect_min: DEFAULT_RECONNECT_MIN,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            connection_name: None,
            unresponsive_after: DEFAULT_UNRESPONSIVE_AFTER,
            outbox_headers: true,
            deduplication_header: false,
            routing_key: None,
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
        wire::properties(message, &self.format())
    }

    fn format(&self) -> wire::Format {
        wire::Format {
            // validate() checked its length.
            app_id: ShortString::try_new(self.app_id.as_str()).unwrap_or_default(),
            outbox_headers: self.outbox_headers,
            deduplication_header: self.deduplication_header,
        }
    }

    /// Sets [`RabbitConfig::unresponsive_after`].
    #[must_use]
    pub fn unresponsive_after(mut self, after: Duration) -> Self {
        self.unresponsive_after = after;
        self
    }

    /// Sets [`RabbitConfig::exchange`].
    #[must_use]
    pub fn exchange(mut self, name: impl Into<String>) -> Self {
        self.exchange = name.into();
        self
    }

    /// Sets [`RabbitConfig::exchange_kind`].
    #[must_use]
    pub fn exchange_kind(mut self, kind: ExchangeKind) -> Self {
        self.exchange_kind = kind;
        self
    }

    /// Sets [`RabbitConfig::declare_exchange`].
    #[must_use]
    pub fn declare_exchange(mut self, declare: bool) -> Self {
        self.declare_exchange = declare;
        self
    }

    /// Sets [`RabbitConfig::app_id`].
    #[must_use]
    pub fn app_id(mut self, app_id: impl Into<String>) -> Self {
        self.app_id = app_id.into();
        self
    }

    /// Sets [`RabbitConfig::connect_timeout`].
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`RabbitConfig::reconnect_min`] and [`RabbitConfig::reconnect_max`].
    #[must_use]
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max;
        self
    }

    /// Sets [`RabbitConfig::connection_name`].
    #[must_use]
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Replaces the routing key (by default the message's `event_type`) with `f(message)`.
    /// A key longer than 255 bytes makes that message fail permanently.
    #[must_use]
    pub fn routing_key(mut self, f: impl Fn(&OutboxMessage) -> String + Send + Sync + 'static) -> Self {
        self.routing_key = Some(Arc::new(f));
        self
    }

    /// The routing key of `message` under this configuration.
    pub fn routing_key_of(&self, message: &OutboxMessage) -> String {
        match &self.routing_key {
            Some(f) => f(message),
            None => message.event_type.clone(),
        }
    }

    /// Checks the URL and the rules that span fields. [`RabbitSink::connect`] calls it first.
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
        if ShortString::try_new(self.exchange.as_str()).is_err() {
            return invalid(format!("exchange name is {} bytes long; AMQP allows 255", self.exchange.len()));
        }
        if ShortString::try_new(self.app_id.as_str()).is_err() {
            return invalid(format!("app_id is {} bytes long; AMQP allows 255", self.app_id.len()));
        }
        if self.exchange.is_empty() && self.declare_exchange {
            return invalid("the default exchange (\"\") cannot be declared; set declare_exchange(false)".into());
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

/// Why a [`RabbitSink`] could not start. Once started, the sink never fails as a whole: a lost
/// broker turns into retryable publishes while it reconnects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// The configuration breaks a rule; retrying will not help.
    #[error("invalid RabbitMQ sink configuration: {0}")]
    Config(String),
    /// Nothing answered as a broker at the URL (refused, reset, or no handshake within the
    /// connect timeout). The URL's password is masked.
    #[error("RabbitMQ is unreachable at {url}: {reason}")]
    Unreachable {
        /// The URL, password masked.
        url: String,
        /// What failed.
        reason: String,
    },
    /// A broker answered but refused the connection (bad credentials, unknown vhost) or the
    /// sink's setup (confirm mode, the exchange declaration — e.g. an existing exchange of
    /// another type).
    #[error("RabbitMQ at {url} refused the sink: {reason}")]
    Refused {
        /// The URL, password masked.
        url: String,
        /// The broker's reason.
        reason: String,
    },
    /// The sink's connection thread could not be started.
    #[error("could not start the RabbitMQ sink's connection thread: {0}")]
    Thread(String),
}

impl RabbitError {
    /// Whether connecting again later may succeed (the broker may come up), as opposed to a
    /// configuration the broker or the sink will reject again.
    pub fn is_transient(&self) -> bool {
        match self {
            RabbitError::Unreachable { .. } | RabbitError::Thread(_) => true,
            RabbitError::Config(_) | RabbitError::Refused { .. } => false,
        }
    }
}

/// A [`Publisher`] that publishes each outbox message to a RabbitMQ exchange with publisher
/// confirms, `mandatory` and persistent, in the format of [`wire`]: `message_id` = the outbox
/// id in decimal, the `x-outbox-source` header naming the outbox (unless
/// [`RabbitConfig::outbox_headers`] is off), then the producer's headers
/// ([`NewEvent::header`](crate::NewEvent::header)), each as a long string. **Ours win**: a
/// producer's header named `x-deduplication-header` or `x-attempt`, or starting with
/// `x-outbox-` or `x-aggregate-`, is not sent. A producer's header name longer than 255 bytes,
/// or headers taking more than [`wire::MAX_PRODUCER_HEADER_BYTES`] encoded, fail the message
/// with [`PublishError::Permanent`] saying so. The routing key is the event type unless
/// [`RabbitConfig::routing_key`] says otherwise.
///
/// Delivery is at-least-once: a message whose confirm was lost (connection cut, publish timeout)
/// is published again on a later attempt with the same `message_id`, on which consumers
/// deduplicate.
///
/// Clones share one connection and one channel.
///
/// # Where the connection lives
///
/// A lapin connection is bound to the tokio runtime that created it: its socket is registered
/// with that runtime's reactor and its heartbeats use that runtime's timers. If that runtime
/// stops (an actix arbiter that is stopped, a test's runtime that ends) the connection hangs
/// silently: publishes never complete while its status still says connected.
///
/// So the sink does not borrow the caller's runtime. [`RabbitSink::connect`] starts a thread of
/// its own (`actix-outbox-amqp`) running a small current-thread tokio runtime, and the
/// connection manager runs there: it connects, enables confirms, declares the exchange, watches
/// the link, and reconnects with backoff when the connection or channel is lost. The thread
/// lives exactly as long as the sink: it closes the connection and ends when the last clone of
/// the [`RabbitSink`] is dropped or [`RabbitSink::close`] is called. That makes the sink safe to
/// create from any arbiter (or from plain tokio) and to use from any other.
///
/// Publishes themselves do not hop threads: each one calls `basic_publish` on the shared channel
/// from the dispatcher's arbiter and awaits its own [`PublisherConfirm`](lapin::PublisherConfirm),
/// so many publishes are in flight on the channel at once. lapin's channel and confirm futures
/// are runtime-agnostic; only the connection's I/O is tied to the sink's runtime.
///
/// # Outcomes
///
/// The broker's answer maps onto a [`PublishResult`] in exactly one place:
///
/// | broker / client says | outcome |
/// | --- | --- |
/// | `Ack` without a returned message | `Ok` (row done) |
/// | `Ack` with a returned message (312 `NO_ROUTE` for a `mandatory` publish) | [`PublishError::Permanent`], "unroutable", naming exchange and routing key |
/// | `Nack` | [`PublishError::Retryable`] |
/// | channel or connection error, or no link while reconnecting | [`PublishError::Unavailable`] (attempt refunded, claiming paused), and the link is rebuilt |
/// | no confirm within the publish timeout | [`PublishError::Retryable`] while the sink says it is up, [`PublishError::Unavailable`] while it says it is down; while it says it is blocked, the publish waits (applied by the dispatcher) |
///
/// lapin reports a returned message as an *ack* that carries it: the broker did accept the
/// message, it simply had nowhere to put it. lapin also logs every returned message, payload
/// included, at WARN under the target `lapin::returned_messages`; filter that target if
/// payloads must not reach the logs (the dead row's `last_error` says what happened anyway).
///
/// # Example
///
/// ```no_run
/// use actix_outbox::{DispatcherConfig, OutboxSupervisor, Shutdown, connect_pool};
/// use actix_outbox::sink::{RabbitConfig, RabbitSink};
///
/// #[actix::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let pool = connect_pool("postgres://root@127.0.0.1:5432/app", 8).await?;
///     let sink = RabbitSink::connect(RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
///     let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink.clone())?;
///     // ... until the application stops:
///     dispatcher.send(Shutdown).await?;
///     sink.close().await;
///     Ok(())
/// }
/// ```
#[derive(Clone)]
pub struct RabbitSink {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for RabbitSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitSink")
            .field("url", &self.handle.link.url)
            .field("exchange", &self.handle.link.exchange.as_str())
            .field("connected", &self.is_connected())
            .field("reconnects", &self.reconnects())
            .finish()
    }
}

/// Owned by the sink's clones; dropping the last one stops the connection thread.
struct Handle {
    link: Arc<LinkState>,
    /// The connection manager's thread; dropping it tells the manager to close and end.
    thread: LinkThread,
}

impl RabbitSink {
    /// Validates `config`, starts the sink's connection thread and waits for the first
    /// connection (bounded by [`RabbitConfig::connect_timeout`]): connected, confirm mode on,
    /// exchange declared. Fails if the broker cannot be reached or refuses the setup; after this
    /// first success, the sink reconnects by itself whenever the link is lost.
    pub async fn connect(config: RabbitConfig) -> Result<Self, RabbitError> {
        config.validate()?;
        let link = Arc::new(LinkState::new(&config));
        let (first_tx, first_rx) = oneshot::channel();
        let manager_link = link.clone();
        // A runtime of its own, so that no arbiter's shutdown can strand the connection.
        let thread = LinkThread::start("actix-outbox-amqp", move |stop| {
            Manager { config, next_node: 0, link: manager_link, stop }.run(first_tx)
        })
        .map_err(|e| RabbitError::Thread(e.io().to_string()))?;
        let handle = Arc::new(Handle { link, thread });
        match first_rx.await {
            Ok(Ok(())) => Ok(Self { handle }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RabbitError::Thread("the connection thread ended before connecting".into())),
        }
    }

    /// Whether the sink has a usable channel right now. While it is false, publishes fail at
    /// once as retryable.
    pub fn is_connected(&self) -> bool {
        self.handle.link.current().link.is_some()
    }

    /// How many times the sink re-established its link (a new channel, or a new connection)
    /// after losing it.
    pub fn reconnects(&self) -> u64 {
        self.handle.link.reconnects.load(Ordering::Relaxed)
    }

    /// The exchange this sink publishes to.
    pub fn exchange(&self) -> &str {
        self.handle.link.exchange.as_str()
    }

    /// Closes the connection gracefully and stops the connection thread, for every clone of
    /// this sink; later publishes fail as retryable. Shut the dispatcher down first so that no
    /// publish is in flight. Safe to call more than once. Dropping the last clone does the same
    /// without waiting.
    pub async fn close(&self) {
        self.handle.thread.close().await;
    }
}

impl Publisher for RabbitSink {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let link = self.handle.link.clone();
        Box::pin(async move { link.publish(&message).await })
    }

    /// [`SinkState::Down`] while there is no link (connecting, reconnecting, closed) or the
    /// broker has confirmed nothing for [`RabbitConfig::unresponsive_after`] while publishes
    /// wait; [`SinkState::Blocked`] while the broker has blocked the connection
    /// (`connection.blocked`, a resource alarm); else [`SinkState::Up`].
    fn state(&self) -> SinkState {
        self.handle.link.state()
    }
}

/// What publishes and the connection manager share.
struct LinkState {
    /// The node connected to (or last tried), password masked.
    url: Mutex<String>,
    unresponsive_after: Duration,
    /// Why the broker blocked the connection, while it does.
    blocked: Mutex<Option<String>>,
    /// Publishes on the current link waiting for their confirm.
    waits: Mutex<Waits>,
    exchange: ShortString,
    format: wire::Format,
    routing_key: Option<Arc<RoutingKeyFn>>,
    current: Mutex<Current>,
    /// Highest link generation a publish found broken.
    broken: AtomicU64,
    /// Wakes the manager when a publish finds the link broken.
    broken_notify: Notify,
    reconnects: AtomicU64,
    /// Serialises the first poll of `basic_publish` (see [`LinkState::publish`]).
    publish_order: Mutex<()>,
}

struct Current {
    link: Option<Link>,
    /// Why there is no link (shown in the retryable error of publishes meanwhile).
    down_reason: String,
}

/// One channel in confirm mode; `generation` tells a failure on it from one on its successor.
#[derive(Clone)]
struct Link {
    channel: Channel,
    generation: u64,
}

/// What a failed publish means for the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkHealth {
    Healthy,
    Broken,
}

impl LinkState {
    fn new(config: &RabbitConfig) -> Self {
        Self {
            url: Mutex::new(mask_url(&config.urls[0])),
            unresponsive_after: config.unresponsive_after,
            blocked: Mutex::new(None),
            waits: Mutex::new(Waits { generation: 0, count: 0, since: Instant::now() }),
            // validate() checked both lengths.
            exchange: ShortString::try_new(config.exchange.as_str()).unwrap_or_default(),
            format: config.format(),
            routing_key: config.routing_key.clone(),
            current: Mutex::new(Current { link: None, down_reason: "not connected yet".into() }),
            broken: AtomicU64::new(0),
            broken_notify: Notify::new(),
            reconnects: AtomicU64::new(0),
            publish_order: Mutex::new(()),
        }
    }

    fn current(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn url(&self) -> String {
        self.url.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_url(&self, url: &str) {
        *self.url.lock().unwrap_or_else(|e| e.into_inner()) = mask_url(url);
    }

    fn set_blocked(&self, reason: Option<String>) {
        *self.blocked.lock().unwrap_or_else(|e| e.into_inner()) = reason;
    }

    fn state(&self) -> SinkState {
        if let Some(reason) = self.blocked.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return SinkState::Blocked(format!("RabbitMQ blocked the connection: {reason}"));
        }
        if let Some(silent) = self.unresponsive() {
            return SinkState::Down(format!(
                "RabbitMQ at {} confirmed nothing for {} while publishes wait",
                self.url(),
                humantime::format_duration(Duration::from_millis(silent.as_millis() as u64))
            ));
        }
        let current = self.current();
        match current.link {
            Some(_) => SinkState::Up,
            None => SinkState::Down(format!("no link to RabbitMQ at {}: {}", self.url(), current.down_reason)),
        }
    }

    /// How long publishes on the current link have waited without any confirm, once that is
    /// past `unresponsive_after`.
    fn unresponsive(&self) -> Option<Duration> {
        let waits = self.waits();
        let silent = waits.since.elapsed();
        (waits.count > 0 && silent >= self.unresponsive_after).then_some(silent)
    }

    fn set_link(&self, link: Link) {
        // Publishes stranded on the old link no longer say anything about the new one.
        *self.waits() = Waits { generation: link.generation, count: 0, since: Instant::now() };
        self.current().link = Some(link);
    }

    fn waits(&self) -> MutexGuard<'_, Waits> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn clear_link(&self, reason: String) {
        let mut current = self.current();
        current.link = None;
        current.down_reason = reason;
    }

    fn report_broken(&self, generation: u64) {
        self.broken.fetch_max(generation, Ordering::AcqRel);
        self.broken_notify.notify_one();
    }

    async fn publish(&self, message: &OutboxMessage) -> PublishResult {
        let routing_key = match &self.routing_key {
            Some(f) => f(message),
            None => message.event_type.clone(),
        };
        let key = ShortString::try_new(routing_key.as_str()).map_err(|e| {
            PublishError::Permanent(format!("routing key {routing_key:?} cannot be sent over AMQP: {e}"))
        })?;
        let properties = wire::properties(message, &self.format)?;
        // The JSON text as PostgreSQL sent it: lapin copies it into its frames, nothing else does.
        let body = message.payload.get().as_bytes();

        let link = {
            let current = self.current();
            match &current.link {
                Some(link) => link.clone(),
                None => {
                    return Err(PublishError::Unavailable(format!(
                        "RabbitMQ link to {} is down: {}",
                        self.url(),
                        current.down_reason
                    )));
                }
            }
        };
        let options = BasicPublishOptions { mandatory: true, immediate: false };
        // Counted until its confirm arrives (or the dispatcher gives up on it), so that a broker
        // that stops answering is noticed: see `unresponsive`.
        let waiting = Waiting::start(self, link.generation);
        let sent = async {
            let mut publish = pin!(link.channel.basic_publish(self.exchange.clone(), key, options, body, properties));
            // lapin takes the delivery tag and queues the frames in the first poll, under two
            // separate locks. Clones publishing from several threads at once could interleave
            // them, and then a confirm would answer another message: take the first poll under
            // a lock of ours so that tags follow the order of the frames.
            let first = poll_fn(|cx| {
                let _order = self.publish_order.lock().unwrap_or_else(|e| e.into_inner());
                Poll::Ready(publish.as_mut().poll(cx))
            })
            .await;
            let confirm = match first {
                Poll::Ready(confirm) => confirm?,
                Poll::Pending => publish.await?,
            };
            confirm.await
        }
        .await;
        waiting.answered();
        let (result, health) = classify(sent, self.exchange.as_str(), &routing_key);
        if health == LinkHealth::Broken {
            self.report_broken(link.generation);
        }
        result
    }
}

/// The publishes of one link generation waiting for a confirm, and since when the broker has
/// said nothing to them.
struct Waits {
    generation: u64,
    count: u64,
    /// The last answer, or when the first of the waiting publishes began to wait (the silence
    /// is measured from then, not from the last answer before an idle spell).
    since: Instant,
}

/// One publish waiting for its confirm; dropping it (answered, failed or abandoned) stops the
/// count.
struct Waiting<'a> {
    link: &'a LinkState,
    generation: u64,
}

impl<'a> Waiting<'a> {
    fn start(link: &'a LinkState, generation: u64) -> Self {
        let mut waits = link.waits();
        if waits.generation == generation {
            if waits.count == 0 {
                waits.since = Instant::now();
            }
            waits.count += 1;
        }
        Self { link, generation }
    }

    /// The broker answered (whatever it said): it is alive.
    fn answered(&self) {
        let mut waits = self.link.waits();
        if waits.generation == self.generation {
            waits.since = Instant::now();
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waits = self.link.waits();
        if waits.generation == self.generation {
            waits.count = waits.count.saturating_sub(1);
        }
    }
}

/// The one place where the broker's answer (or the client's failure) becomes an outcome, and
/// where we decide whether the link must be rebuilt.
fn classify(
    sent: Result<Confirmation, lapin::Error>,
    exchange: &str,
    routing_key: &str,
) -> (PublishResult, LinkHealth) {
    match publisher_confirm::read(sent) {
        Confirmed::Delivered => (Ok(()), LinkHealth::Healthy),
        Confirmed::Unroutable(reply) => (
            Err(PublishError::Permanent(format!(
                "unroutable: exchange {exchange:?} has no binding for routing key {routing_key:?} \
                 (broker returned the message: {reply})"
            ))),
            LinkHealth::Healthy,
        ),
        Confirmed::Nacked(reply) => (
            Err(PublishError::Retryable(match reply {
                Some(reply) => format!("broker nacked the message ({reply})"),
                None => format!(
                    "broker nacked the message on exchange {exchange:?} with routing key {routing_key:?} \
                     (e.g. a full queue with overflow=reject-publish)"
                ),
            })),
            LinkHealth::Healthy,
        ),
        Confirmed::NotConfirmMode => {
            (Err(PublishError::Unavailable("channel is not in confirm mode; reopening it".into())), LinkHealth::Broken)
        }
        Confirmed::Failed(e) => {
            (Err(PublishError::Unavailable(format!("RabbitMQ channel or connection failed: {e}"))), LinkHealth::Broken)
        }
    }
}

/// Why a link stopped being watched.
enum Ended {
    /// The sink is stopping.
    Stop,
    /// The link broke; the reason is logged and shown to publishes until it is rebuilt.
    Broken(String),
    /// The broker stopped answering: the connection is dropped, not reused, even if it still
    /// looks connected.
    Silent(String),
}

/// The connection manager: runs on the sink's own thread and runtime.
struct Manager {
    config: RabbitConfig,
    /// Index (modulo the number of URLs) of the node the next new connection goes to.
    next_node: usize,
    link: Arc<LinkState>,
    stop: Stop,
}

impl Manager {
    async fn run(mut self, first: oneshot::Sender<Result<(), RabbitError>>) {
        let mut first = Some(first);
        let mut generation = 0_u64;
        let mut reconnect = Reconnect::new(self.config.reconnect_min, self.config.reconnect_max);
        let mut connection: Option<Connection> = None;
        loop {
            let attempt = tokio::time::timeout(self.config.connect_timeout, self.establish(connection.take())).await;
            let attempt = attempt.unwrap_or_else(|_| {
                Err(RabbitError::Unreachable {
                    url: self.link.url(),
                    reason: format!(
                        "no answer within the connect timeout ({})",
                        humantime::format_duration(self.config.connect_timeout)
                    ),
                })
            });
            match attempt {
                Ok((conn, channel)) => {
                    generation += 1;
                    self.link.set_link(Link { channel: channel.clone(), generation });
                    if let Some(first) = first.take() {
                        info!(url = %self.link.url(), exchange = %self.link.exchange, "connected to RabbitMQ");
                        if first.send(Ok(())).is_err() {
                            // Whoever called connect() is gone: nobody will ever publish.
                            break self.shut(Some(conn)).await;
                        }
                    } else {
                        self.link.reconnects.fetch_add(1, Ordering::Relaxed);
                        info!(url = %self.link.url(), exchange = %self.link.exchange, "reconnected to RabbitMQ");
                    }
                    let since = Instant::now();
                    match self.watch(&conn, &channel, generation).await {
                        Ended::Stop => break self.shut(Some(conn)).await,
                        Ended::Silent(reason) => {
                            warn!(url = %self.link.url(), reason = %reason,
                                "RabbitMQ stopped answering; dropping the connection and reconnecting");
                            self.link.clear_link(format!("{reason} (reconnecting)"));
                            self.link.set_blocked(None);
                            let _ = connection_closer::bounded(conn.close(320, "unresponsive".into())).await;
                            drop(conn);
                        }
                        Ended::Broken(reason) => {
                            warn!(url = %self.link.url(), reason = %reason,
                                "RabbitMQ link lost; claiming pauses until it is back (nothing is spent meanwhile)");
                            self.link.clear_link(format!("{reason} (reconnecting)"));
                            self.link.set_blocked(None);
                            reconnect.lost_after(since.elapsed());
                            if channel.status().connected() {
                                let _ = connection_closer::bounded(channel.close(200, "replaced".into())).await;
                            }
                            // Only the channel may be gone: keep a healthy connection for the next channel.
                            if conn.status().connected() {
                                connection = Some(conn);
                            }
                        }
                    }
                }
                Err(e) => {
                    // The first connection tries every node of a cluster before `connect` fails.
                    if first.is_some() && e.is_transient() && self.next_node < self.config.urls.len() {
                        warn!(error = %e, "RabbitMQ node unreachable; trying the next one");
                        continue;
                    }
                    if let Some(first) = first.take() {
                        let _ = first.send(Err(e));
                        break self.shut(None).await;
                    }
                    warn!(error = %e, "reconnecting to RabbitMQ failed");
                    self.link.clear_link(format!("{e} (reconnecting)"));
                }
            }
            let delay = reconnect.next_delay();
            debug!(delay = ?delay, "waiting before reconnecting to RabbitMQ");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.stop.requested() => break self.shut(connection.take()).await,
            }
        }
    }

    /// A channel in confirm mode with the exchange declared, on `reuse` if it is still
    /// connected, else on a new connection.
    async fn establish(&mut self, reuse: Option<Connection>) -> Result<(Connection, Channel), RabbitError> {
        let conn = match reuse.filter(|c| c.status().connected()) {
            Some(conn) => conn,
            None => {
                // Each new connection goes to the next node of the cluster, in turn.
                let node = &self.config.urls[self.next_node % self.config.urls.len()];
                self.next_node += 1;
                self.link.set_url(node);
                let name = self.config.connection_name.as_deref().unwrap_or(&self.config.app_id);
                let properties = ConnectionProperties::default().with_connection_name(name.into());
                Connection::connect(node, properties).await.map_err(|e| connect_error(&self.link.url(), &e))?
            }
        };
        let url = &self.link.url();
        let refused =
            |what: &str, e: lapin::Error| RabbitError::Refused { url: url.clone(), reason: format!("{what}: {e}") };
        let channel = conn.create_channel().await.map_err(|e| refused("opening a channel", e))?;
        channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| refused("enabling confirms", e))?;
        if self.config.declare_exchange {
            let options = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
            channel
                .exchange_declare(
                    self.link.exchange.clone(),
                    self.config.exchange_kind.clone(),
                    options,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| refused(&format!("declaring exchange {:?}", self.config.exchange), e))?;
        }
        Ok((conn, channel))
    }

    /// Waits until the link breaks or the sink stops.
    async fn watch(&mut self, conn: &Connection, channel: &Channel, generation: u64) -> Ended {
        let mut events = Box::pin(conn.events_listener());
        let mut check = tokio::time::interval(LINK_CHECK_PERIOD);
        loop {
            tokio::select! {
                () = self.stop.requested() => return Ended::Stop,
                () = self.link.broken_notify.notified() => {
                    if self.link.broken.load(Ordering::Acquire) >= generation {
                        return Ended::Broken("a publish failed on the channel".into());
                    }
                }
                event = events.next() => match event {
                    Some(Event::Error(e)) => return Ended::Broken(format!("connection error: {e}")),
                    Some(Event::ConnectionBlocked(reason)) => {
                        warn!(reason = %reason, "RabbitMQ blocked the connection: publishes in flight wait for it, nothing new is claimed");
                        self.link.set_blocked(Some(reason.to_string()));
                    }
                    Some(Event::ConnectionUnblocked) => {
                        info!("RabbitMQ unblocked the connection");
                        self.link.set_blocked(None);
                    }
                    Some(_) => {}
                    None => return Ended::Broken("connection event stream ended".into()),
                },
                _ = check.tick() => {
                    if !conn.status().connected() {
                        return Ended::Broken(format!("connection is no longer connected: {:?}", conn.status()));
                    }
                    if !channel.status().connected() {
                        return Ended::Broken(format!("channel is no longer open: {:?}", channel.status()));
                    }
                    if let SinkState::Down(why) = self.link.state() {
                        return Ended::Silent(why);
                    }
                }
            }
        }
    }

    /// Closes the connection (if any) and tells publishes that the sink is over; the thread
    /// tells `close()` once this returns.
    async fn shut(&self, connection: Option<Connection>) {
        self.link.clear_link("the RabbitMQ sink is closed".into());
        if let Some(conn) = connection {
            connection_closer::close_gracefully(&conn, "RabbitMQ connection").await;
        }
    }
}

/// Classifies a failed connection attempt: I/O trouble means nobody answered; a protocol error
/// means a broker answered and said no.
fn connect_error(url: &str, e: &lapin::Error) -> RabbitError {
    if e.is_amqp_error() {
        RabbitError::Refused { url: url.to_owned(), reason: e.to_string() }
    } else {
        RabbitError::Unreachable { url: url.to_owned(), reason: e.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
    #[test]
    fn classifies_transport_failures_as_unavailable_and_broken() {
        let err: lapin::Error = lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed).into();
        let (result, health) = classify(Err(err), "outbox", "a.b");
        assert!(
            matches!(result, Err(PublishError::Unavailable(_))),
            "a transport failure is the sink's, not the message's"
        );
        assert_eq!(health, LinkHealth::Broken);
        let (result, health) = classify(Ok(Confirmation::Nack(None)), "outbox", "a.b");
        assert!(matches!(result, Err(PublishError::Retryable(ref m)) if m.contains("nack")), "{result:?}");
        assert_eq!(health, LinkHealth::Healthy);
        assert_eq!(classify(Ok(Confirmation::Ack(None)), "outbox", "a.b").0, Ok(()));
    }
}
