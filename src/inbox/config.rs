//! [`InboxConfig`]: what a consumer consumes and how it retries, with every default named
//! (the table is on `InboxConfig::new`).

use std::time::Duration;

use lapin::types::ShortString;

use crate::sink::QueueKind;
use crate::url::mask_url;

/// Deliveries the broker sends ahead of their acknowledgements, by default (`basic.qos`).
const DEFAULT_PREFETCH: u16 = 64;
/// Deliveries handled at once (each in its own transaction), by default.
const DEFAULT_CONCURRENCY: usize = 4;
/// Attempts a message gets before a retryable failure dead-letters it, by default.
const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Full-jitter retry backoff base, by default: attempt `n` waits `uniform(0, min(cap, base × 2^(n-1)))`.
const DEFAULT_RETRY_BASE: Duration = Duration::from_secs(1);
/// Upper bound of the retry backoff, by default.
const DEFAULT_RETRY_CAP: Duration = Duration::from_secs(60);
/// Bound on one call of the handler, by default; a slower handler is a retryable failure.
const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);
/// First pause after the database failed to answer, by default; it doubles up to the maximum.
const DEFAULT_OUTAGE_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest pause between two tries while the database is unreachable, by default.
const DEFAULT_OUTAGE_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Bound on one attempt to connect and set up the channel, by default.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// First delay before reconnecting to the broker, by default; it doubles up to the maximum.
const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Longest delay between two reconnection attempts, by default.
const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(10);
/// The dead-letter exchange is `<queue>` followed by this, unless named.
const DEAD_LETTER_EXCHANGE_SUFFIX: &str = ".dlx";
/// The dead-letter queue is `<queue>` followed by this, unless named.
const DEAD_LETTER_QUEUE_SUFFIX: &str = ".dlq";

/// What an ordered consumer does with a late message: one that arrives after a message of the
/// same aggregate with a higher id was applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum LateEvents {
    /// Record it in the inbox (so that its copies are duplicates), log it, acknowledge it, and
    /// do not call the handler. The default.
    #[default]
    Skip,
    /// Call the handler with [`InboxMessage::late`](super::InboxMessage::late) set; the
    /// aggregate's high-water mark stays where it is.
    Flag,
}

/// How an inbox consumer connects, consumes, retries and dead-letters.
///
/// Start from [`InboxConfig::new`] (every default set there) and chain setters;
/// [`InboxConfig::validate`] runs when the supervisor starts.
///
/// ```
/// use std::time::Duration;
/// use actix_outbox::inbox::{InboxConfig, LateEvents};
///
/// let config = InboxConfig::new("billing", "amqp://guest:guest@127.0.0.1:5672/%2f", "billing.events")
///     .prefetch(128)
///     .concurrency(8)
///     .max_attempts(3)
///     .retry_backoff(Duration::from_millis(500), Duration::from_secs(30))
///     .ordered(true)
///     .late_events(LateEvents::Flag);
/// config.validate().unwrap();
/// assert_eq!(config.dead_letter_exchange_name(), "billing.events.dlx");
/// assert_eq!(config.dead_letter_queue_name(), "billing.events.dlq");
/// assert!(format!("{config:?}").contains("guest:***@"), "the password never reaches a log");
///
/// assert!(InboxConfig::new("billing", "amqp://h", "q").concurrency(100).validate().is_err(),
///     "more handlers at once than the prefetch window could ever feed");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct InboxConfig {
    /// The consumer's name: the inbox's key is `(consumer, source, message_id)`, so two consumers of
    /// one database (two services, or two independent uses of one stream) each apply a message
    /// once. Keep it stable: a renamed consumer handles every message again.
    pub consumer: String,
    /// The AMQP URLs of the broker's nodes, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`;
    /// `?heartbeat=10` bounds how long a silent broker looks alive. Each (re)connection tries
    /// them in turn, starting after the node it last reached, each within
    /// [`connect_timeout`](InboxConfig::connect_timeout): give every node of a cluster, so that
    /// the consumer moves on when its node goes down. One from [`InboxConfig::new`]; more with
    /// [`InboxConfig::cluster`].
    pub urls: Vec<String>,
    /// The queue consumed. It must exist (declare and bind it as your topology requires); the
    /// consumer retries, with backoff, until it does.
    pub queue: String,
    /// Deliveries the broker sends ahead of their acknowledgements. Default 64.
    pub prefetch: u16,
    /// Deliveries handled at once, each in its own transaction on its own pooled connection.
    /// Messages of one aggregate always go to the same one of these lanes, in arrival order.
    /// At most `prefetch`. Default 4.
    pub concurrency: usize,
    /// Attempts a message gets: a retryable failure on the last one dead-letters it. Default 5.
    pub max_attempts: u32,
    /// Retry backoff base. Default 1 s.
    pub retry_base: Duration,
    /// Retry backoff cap. Default 60 s.
    pub retry_cap: Duration,
    /// Bound on one call of the handler; a call that takes longer is rolled back and counts as
    /// a retryable failure. Default 30 s.
    pub handler_timeout: Duration,
    /// First pause after the database did not answer. Default 100 ms.
    pub outage_backoff_min: Duration,
    /// Longest pause between two tries while the database does not answer. Default 5 s.
    pub outage_backoff_max: Duration,
    /// Bound on one attempt to connect and set up. Default 10 s.
    pub connect_timeout: Duration,
    /// First delay before reconnecting to the broker. Default 100 ms.
    pub reconnect_min: Duration,
    /// Longest delay between reconnection attempts. Default 10 s.
    pub reconnect_max: Duration,
    /// The dead-letter exchange; default `<queue>.dlx`.
    pub dead_letter_exchange: Option<String>,
    /// The dead-letter queue; default `<queue>.dlq`.
    pub dead_letter_queue: Option<String>,
    /// Whether the consumer declares (durable) the dead-letter exchange (direct), the
    /// dead-letter queue, and the binding between them (routing key = the consumed queue's
    /// name) each time it connects. When off, the exchange must exist (the consumer checks
    /// before consuming) and something must be bound to it for the queue's name: a dead
    /// letter nobody is bound for is held and retried, never dropped. Default true.
    pub declare_dead_letter: bool,
    /// The type the consumer declares the dead-letter queue with (`x-queue-type`), when it
    /// declares it. `None` (the default): no type given, so the vhost's default (classic,
    /// unless set otherwise). On a cluster, give [`QueueKind::Quorum`]: a classic queue lives on
    /// one node, and while that node is down the consumer cannot declare it, so it cannot
    /// consume from the other nodes either. A queue's type cannot change once it exists.
    pub dead_letter_queue_kind: Option<QueueKind>,
    /// Check per aggregate that no message is applied after a newer one (per source and
    /// aggregate: ids of two producers are not comparable). Default false.
    pub ordered: bool,
    /// Hand the handler messages whose `content_type` says JSON but whose body does not parse,
    /// with [`InboxMessage::payload`](super::InboxMessage::payload) `None` and the bytes in
    /// `body`. Off (the default), such a message is dead-lettered with the parse error as its
    /// reason, like a message without a usable id.
    pub raw_bodies: bool,
    /// What an ordered consumer does with a late message. Default [`LateEvents::Skip`].
    pub late_events: LateEvents,
    /// The connection name shown in RabbitMQ's management UI; default `actix-outbox inbox
    /// <consumer>`.
    pub connection_name: Option<String>,
}

impl std::fmt::Debug for InboxConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxConfig")
            .field("consumer", &self.consumer)
            .field("urls", &self.urls.iter().map(|u| mask_url(u)).collect::<Vec<_>>())
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("retry_base", &self.retry_base)
            .field("retry_cap", &self.retry_cap)
            .field("handler_timeout", &self.handler_timeout)
            .field("outage_backoff_min", &self.outage_backoff_min)
            .field("outage_backoff_max", &self.outage_backoff_max)
            .field("connect_timeout", &self.connect_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("dead_letter_exchange", &self.dead_letter_exchange_name())
            .field("dead_letter_queue", &self.dead_letter_queue_name())
            .field("declare_dead_letter", &self.declare_dead_letter)
            .field("dead_letter_queue_kind", &self.dead_letter_queue_kind)
            .field("ordered", &self.ordered)
            .field("raw_bodies", &self.raw_bodies)
            .field("late_events", &self.late_events)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

use crate::config::{name_setters, pair_setter, setters};

impl InboxConfig {
    /// A consumer named `consumer` of `queue` on the broker at `url`, every other setting at
    /// its default (each also named on its field):
    ///
    /// | setting | default |
    /// | --- | --- |
    /// | [`prefetch`](InboxConfig::prefetch) | 64 |
    /// | [`concurrency`](InboxConfig::concurrency) | 4 |
    /// | [`max_attempts`](InboxConfig::max_attempts) | 5 |
    /// | [`retry_base`](InboxConfig::retry_base), [`retry_cap`](InboxConfig::retry_cap) | 1 s, 60 s |
    /// | [`handler_timeout`](InboxConfig::handler_timeout) | 30 s |
    /// | [`outage_backoff_min`](InboxConfig::outage_backoff_min), [`outage_backoff_max`](InboxConfig::outage_backoff_max) | 100 ms, 5 s |
    /// | [`connect_timeout`](InboxConfig::connect_timeout) | 10 s |
    /// | [`reconnect_min`](InboxConfig::reconnect_min), [`reconnect_max`](InboxConfig::reconnect_max) | 100 ms, 10 s |
    /// | [`dead_letter_exchange`](InboxConfig::dead_letter_exchange) | `None`: `<queue>.dlx` |
    /// | [`dead_letter_queue`](InboxConfig::dead_letter_queue) | `None`: `<queue>.dlq` |
    /// | [`declare_dead_letter`](InboxConfig::declare_dead_letter) | `true` |
    /// | [`dead_letter_queue_kind`](InboxConfig::dead_letter_queue_kind) | `None`: the vhost's default type |
    /// | [`ordered`](InboxConfig::ordered) | `false` |
    /// | [`raw_bodies`](InboxConfig::raw_bodies) | `false` |
    /// | [`late_events`](InboxConfig::late_events) | [`LateEvents::Skip`] |
    /// | [`connection_name`](InboxConfig::connection_name) | `None`: `actix-outbox inbox <consumer>` |
    /// | [`urls`](InboxConfig::urls) | `[url]` (more: [`InboxConfig::cluster`]) |
    pub fn new(consumer: impl Into<String>, url: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            urls: vec![url.into()],
            queue: queue.into(),
            prefetch: DEFAULT_PREFETCH,
            concurrency: DEFAULT_CONCURRENCY,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_base: DEFAULT_RETRY_BASE,
            retry_cap: DEFAULT_RETRY_CAP,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            outage_backoff_min: DEFAULT_OUTAGE_BACKOFF_MIN,
            outage_backoff_max: DEFAULT_OUTAGE_BACKOFF_MAX,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            reconnect_min: DEFAULT_RECONNECT_MIN,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            dead_letter_exchange: None,
            dead_letter_queue: None,
            declare_dead_letter: true,
            dead_letter_queue_kind: None,
            ordered: false,
            raw_bodies: false,
            late_events: LateEvents::Skip,
            connection_name: None,
        }
    }

    /// The nodes of a cluster at `urls` instead of the one URL of [`InboxConfig::new`] (see
    /// [`InboxConfig::urls`]).
    ///
    /// ```
    /// use actix_outbox::inbox::InboxConfig;
    /// let config = InboxConfig::new("billing", "amqp://rabbit-1:5672/%2f", "billing.events")
    ///     .cluster(["amqp://rabbit-1:5672/%2f", "amqp://rabbit-2:5672/%2f", "amqp://rabbit-3:5672/%2f"]);
    /// assert_eq!(config.urls.len(), 3);
    /// config.validate().unwrap();
    /// ```
    pub fn cluster<U: Into<String>>(mut self, urls: impl IntoIterator<Item = U>) -> Self {
        self.urls = urls.into_iter().map(Into::into).collect();
        self
    }

    /// Sets [`InboxConfig::dead_letter_queue_kind`].
    pub fn dead_letter_queue_kind(mut self, kind: QueueKind) -> Self {
        self.dead_letter_queue_kind = Some(kind);
        self
    }

    setters! {
        /// Sets [`InboxConfig::prefetch`].
        prefetch: u16,
        /// Sets [`InboxConfig::concurrency`].
        concurrency: usize,
        /// Sets [`InboxConfig::max_attempts`].
        max_attempts: u32,
        /// Sets [`InboxConfig::handler_timeout`].
        handler_timeout: Duration,
        /// Sets [`InboxConfig::connect_timeout`].
        connect_timeout: Duration,
        /// Sets [`InboxConfig::declare_dead_letter`].
        declare_dead_letter: bool,
        /// Sets [`InboxConfig::ordered`].
        ordered: bool,
        /// Sets [`InboxConfig::raw_bodies`].
        raw_bodies: bool,
        /// Sets [`InboxConfig::late_events`].
        late_events: LateEvents,
    }

    pair_setter! {
        /// Sets [`InboxConfig::retry_base`] and [`InboxConfig::retry_cap`].
        retry_backoff(retry_base, retry_cap): Duration
    }
    pair_setter! {
        /// Sets [`InboxConfig::outage_backoff_min`] and [`InboxConfig::outage_backoff_max`].
        outage_backoff(outage_backoff_min, outage_backoff_max): Duration
    }
    pair_setter! {
        /// Sets [`InboxConfig::reconnect_min`] and [`InboxConfig::reconnect_max`].
        reconnect_backoff(reconnect_min, reconnect_max): Duration
    }
    name_setters! {
        /// Sets [`InboxConfig::dead_letter_exchange`].
        dead_letter_exchange,
        /// Sets [`InboxConfig::dead_letter_queue`].
        dead_letter_queue,
        /// Sets [`InboxConfig::connection_name`].
        connection_name,
    }

    /// The dead-letter exchange's name (the configured one, or `<queue>.dlx`).
    pub fn dead_letter_exchange_name(&self) -> String {
        self.dead_letter_exchange.clone().unwrap_or_else(|| format!("{}{DEAD_LETTER_EXCHANGE_SUFFIX}", self.queue))
    }

    /// The dead-letter queue's name (the configured one, or `<queue>.dlq`).
    pub fn dead_letter_queue_name(&self) -> String {
        self.dead_letter_queue.clone().unwrap_or_else(|| format!("{}{DEAD_LETTER_QUEUE_SUFFIX}", self.queue))
    }

    /// Checks every field and the rules that span fields. The supervisor calls it first.
    pub fn validate(&self) -> Result<(), InboxError> {
        let invalid = |why: String| Err(InboxError::Config(why));
        if self.consumer.trim().is_empty() {
            return invalid("the consumer name must not be empty".into());
        }
        if self.consumer.contains('\0') {
            return invalid("the consumer name must not contain NUL".into());
        }
        if self.urls.is_empty() {
            return invalid("no AMQP URL: give the broker's (or every cluster node's)".into());
        }
        if let Some(e) = self.urls.iter().find_map(|url| crate::amqp::check_url(url).err()) {
            return invalid(e);
        }
        if self.queue.is_empty() {
            return invalid("the queue name must not be empty".into());
        }
        for (what, name) in [
            ("queue", self.queue.clone()),
            ("dead-letter exchange", self.dead_letter_exchange_name()),
            ("dead-letter queue", self.dead_letter_queue_name()),
        ] {
            if ShortString::try_new(name.as_str()).is_err() {
                return invalid(format!("{what} name is {} bytes long; AMQP allows 255", name.len()));
            }
        }
        if self.dead_letter_exchange_name().is_empty() {
            return invalid("the dead-letter exchange must be named (the default exchange cannot be one)".into());
        }
        if self.declare_dead_letter && self.dead_letter_queue_name().is_empty() {
            return invalid("the dead-letter queue must be named when the consumer declares it".into());
        }
        if self.dead_letter_queue_name() == self.queue {
            return invalid("the dead-letter queue must not be the consumed queue".into());
        }
        if self.prefetch == 0 {
            return invalid("prefetch must be at least 1 (0 would mean no limit)".into());
        }
        if self.concurrency == 0 || self.concurrency > usize::from(self.prefetch) {
            return invalid(format!(
                "concurrency ({}) must be between 1 and the prefetch ({})",
                self.concurrency, self.prefetch
            ));
        }
        if self.max_attempts == 0 {
            return invalid("max attempts must be at least 1".into());
        }
        if self.retry_base > self.retry_cap {
            return invalid(format!(
                "retry backoff base ({:?}) must not exceed its cap ({:?})",
                self.retry_base, self.retry_cap
            ));
        }
        for (what, min, max) in [
            ("outage backoff", self.outage_backoff_min, self.outage_backoff_max),
            ("reconnect backoff", self.reconnect_min, self.reconnect_max),
        ] {
            if min.is_zero() || min > max {
                return invalid(format!("{what} must satisfy 0 < min ({min:?}) <= max ({max:?})"));
            }
        }
        if self.handler_timeout.is_zero() {
            return invalid("handler timeout must be above zero".into());
        }
        if self.connect_timeout.is_zero() {
            return invalid("connect timeout must be above zero".into());
        }
        Ok(())
    }
}

/// Why an inbox consumer could not start.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The configuration breaks a rule (the message names it); retrying will not help.
    #[error("invalid inbox configuration: {0}")]
    Config(String),
}

crate::error::readable_debug!(InboxError);

impl InboxError {
    /// Whether starting again later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            InboxError::Config(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> InboxConfig {
        InboxConfig::new("c", "amqp://guest:guest@127.0.0.1:5672/%2f", "q")
    }

    #[test]
    fn a_malformed_url_is_reported_without_its_password() {
        let e = InboxConfig::new("c", "amqp:guest:s3cret@rabbit", "q").validate().unwrap_err().to_string();
        assert!(e.contains("malformed AMQP URL"), "{e}");
        assert!(!e.contains("s3cret"), "the password reached the error: {e}");
    }

    #[test]
    fn defaults_validate() {
        config().validate().unwrap();
        let c = config();
        assert_eq!((c.prefetch, c.concurrency, c.max_attempts), (64, 4, 5));
        assert!(c.declare_dead_letter && !c.ordered);
    }

    #[test]
    fn rejects_what_cannot_work() {
        let bad = |c: InboxConfig| c.validate().unwrap_err().to_string();
        assert!(bad(InboxConfig::new("", "amqp://h", "q")).contains("consumer"));
        assert!(bad(InboxConfig::new("c", "http://h", "q")).contains("malformed"));
        assert!(bad(InboxConfig::new("c", "amqp://h", "")).contains("queue"));
        assert!(bad(config().prefetch(0)).contains("prefetch"));
        assert!(bad(config().concurrency(0)).contains("concurrency"));
        assert!(bad(config().max_attempts(0)).contains("attempts"));
        assert!(bad(config().retry_backoff(Duration::from_secs(2), Duration::from_secs(1))).contains("retry"));
        assert!(bad(config().outage_backoff(Duration::ZERO, Duration::from_secs(1))).contains("outage"));
        assert!(bad(config().dead_letter_queue("q")).contains("dead-letter queue"));
        assert!(bad(config().dead_letter_exchange("")).contains("dead-letter exchange"));
        assert!(bad(InboxConfig::new("c", "amqp://h", "x".repeat(252))).contains("255"));
        assert!(bad(config().handler_timeout(Duration::ZERO)).contains("handler timeout"));
        assert!(!InboxError::Config("x".into()).is_transient());
    }
}
