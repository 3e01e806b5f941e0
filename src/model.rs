//! Typed rows of the `outbox` table: its status, a claimed message, a new event.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::pg::{Pg, PgValue};
use diesel::prelude::*;
use diesel::serialize::{self, Output, ToSql};
use diesel::sql_types::Text;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::schema::outbox;

/// The state of an outbox row, stored in the `status` text column.
///
/// It is the column's type on the Rust side: a query writes `outbox::status.eq(Status::Done)`
/// and reads `Status` back ([`ToSql`]/[`FromSql`] as `Text`), so [`Status::as_str`] is the only
/// place in the crate's Rust code that spells a status. (The SQL text the store keeps, in its
/// `sql` module, spells them too, and so does the table's `CHECK` constraint.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Status {
    /// Waiting to be claimed once `available_at` has passed.
    Pending,
    /// Claimed by a worker that holds the lease `lease_version`.
    Processing,
    /// Published (or skipped by an operator); never claimed again.
    Done,
    /// Given up on; waits for an operator to retry or skip it.
    Dead,
}

impl Status {
    /// Every status, in lifecycle order. A slice, not an array: a later version may add one.
    pub const ALL: &'static [Status] = &[Status::Pending, Status::Processing, Status::Done, Status::Dead];

    /// The text stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Processing => "processing",
            Status::Done => "done",
            Status::Dead => "dead",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `status` value that is none of the four known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown outbox status {0:?}")]
pub struct UnknownStatus(String);

impl FromStr for Status {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Status::ALL.iter().copied().find(|status| status.as_str() == s).ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

impl ToSql<Text, Pg> for Status {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        <str as ToSql<Text, Pg>>::to_sql(self.as_str(), out)
    }
}

/// A text that is none of the four statuses fails to deserialize with [`UnknownStatus`] (the
/// table's `CHECK` constraint admits none).
impl FromSql<Text, Pg> for Status {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let text = std::str::from_utf8(bytes.as_bytes())?;
        Ok(text.parse()?)
    }
}

/// A row as a claim returned it: what a sink needs to publish it, and the fencing token the
/// dispatcher needs to finalize it.
///
/// The payload stays the JSON text PostgreSQL sent: it is never parsed into a tree and written
/// out again on its way to the broker (a sink that wants a [`serde_json::Value`] asks
/// [`OutboxMessage::payload_value`]), so a claimed message costs about its payload's size in
/// memory, once.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// The outbox id: the stable message id consumers deduplicate on, together with
    /// [`OutboxMessage::source`].
    pub id: i64,
    /// The outbox this row belongs to: the dispatcher's
    /// [`DispatcherConfig::source`](crate::DispatcherConfig::source), or the identity it derived
    /// from the database (see [`wire`](crate::wire#message-identity)). `(source, id)` is unique
    /// across every outbox; the id alone only within one table. Shared by every message of a
    /// dispatcher.
    pub source: Arc<str>,
    /// Kind of aggregate the event belongs to (`order`, `customer`...).
    pub aggregate_type: String,
    /// The aggregate instance the event belongs to.
    pub aggregate_id: String,
    /// The event's type; the RabbitMQ sink's default routing key.
    pub event_type: String,
    /// The event body, as JSON text.
    pub payload: Box<RawValue>,
    /// When the producer's transaction inserted the row (database clock).
    pub created_at: DateTime<Utc>,
    /// Claims so far, this one included (1 on the first attempt).
    pub attempts: i32,
    /// The fencing token of this claim: later writes succeed only while it is current.
    pub lease_version: i64,
    /// Until when this claim's lease runs (database clock); `None` only for rows not claimed.
    pub lease_until: Option<DateTime<Utc>>,
    /// The producer's headers (the `headers` column; see [`NewEvent::header`]), by name.
    ///
    /// The column is a JSON object written by anyone (plain SQL too), so it is read leniently:
    /// NULL or a value that is not an object reads as no headers, an entry whose value is JSON
    /// `null` is skipped, and any other non-string value (number, boolean, array, object)
    /// becomes its compact JSON text (`7`, `true`, `[1,2]`).
    pub headers: BTreeMap<String, String>,
}

impl OutboxMessage {
    /// A message as a first claim would hand it to a sink (attempt 1, lease version 1, created
    /// now, no headers, an empty source): for testing a sink without a database.
    ///
    /// ```
    /// let payload = serde_json::value::to_raw_value(&serde_json::json!({"total": 10})).unwrap();
    /// let m = actix_outbox::OutboxMessage::new(7, "order", "42", "order.created", payload);
    /// assert_eq!((m.id, m.attempts, m.payload.get()), (7, 1, r#"{"total":10}"#));
    /// ```
    pub fn new(
        id: i64,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Box<RawValue>,
    ) -> Self {
        Self {
            id,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            created_at: Utc::now(),
            attempts: 1,
            lease_version: 1,
            lease_until: None,
            headers: Default::default(),
            source: no_source(),
        }
    }

    /// The fencing token of this claim.
    pub fn fence(&self) -> Fence {
        Fence { id: self.id, lease_version: self.lease_version }
    }

    /// The payload parsed into a JSON tree.
    pub fn payload_value(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_str(self.payload.get())
    }

    /// The payload's size in bytes (what it holds against the dispatcher's byte budget).
    pub fn payload_bytes(&self) -> usize {
        self.payload.get().len()
    }
}

/// The source of a message not (yet) stamped by a dispatcher: empty, shared.
pub(crate) fn no_source() -> Arc<str> {
    static EMPTY: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));
    EMPTY.clone()
}

impl PartialEq for OutboxMessage {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.source == other.source
            && self.aggregate_type == other.aggregate_type
            && self.aggregate_id == other.aggregate_id
            && self.event_type == other.event_type
            && self.payload.get() == other.payload.get()
            && self.created_at == other.created_at
            && self.attempts == other.attempts
            && self.lease_version == other.lease_version
            && self.lease_until == other.lease_until
            && self.headers == other.headers
    }
}

/// The identity of one claim: a row id and the `lease_version` the claim set. Every write after
/// the claim is predicated on both, so a worker whose lease was taken over writes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Fence {
    /// The outbox id.
    pub id: i64,
    /// The `lease_version` written by the claim.
    pub lease_version: i64,
}

/// An event to insert into the outbox. Only the business columns: the dispatcher's columns all
/// have defaults.
///
/// ```
/// let event = actix_outbox::NewEvent::new("order", "42", "order.created", serde_json::json!({"total": 10}));
/// assert_eq!(event.event_type, "order.created");
/// ```
#[derive(Debug, Clone, PartialEq, Insertable, Serialize, Deserialize)]
#[diesel(table_name = outbox)]
#[non_exhaustive]
pub struct NewEvent {
    /// Kind of aggregate (`order`).
    pub aggregate_type: String,
    /// Aggregate instance (`42`).
    pub aggregate_id: String,
    /// Event type (`order.created`); the default routing key.
    pub event_type: String,
    /// The event body, published as JSON.
    pub payload: serde_json::Value,
    /// Headers to publish with the event: a JSON object of string values, stored in the
    /// `headers` column. `None` (what [`NewEvent::new`] sets) stores the column's default, no
    /// headers. Add entries with [`NewEvent::header`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<serde_json::Value>,
    /// The earliest time the event may be published, stored in the `available_at` column;
    /// `None` (what [`NewEvent::new`] sets) stores the column's default, the inserting
    /// transaction's time: at once. Set it with [`NewEvent::not_before`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[diesel(column_name = available_at)]
    pub not_before: Option<DateTime<Utc>>,
}

impl NewEvent {
    /// An event for `aggregate_type`/`aggregate_id` of type `event_type`.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        Self {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: None,
            not_before: None,
        }
    }

    /// Publishes the event no earlier than `at` (a reminder, a timeout, a business step tried
    /// again later): the row is written with `available_at = at`, and no dispatcher claims it
    /// before that instant of the database's clock. A time in the past publishes at once.
    ///
    /// Until then the row is *scheduled*: pending, but neither backlog nor late.
    /// [`admin::stats`](crate::admin::stats) counts it apart
    /// ([`Stats::scheduled`](crate::admin::Stats::scheduled)), and neither the age of the oldest
    /// unfinished row nor its gauge counts it; once due, its age counts from `at`.
    ///
    /// **Under the [FIFO gate](crate::Fifo)** a scheduled event is its aggregate's next event
    /// like any other pending row, so it holds every later event of that aggregate back until
    /// it is published: events of one aggregate stay in id order, and a reminder written for
    /// tomorrow delays the aggregate's other events until tomorrow. Schedule such events on an
    /// aggregate of their own (`order-reminder`/`42`), or on an event type the gate does not
    /// name ([`Fifo::EventTypes`](crate::Fifo::EventTypes)), when that is not what you want.
    ///
    /// ```
    /// use chrono::{Duration, Utc};
    ///
    /// let at = Utc::now() + Duration::minutes(30);
    /// let reminder = actix_outbox::NewEvent::new("order", "42", "order.payment_reminder", serde_json::json!({}))
    ///     .not_before(at);
    /// assert_eq!(reminder.not_before, Some(at));
    /// ```
    ///
    /// The instant is the application's clock's; where the database's differs, compute it from
    /// the database's (`SELECT now() + interval '30 minutes'` in the same transaction), as
    /// `actix-outbox enqueue --delay` does.
    #[must_use]
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// Adds the header `name: value` (replacing an earlier one of that name), published with
    /// the event: the RabbitMQ sink sends it as an AMQP header whose value is a long string.
    ///
    /// The sink's own headers win: an entry named `x-deduplication-header` or `x-attempt`, or
    /// whose name starts with `x-outbox-` or `x-aggregate-`, is stored but not published (the
    /// message carries the sink's value of that name instead). Two of them are read by the
    /// sink: `x-outbox-routing-key` ([`NewEvent::routing_key`]) and `x-outbox-exchange`
    /// ([`NewEvent::exchange`]). In [`CloudEventsMode::Binary`](crate::sink::CloudEventsMode::Binary)
    /// an entry whose name starts with `cloudEvents:` is not published either. A name longer than 255 bytes
    /// cannot be sent over AMQP, nor headers that take more than
    /// [`MAX_PRODUCER_HEADER_BYTES`](crate::wire::MAX_PRODUCER_HEADER_BYTES) encoded (about the
    /// sum of names and values): the message then fails permanently (the row goes dead with a
    /// `last_error` saying why).
    ///
    /// ```
    /// let event = actix_outbox::NewEvent::new("order", "42", "order.created", serde_json::json!({}))
    ///     .header("tenant", "acme")
    ///     .header("correlation-id", "c-17");
    /// assert_eq!(event.headers, Some(serde_json::json!({"tenant": "acme", "correlation-id": "c-17"})));
    /// ```
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let entry = serde_json::Value::String(value.into());
        match &mut self.headers {
            Some(serde_json::Value::Object(map)) => {
                map.insert(name.into(), entry);
            }
            // None, or a non-object set by hand (which would publish no headers): start over.
            other => {
                let mut map = serde_json::Map::new();
                map.insert(name.into(), entry);
                *other = Some(serde_json::Value::Object(map));
            }
        }
        self
    }

    /// Publishes the event with routing key `key` instead of the sink's
    /// ([`RabbitConfig::routing_key_template`](crate::sink::RabbitConfig::routing_key_template),
    /// or the event type). Stored as the header [`wire::ROUTING_KEY`](crate::wire::ROUTING_KEY)
    /// (`x-outbox-routing-key`), which is never published; setting that header with
    /// [`NewEvent::header`] does the same. A key longer than 255 bytes is refused by
    /// [`enqueue`](crate::enqueue) with [`StoreError::InvalidEvent`](crate::StoreError::InvalidEvent)
    /// (a row written otherwise goes dead when published).
    ///
    /// ```
    /// let event = actix_outbox::NewEvent::new("order", "42", "created", serde_json::json!({})).routing_key("eu.order.created");
    /// assert_eq!(event.headers, Some(serde_json::json!({"x-outbox-routing-key": "eu.order.created"})));
    /// ```
    #[must_use]
    pub fn routing_key(self, key: impl Into<String>) -> Self {
        self.header(crate::wire::ROUTING_KEY, key)
    }

    /// Publishes the event to the exchange `name` instead of the sink's
    /// ([`RabbitConfig::exchange`](crate::sink::RabbitConfig::exchange)). Stored as the header
    /// [`wire::EXCHANGE`](crate::wire::EXCHANGE) (`x-outbox-exchange`), which is never
    /// published; setting that header with [`NewEvent::header`] does the same. The sink never
    /// declares it: until the exchange exists, the message fails retryably (see
    /// [`RabbitSink`](crate::sink::RabbitSink#exchange-and-routing-key)). A name RabbitMQ does not
    /// accept (empty, over 255 bytes, other characters than letters, digits, `-`, `_`, `.`, `:`)
    /// is refused by [`enqueue`](crate::enqueue) with
    /// [`StoreError::InvalidEvent`](crate::StoreError::InvalidEvent).
    ///
    /// ```
    /// let event = actix_outbox::NewEvent::new("order", "42", "created", serde_json::json!({})).exchange("billing");
    /// assert_eq!(event.headers, Some(serde_json::json!({"x-outbox-exchange": "billing"})));
    /// ```
    #[must_use]
    pub fn exchange(self, name: impl Into<String>) -> Self {
        self.header(crate::wire::EXCHANGE, name)
    }

    /// Whether the event's own routing key and exchange can be published.
    pub(crate) fn check(&self) -> Result<(), String> {
        let Some(serde_json::Value::Object(headers)) = &self.headers else { return Ok(()) };
        if let Some(key) = headers.get(crate::wire::ROUTING_KEY) {
            match key {
                serde_json::Value::String(key) => crate::wire::check_routing_key(key)?,
                other => return Err(format!("the routing key header holds {other}, not a string")),
            }
        }
        if let Some(name) = headers.get(crate::wire::EXCHANGE) {
            match name {
                serde_json::Value::String(name) => crate::wire::check_exchange(name)?,
                other => return Err(format!("the exchange header holds {other}, not a string")),
            }
        }
        Ok(())
    }
}

#[cfg(feature = "opentelemetry")]
impl NewEvent {
    /// Adds the current span's W3C trace context to the event's headers (`traceparent`, and
    /// `tracestate` when set), so that the dispatcher's `publish` span continues the producer's
    /// trace and consumers receive the context with the message. Feature `opentelemetry`.
    ///
    /// Call it while the span the event belongs to is current (inside the request's span, say).
    /// It reads the span through `tracing_opentelemetry` and writes the headers with the global
    /// propagator, so the application installs both: a `tracing_opentelemetry` layer in its
    /// subscriber, and `opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new())`
    /// (from `opentelemetry_sdk`). Outside such a span, or with the default (no-op) propagator,
    /// it adds nothing. The `enqueue` functions never add trace context on their own.
    ///
    /// ```
    /// let event = actix_outbox::NewEvent::new("order", "42", "order.created", serde_json::json!({}))
    ///     .with_trace_context();
    /// assert_eq!(event.headers, None, "no span with a trace context is current here");
    /// ```
    #[must_use]
    pub fn with_trace_context(self) -> Self {
        crate::trace::current_context_headers().into_iter().fold(self, |event, (name, value)| event.header(name, value))
    }
}

/// Reads the `headers` column's JSON text leniently (see [`OutboxMessage::headers`]).
pub(crate) fn headers_from_json(text: Option<&str>) -> BTreeMap<String, String> {
    let Some(text) = text.filter(|t| *t != "{}") else { return BTreeMap::new() };
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .filter_map(|(name, value)| match value {
                serde_json::Value::Null => None,
                serde_json::Value::String(s) => Some((name, s)),
                other => Some((name, other.to_string())),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// A whole outbox row, for operators and tests.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Serialize)]
#[diesel(table_name = outbox)]
#[diesel(check_for_backend(diesel::pg::Pg))]
#[non_exhaustive]
pub struct OutboxRow {
    /// The outbox id.
    pub id: i64,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Aggregate instance.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Event body.
    pub payload: serde_json::Value,
    /// Insert time.
    pub created_at: DateTime<Utc>,
    /// Where the row is in its lifecycle.
    pub status: Status,
    /// Not claimable before this instant.
    pub available_at: DateTime<Utc>,
    /// Claims so far.
    pub attempts: i32,
    /// Who holds (or last held) the lease.
    pub lease_owner: Option<String>,
    /// When the lease runs out.
    pub lease_until: Option<DateTime<Utc>>,
    /// The fencing token.
    pub lease_version: i64,
    /// The last failure, or why the row went dead.
    pub last_error: Option<String>,
    /// When the row became done.
    pub done_at: Option<DateTime<Utc>>,
    /// The producer's headers ([`NewEvent::header`]), as stored: a JSON object, `NULL` for a
    /// row written by plain SQL that set it so.
    pub headers: Option<serde_json::Value>,
}
