//! The inbox consumer against the real RabbitMQ (127.0.0.1:5672, guest/guest; `TEST_AMQP_URL`
//! overrides) and the real PostgreSQL. Every test has a database of its own (outbox and inbox
//! migrated, plus an `effects` table the handler writes to) and uniquely named queues, deleted
//! at the end. Tests that cut the broker or the database go through a [`Proxy`] of their own.
//!
//! The test handler writes its effect row *before* it decides whether to fail, so every count
//! of effects also proves that failed attempts were rolled back.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use actix::Addr;
use actix_outbox::inbox::{
    self, GetMetrics, HandlerError, InboxConfig, InboxHandler, InboxMessage, InboxMetrics, InboxSupervisor, LateEvents,
    Shutdown,
};
use actix_outbox::testing::inbox::CrashConsumer;
use actix_outbox::wire;
use diesel::sql_types::{BigInt, Bool, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::future::BoxFuture;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::proxy::Proxy;
use actix_outbox_test_support::{
    PATIENCE, ScratchDb, TestBroker, TestDb, amqp_addr, amqp_url, database_addr as postgres_addr, eventually, saw,
};

const WITHIN: Duration = PATIENCE;

// ---------------------------------------------------------------------------------------------
// Fixtures

/// A database with the inbox migrated too, and the handler's `effects` table.
async fn database() -> TestDb {
    let db = TestDb::new().await;
    inbox::migrate_inbox(&db.url).await.expect("migrate the inbox");
    db.conn()
        .await
        .batch_execute(
            "CREATE TABLE effects (
                seq bigserial PRIMARY KEY,
                message_id bigint NOT NULL,
                attempt integer NOT NULL,
                late boolean NOT NULL,
                redelivered boolean NOT NULL
            )",
        )
        .await
        .unwrap();
    db
}

#[derive(Debug, Clone, diesel::QueryableByName)]
struct Effect {
    #[diesel(sql_type = BigInt)]
    message_id: i64,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Bool)]
    late: bool,
    #[diesel(sql_type = Bool)]
    redelivered: bool,
}

async fn effects(db: &TestDb) -> Vec<Effect> {
    diesel::sql_query("SELECT message_id, attempt, late, redelivered FROM effects ORDER BY seq")
        .load(&mut db.conn().await)
        .await
        .unwrap()
}

async fn effect_count(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) AS n FROM effects").await
}

async fn inbox_count(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) AS n FROM inbox").await
}

/// Asserts that `expected` ids (and no other) each have exactly one effect.
async fn assert_one_effect_each(db: &TestDb, expected: impl IntoIterator<Item = i64>) {
    let expected: BTreeSet<i64> = expected.into_iter().collect();
    let mut per_id: BTreeMap<i64, usize> = BTreeMap::new();
    for e in effects(db).await {
        *per_id.entry(e.message_id).or_default() += 1;
    }
    let twice: Vec<_> = per_id.iter().filter(|(_, n)| **n > 1).map(|(id, n)| (*id, *n)).collect();
    assert!(twice.is_empty(), "applied more than once (id, times): {twice:?}");
    let got: BTreeSet<i64> = per_id.keys().copied().collect();
    let missing: Vec<_> = expected.difference(&got).collect();
    let extra: Vec<_> = got.difference(&expected).collect();
    assert!(missing.is_empty() && extra.is_empty(), "missing effects {missing:?}, unexpected effects {extra:?}");
}

type Decide = dyn Fn(&InboxMessage) -> Result<(), HandlerError> + Send + Sync;

/// Writes an effect row, waits `pause`, then lets `decide` say how the call ends.
struct Recorder {
    pause: Duration,
    decide: Box<Decide>,
}

impl Recorder {
    fn ok() -> Self {
        Self { pause: Duration::ZERO, decide: Box::new(|_| Ok(())) }
    }

    fn deciding(decide: impl Fn(&InboxMessage) -> Result<(), HandlerError> + Send + Sync + 'static) -> Self {
        Self { pause: Duration::ZERO, decide: Box::new(decide) }
    }

    fn pausing(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }
}

impl InboxHandler for Recorder {
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        message: &'a InboxMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            diesel::sql_query("INSERT INTO effects (message_id, attempt, late, redelivered) VALUES ($1, $2, $3, $4)")
                .bind::<BigInt, _>(message.message_id)
                .bind::<Integer, _>(message.attempt as i32)
                .bind::<Bool, _>(message.late)
                .bind::<Bool, _>(message.redelivered)
                .execute(conn)
                .await?;
            if !self.pause.is_zero() {
                tokio::time::sleep(self.pause).await;
            }
            (self.decide)(message)
        })
    }
}

/// The source of every [`Event`].
const PRODUCER: &str = "it-producer";

/// A message as the outbox's sink publishes it.
#[derive(Debug, Clone)]
struct Event {
    id: i64,
    event_type: String,
    aggregate: Option<(String, String)>,
}

impl Event {
    fn new(id: i64) -> Self {
        Self { id, event_type: "test.happened".into(), aggregate: Some(("test".into(), format!("a-{}", id % 97))) }
    }

    fn of(id: i64, aggregate_type: &str, aggregate_id: &str) -> Self {
        Self { id, event_type: "test.happened".into(), aggregate: Some((aggregate_type.into(), aggregate_id.into())) }
    }

    fn without_aggregate(id: i64) -> Self {
        Self { id, event_type: "test.happened".into(), aggregate: None }
    }

    fn properties(&self) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(wire::SOURCE.into(), AMQPValue::LongString(PRODUCER.into()));
        if let Some((kind, id)) = &self.aggregate {
            headers.insert(wire::AGGREGATE_TYPE.into(), AMQPValue::LongString(kind.as_str().into()));
            headers.insert(wire::AGGREGATE_ID.into(), AMQPValue::LongString(id.as_str().into()));
        }
        headers.insert(wire::ATTEMPT.into(), AMQPValue::LongInt(1));
        BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(self.id.to_string().into())
            .with_type(self.event_type.as_str().into())
            .with_headers(headers)
    }

    fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({ "id": self.id })).unwrap()
    }
}

/// The shared broker fixture, with what the inbox tests add: unbound queues whose dead-letter
/// exchange and queue (declared by the consumer) go too, and publishing straight to a queue
/// through the default exchange, confirmed.
struct Broker(TestBroker);

impl Broker {
    async fn new() -> Broker {
        let broker = TestBroker::new("inbox").await;
        broker.channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        Broker(broker)
    }

    /// A new durable queue, bound to nothing.
    async fn queue(&mut self) -> String {
        let name = self.0.queue(&[], FieldTable::default()).await;
        self.0.remove_at_end(format!("{name}.dlq"), format!("{name}.dlx"));
        name
    }

    /// Publishes `events` to `queue` through the default exchange, confirmed.
    async fn publish(&self, queue: &str, events: &[Event]) {
        let mut confirms = Vec::with_capacity(events.len());
        for e in events {
            confirms.push(self.publish_raw(queue, e.properties(), &e.body()).await);
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
    }

    async fn publish_raw(&self, queue: &str, properties: BasicProperties, body: &[u8]) -> lapin::PublisherConfirm {
        self.0
            .channel
            .basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body, properties)
            .await
            .unwrap()
    }

    /// Messages ready in `queue` (not counting unacknowledged ones).
    async fn depth(&self, queue: &str) -> u32 {
        self.0.depth(queue).await
    }

    /// Consumes exactly `n` messages from `queue` and checks that nothing else is left in it.
    async fn take(&self, queue: &str, n: usize) -> Vec<Delivery> {
        self.0.take(queue, n).await
    }
}

fn config(url: String, queue: &str) -> InboxConfig {
    InboxConfig::new("it", url, queue)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .outage_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

async fn metrics(consumer: &Addr<InboxSupervisor>) -> InboxMetrics {
    consumer.send(GetMetrics).await.unwrap()
}

fn header<'a>(d: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(name)
}

fn header_text(d: &Delivery, name: &str) -> String {
    match header(d, name) {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("header {name}: expected a long string, got {other:?}"),
    }
}

fn header_int(d: &Delivery, name: &str) -> i64 {
    match header(d, name) {
        Some(AMQPValue::LongInt(n)) => i64::from(*n),
        Some(AMQPValue::LongLongInt(n)) => *n,
        other => panic!("header {name}: expected an integer, got {other:?}"),
    }
}

fn message_id(d: &Delivery) -> Option<String> {
    d.properties.message_id().as_ref().map(|id| id.as_str().to_owned())
}

// ---------------------------------------------------------------------------------------------
// Exactly once

/// 5,000 messages, 1,000 of them published twice with the same message id: exactly 5,000
/// effects, one per id, and nothing left on the queue.
#[actix_rt::test]
async fn five_thousand_messages_with_a_thousand_duplicates_have_five_thousand_effects() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let mut events = Vec::new();
    for id in 1..=5000 {
        events.push(Event::new(id));
        if id % 5 == 0 {
            events.push(Event::new(id - 2));
        }
    }
    assert_eq!(events.len(), 6000);
    broker.publish(&queue, &events).await;

    let consumer = InboxSupervisor::start(config(amqp_url(), &queue), db.pool.clone(), Recorder::ok()).unwrap();
    eventually(WITHIN, "6,000 deliveries settled", || async {
        saw(metrics(&consumer).await, |m| m.handled + m.duplicates == 6000)
    })
    .await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, 1..=5000).await;
    assert_eq!(effect_count(&db).await, 5000);
    assert_eq!(inbox_count(&db).await, 5000);
    let m = metrics(&consumer).await;
    assert_eq!((m.received, m.handled, m.duplicates), (6000, 5000, 1000));
    assert_eq!((m.retried, m.dead_lettered, m.requeued, m.panics), (0, 0, 0, 0));
    assert_eq!(broker.depth(&queue).await, 0, "every delivery acknowledged");
    assert_eq!(broker.depth(&format!("{queue}.dlq")).await, 0);
}

/// The consumer's broker connection is cut (and refused for a second) twice while messages
/// flow: it reconnects by itself, and every message has exactly one effect.
#[actix_rt::test]
async fn broker_connection_cut_mid_stream_applies_every_message_once() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let proxy = Proxy::start(amqp_addr()).await;
    let events: Vec<_> = (1..=3000).map(Event::new).collect();
    broker.publish(&queue, &events).await;

    let handler = Recorder::ok().pausing(Duration::from_millis(1));
    let consumer = InboxSupervisor::start(config(proxy.amqp_url(), &queue), db.pool.clone(), handler).unwrap();
    for (round, at) in [(1_u64, 500), (2, 1500)] {
        eventually(WITHIN, &format!("{at} effects"), || async { saw(effect_count(&db).await, |v| *v >= at) }).await;
        proxy.refuse(true);
        proxy.sever();
        eventually(WITHIN, "the consumer noticed the cut", || async {
            saw(metrics(&consumer).await, |m| !m.connected)
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.refuse(false);
        eventually(WITHIN, "reconnected", || async {
            saw(metrics(&consumer).await, |m| m.connected && m.reconnects >= round)
        })
        .await;
    }
    eventually(WITHIN, "3,000 messages recorded", || async { saw(inbox_count(&db).await, |v| *v == 3000) }).await;
    eventually(WITHIN, "queue drained", || async { saw(broker.depth(&queue).await, |v| *v == 0) }).await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, 1..=3000).await;
    let m = metrics(&consumer).await;
    assert!(m.reconnects >= 2, "{m:?}");
    assert_eq!(m.handled, 3000, "{m:?}");
    assert_eq!((m.dead_lettered, m.retried), (0, 0));
    assert_eq!(broker.depth(&queue).await, 0, "nothing left unacknowledged");
}

/// The consumer actor crashes twice mid-stream (with deliveries in hand and transactions
/// open): the supervisor restarts it, and every message has exactly one effect.
#[actix_rt::test]
async fn consumer_actor_crashes_and_restarts_applying_every_message_once() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let events: Vec<_> = (1..=2000).map(Event::new).collect();
    broker.publish(&queue, &events).await;

    let handler = Recorder::ok().pausing(Duration::from_millis(2));
    let consumer = InboxSupervisor::start(config(amqp_url(), &queue), db.pool.clone(), handler).unwrap();
    for (crash, at) in [(1_u64, 300), (2, 1000)] {
        eventually(WITHIN, &format!("{at} effects"), || async { saw(effect_count(&db).await, |v| *v >= at) }).await;
        consumer.send(CrashConsumer).await.unwrap();
        eventually(WITHIN, "restarted", || async { saw(metrics(&consumer).await.restarts, |v| *v == crash) }).await;
    }
    eventually(WITHIN, "2,000 messages recorded", || async { saw(inbox_count(&db).await, |v| *v == 2000) }).await;
    eventually(WITHIN, "queue drained", || async { saw(broker.depth(&queue).await, |v| *v == 0) }).await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, 1..=2000).await;
    let m = metrics(&consumer).await;
    assert_eq!(m.restarts, 2);
    assert_eq!((m.dead_lettered, m.retried), (0, 0));
    assert_eq!(broker.depth(&queue).await, 0);
}

// ---------------------------------------------------------------------------------------------
// Failure classes

/// Of 100 messages: ids ending in 1 fail permanently, ids ending in 2 fail retryably twice and
/// succeed on attempt 3, ids ending in 3 always fail retryably (3 attempts allowed), id 50
/// always panics; plus two messages without a usable id. The permanent ones, the exhausted
/// ones, the panicking one and the unusable ones land on the dead-letter queue with their
/// reason; every other message has one effect, the retried ones on attempt 3; no failed
/// attempt left an effect.
#[actix_rt::test]
async fn failures_dead_letter_with_a_reason_and_retries_succeed_on_a_later_attempt() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let events: Vec<_> = (1..=100).map(Event::new).collect();
    broker.publish(&queue, &events).await;
    broker.publish_raw(&queue, BasicProperties::default(), b"{}").await.await.unwrap();
    broker.publish_raw(&queue, BasicProperties::default().with_message_id("abc".into()), b"{}").await.await.unwrap();

    let handler = Recorder::deciding(|m| match m.message_id % 10 {
        _ if m.message_id == 50 => panic!("boom {}", m.message_id),
        1 => Err(HandlerError::permanent(format!("bad {}", m.message_id))),
        2 if m.attempt < 3 => Err(HandlerError::retryable(format!("not yet {}", m.attempt))),
        3 => Err(HandlerError::retryable(format!("never {}", m.message_id))),
        _ => Ok(()),
    });
    let consumer =
        InboxSupervisor::start(config(amqp_url(), &queue).max_attempts(3), db.pool.clone(), handler).unwrap();
    let permanent: BTreeSet<i64> = (1..=100).filter(|id| id % 10 == 1).collect();
    let flaky: BTreeSet<i64> = (1..=100).filter(|id| id % 10 == 2).collect();
    let exhausted: BTreeSet<i64> = (1..=100).filter(|id| id % 10 == 3).collect();
    let applied: BTreeSet<i64> =
        (1..=100).filter(|id| !permanent.contains(id) && !exhausted.contains(id) && *id != 50).collect();
    let dead = permanent.len() + exhausted.len() + 1 + 2;
    eventually(WITHIN, "every message handled or dead-lettered", || async {
        saw(metrics(&consumer).await, |m| m.handled == applied.len() as u64 && m.dead_lettered == dead as u64)
    })
    .await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, applied.iter().copied()).await;
    for e in effects(&db).await {
        let expected = if flaky.contains(&e.message_id) { 3 } else { 1 };
        assert_eq!(e.attempt, expected, "message {} applied on attempt {}", e.message_id, e.attempt);
    }
    assert_eq!(inbox_count(&db).await, applied.len() as i64, "failed messages leave no inbox row");
    let m = metrics(&consumer).await;
    // Retries: 2 per flaky id, 2 per exhausted id, 2 for the panicking one.
    assert_eq!(m.retried, 2 * flaky.len() as u64 + 2 * exhausted.len() as u64 + 2, "{m:?}");
    assert_eq!((m.panics, m.unusable), (3, 2), "{m:?}");
    assert_eq!(broker.depth(&queue).await, 0);

    let letters = broker.take(&format!("{queue}.dlq"), dead).await;
    let (mut seen, mut unusable) = (BTreeSet::new(), 0);
    for d in &letters {
        let reason = header_text(d, "x-inbox-error");
        assert_eq!(header_text(d, "x-inbox-queue"), queue);
        assert_eq!(header_text(d, "x-inbox-consumer"), "it");
        let Some(Ok(id)) = message_id(d).map(|id| id.parse::<i64>()) else {
            assert!(reason.starts_with("unusable message: "), "{reason}");
            assert!(reason.contains("no message_id") || reason.contains("\"abc\" is not a decimal"), "{reason}");
            unusable += 1;
            continue;
        };
        assert!(seen.insert(id), "message {id} dead-lettered twice");
        assert_eq!(header_text(d, wire::SOURCE), PRODUCER, "the original headers travel with the dead letter");
        assert_eq!(d.data, Event::new(id).body(), "and the original body");
        if permanent.contains(&id) {
            assert!(reason.contains("permanent") && reason.contains(&format!("bad {id}")), "{reason}");
            assert_eq!(header_int(d, "x-inbox-attempt"), 1);
        } else if exhausted.contains(&id) {
            assert!(reason.contains("retries exhausted after 3 attempts") && reason.contains("never"), "{reason}");
            assert_eq!(header_int(d, "x-inbox-attempt"), 3);
        } else {
            assert_eq!(id, 50);
            assert!(reason.contains("handler panicked: boom 50"), "{reason}");
            assert_eq!(header_int(d, "x-inbox-attempt"), 3);
        }
    }
    let mut expected: BTreeSet<i64> = permanent.union(&exhausted).copied().collect();
    expected.insert(50);
    assert_eq!((seen, unusable), (expected, 2));
}

// ---------------------------------------------------------------------------------------------
// Database outage

/// The database goes away (connections cut, new ones refused for 3 s) while 1,200 deliveries
/// (1,000 messages, 200 of them twice) flow: consumption pauses — no effect while it is out, a
/// bounded number of tries — and resumes by itself; each message has exactly one effect,
/// nothing is dead-lettered, the queue ends empty.
#[actix_rt::test]
async fn database_outage_pauses_consumption_and_loses_nothing() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let proxy = Proxy::start(postgres_addr()).await;
    let pool = actix_outbox::connect_pool(&proxy.route(&db.url), 8).await.unwrap();
    let mut events = Vec::new();
    for id in 1..=1000 {
        events.push(Event::new(id));
        if id % 5 == 0 {
            events.push(Event::new(id - 1));
        }
    }
    broker.publish(&queue, &events).await;

    let handler = Recorder::ok().pausing(Duration::from_millis(2));
    let consumer = InboxSupervisor::start(config(amqp_url(), &queue), pool, handler).unwrap();
    eventually(WITHIN, "200 effects", || async { saw(effect_count(&db).await, |v| *v >= 200) }).await;
    proxy.refuse(true);
    proxy.sever();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = effect_count(&db).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = metrics(&consumer).await;
    assert_eq!(effect_count(&db).await, before, "nothing is applied while the database is out");
    assert!(during.outage_waits > 0, "the outage was noticed: {during:?}");
    assert!(during.outage_waits < 300, "tries during the outage are paced, not spinning: {during:?}");
    assert_eq!(during.dead_lettered, 0, "an outage is nobody's message's fault");
    assert!(before < 1000, "the outage hit mid-stream");

    proxy.refuse(false);
    eventually(WITHIN, "1,000 messages recorded", || async { saw(inbox_count(&db).await, |v| *v == 1000) }).await;
    eventually(WITHIN, "queue drained", || async { saw(broker.depth(&queue).await, |v| *v == 0) }).await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, 1..=1000).await;
    let m = metrics(&consumer).await;
    // A commit whose answer the cut swallowed is tried again and found recorded: it counts as a
    // duplicate, not as handled (its one effect is there, as checked above).
    assert_eq!(m.handled + m.duplicates, m.received, "{m:?}");
    assert!(m.handled <= 1000 && m.received >= 1200, "{m:?}");
    assert!(m.duplicates >= 200, "every second copy was a duplicate: {m:?}");
    assert_eq!((m.dead_lettered, m.retried, m.requeued), (0, 0, 0), "{m:?}");
    assert_eq!(broker.depth(&queue).await, 0);
    assert_eq!(broker.depth(&format!("{queue}.dlq")).await, 0);
}

/// The consumer's database link freezes mid-stream (the connections open then forward nothing
/// and stay open; new ones pass): each transaction caught on a frozen connection misses the
/// pool's query timeout, is given up with its connection, and is tried again on a fresh one,
/// its delivery held meanwhile, and the server ends the transaction it left open (its locks
/// with it). Every message has exactly one effect (a commit whose answer the freeze swallowed is
/// found recorded and counted a duplicate), nothing is dead-lettered, and the queue ends empty.
#[actix_rt::test]
async fn a_frozen_database_link_is_given_up_and_every_message_has_one_effect() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let proxy = Proxy::start(postgres_addr()).await;
    let pool = actix_outbox::PoolConfig::new(proxy.route(&db.url))
        .size(8)
        .query_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let mut events = Vec::new();
    for id in 1..=1000 {
        events.push(Event::new(id));
        if id % 5 == 0 {
            events.push(Event::new(id - 1));
        }
    }
    broker.publish(&queue, &events).await;

    // A handler that takes its time after its write, so that the freeze finds transactions
    // holding their inbox row's lock: given up by the client, they must not keep it on the server
    // (the message's next try, on a fresh connection, would wait for it for ever).
    let handler = Recorder::ok().pausing(Duration::from_millis(50));
    // A handler caught in a statement on a frozen connection waits out its own timeout: a short
    // one, so that the test does not wait the default 30 s for each.
    let config = config(amqp_url(), &queue).handler_timeout(Duration::from_secs(2));
    let consumer = InboxSupervisor::start(config, pool, handler).unwrap();
    eventually(WITHIN, "200 effects", || async { effect_count(&db).await >= 200 }).await;
    let open = proxy.connections();
    proxy.freeze();
    let frozen_at = Instant::now();
    eventually(WITHIN, "1,000 messages recorded", || async { inbox_count(&db).await == 1000 }).await;
    let recovered_after = frozen_at.elapsed();
    eventually(WITHIN, "queue drained", || async { broker.depth(&queue).await == 0 }).await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, 1..=1000).await;
    let m = metrics(&consumer).await;
    eprintln!(
        "grey: inbox link frozen: {open} connections frozen, every message recorded {:.1}s later, {} outage waits",
        recovered_after.as_secs_f64(),
        m.outage_waits
    );
    assert!(m.outage_waits > 0, "the frozen transactions were given up: {m:?}");
    assert!(proxy.connections() > open, "fresh connections replaced the frozen ones");
    assert_eq!(m.handled + m.duplicates, m.received, "{m:?}");
    assert_eq!((m.dead_lettered, m.retried), (0, 0), "{m:?}");
    assert_eq!(broker.depth(&format!("{queue}.dlq")).await, 0);
}

/// A shutdown while the database is out does not wait for it: the deliveries in hand are given
/// back to the broker (nack with requeue) and the answer comes (not after the outage), with every
/// delivery received accounted for; once the database is back, a new consumer applies every
/// message exactly once.
#[actix_rt::test]
async fn shutdown_during_a_database_outage_gives_the_deliveries_back() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let proxy = Proxy::start(postgres_addr()).await;
    let pool = actix_outbox::connect_pool(&proxy.route(&db.url), 8).await.unwrap();
    let events: Vec<_> = (1..=300).map(Event::new).collect();
    broker.publish(&queue, &events).await;

    let handler = Recorder::ok().pausing(Duration::from_millis(5));
    // A shutdown that waited for an attempt to time out would wait an hour: far past the
    // deadline below, however slow the host.
    let config = config(amqp_url(), &queue).prefetch(20).handler_timeout(Duration::from_secs(3600));
    let first = InboxSupervisor::start(config.clone(), pool, handler).unwrap();
    eventually(WITHIN, "50 effects", || async { saw(effect_count(&db).await, |v| *v >= 50) }).await;
    proxy.refuse(true);
    proxy.sever();
    eventually(WITHIN, "the outage noticed", || async { saw(metrics(&first).await.outage_waits, |v| *v > 0) }).await;
    let started = Instant::now();
    tokio::time::timeout(WITHIN, first.send(Shutdown))
        .await
        .unwrap_or_else(|_| panic!("shutdown waited for the database: no answer after {WITHIN:?}"))
        .unwrap();
    eprintln!("shutdown during the outage took {:?}", started.elapsed());
    let m = metrics(&first).await;
    assert!(m.requeued >= 1, "deliveries in hand were given back: {m:?}");
    assert_eq!(m.handled + m.duplicates + m.requeued, m.received, "every delivery accounted for: {m:?}");
    assert_eq!(m.dead_lettered, 0);
    // A COMMIT the server had received when the proxy cut its connection still completes on
    // the server: read the count once no cut connection holds a transaction any more.
    eventually(WITHIN, "the cut connections' transactions ended", || async {
        let open = db
            .scalar(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
            )
            .await;
        saw(open, |n| *n == 0)
    })
    .await;
    let recorded = inbox_count(&db).await;
    let waiting = i64::from(broker.depth(&queue).await);
    // Whatever was not applied is back on the queue; so is any delivery whose commit went
    // through while its answer was cut off (it is recorded, and comes again as a duplicate).
    assert!(waiting >= 300 - recorded, "{waiting} waiting, {recorded} recorded");

    proxy.refuse(false);
    let second = InboxSupervisor::start(config, db.pool.clone(), Recorder::ok()).unwrap();
    eventually(WITHIN, "300 messages recorded", || async { saw(inbox_count(&db).await, |v| *v == 300) }).await;
    eventually(WITHIN, "queue drained", || async { saw(broker.depth(&queue).await, |v| *v == 0) }).await;
    second.send(Shutdown).await.unwrap();
    let m2 = metrics(&second).await;
    assert_eq!(m2.received as i64, waiting, "{m2:?}");
    assert_eq!(m2.duplicates as i64, waiting - (300 - recorded), "the recorded ones are duplicates: {m2:?}");
    assert_one_effect_each(&db, 1..=300).await;
    assert_eq!(broker.depth(&queue).await, 0);
}

// ---------------------------------------------------------------------------------------------
// Order

/// What the order tests publish: aggregate A gets 10, 20, 15 (late), 30, 25 (late) and 15
/// again (a duplicate); B gets 12, 11 (late); messages without an aggregate are never late.
fn out_of_order() -> Vec<Event> {
    vec![
        Event::of(10, "order", "A"),
        Event::of(12, "order", "B"),
        Event::of(20, "order", "A"),
        Event::without_aggregate(5),
        Event::of(15, "order", "A"),
        Event::of(11, "order", "B"),
        Event::of(30, "order", "A"),
        Event::without_aggregate(3),
        Event::of(25, "order", "A"),
        Event::of(15, "order", "A"),
    ]
}

async fn late_flags(db: &TestDb) -> BTreeMap<i64, bool> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        message_id: i64,
        #[diesel(sql_type = Bool)]
        late: bool,
    }
    let rows: Vec<Row> =
        diesel::sql_query("SELECT message_id, late FROM inbox").load(&mut db.conn().await).await.unwrap();
    rows.into_iter().map(|r| (r.message_id, r.late)).collect()
}

async fn high_water(db: &TestDb, aggregate_id: &str) -> Option<i64> {
    let mut conn = db.conn().await;
    let aggregate =
        actix_outbox::testing::inbox::AggregateRef { source: PRODUCER, aggregate_type: "order", aggregate_id };
    actix_outbox::testing::inbox::last_applied(&mut conn, "it", aggregate).await.unwrap()
}

/// Ordered, late messages skipped: recorded (so their copy is a duplicate), acknowledged, not
/// handled; the high-water marks end at the newest ids.
#[actix_rt::test]
async fn ordered_consumer_skips_late_messages() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    broker.publish(&queue, &out_of_order()).await;
    let config = config(amqp_url(), &queue).ordered(true);
    let consumer = InboxSupervisor::start(config, db.pool.clone(), Recorder::ok()).unwrap();
    eventually(WITHIN, "10 deliveries settled", || async {
        saw(metrics(&consumer).await, |m| m.handled + m.duplicates + m.late_skipped == 10)
    })
    .await;
    consumer.send(Shutdown).await.unwrap();

    let applied: Vec<i64> = effects(&db).await.iter().map(|e| e.message_id).collect();
    assert_eq!(applied.iter().copied().collect::<BTreeSet<_>>(), BTreeSet::from([10, 12, 20, 5, 30, 3]));
    assert!(effects(&db).await.iter().all(|e| !e.late));
    let position = |id| applied.iter().position(|a| *a == id).unwrap();
    assert!(position(10) < position(20) && position(20) < position(30), "one aggregate in order: {applied:?}");
    let flags = late_flags(&db).await;
    let expected = BTreeMap::from([
        (3, false),
        (5, false),
        (10, false),
        (11, true),
        (12, false),
        (15, true),
        (20, false),
        (25, true),
        (30, false),
    ]);
    assert_eq!(flags, expected);
    let m = metrics(&consumer).await;
    assert_eq!((m.handled, m.late_skipped, m.late_flagged, m.duplicates), (6, 3, 0, 1), "{m:?}");
    assert_eq!((high_water(&db, "A").await, high_water(&db, "B").await), (Some(30), Some(12)));
    assert_eq!(broker.depth(&queue).await, 0);
}

/// Ordered, late messages flagged: every message handled once, the late ones with
/// `late == true`; the high-water marks stay at the newest ids.
#[actix_rt::test]
async fn ordered_consumer_flags_late_messages_when_asked() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    broker.publish(&queue, &out_of_order()).await;
    let config = config(amqp_url(), &queue).ordered(true).late_events(LateEvents::Flag);
    let consumer = InboxSupervisor::start(config, db.pool.clone(), Recorder::ok()).unwrap();
    eventually(WITHIN, "10 deliveries settled", || async {
        saw(metrics(&consumer).await, |m| m.handled + m.duplicates == 10)
    })
    .await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, [3, 5, 10, 11, 12, 15, 20, 25, 30]).await;
    let late: BTreeSet<i64> = effects(&db).await.iter().filter(|e| e.late).map(|e| e.message_id).collect();
    assert_eq!(late, BTreeSet::from([11, 15, 25]));
    let m = metrics(&consumer).await;
    assert_eq!((m.handled, m.late_flagged, m.late_skipped, m.duplicates), (9, 3, 0, 1), "{m:?}");
    assert_eq!((high_water(&db, "A").await, high_water(&db, "B").await), (Some(30), Some(12)));
}

// ---------------------------------------------------------------------------------------------
// Shutdown

/// Shutdown (sent twice at once) while a slow handler holds deliveries: both answers come once
/// every delivery received is committed and acknowledged; nothing was requeued; a second
/// consumer then gets exactly the rest, none of it redelivered, and finds no duplicate.
#[actix_rt::test]
async fn graceful_shutdown_commits_and_acks_what_it_holds() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let events: Vec<_> = (1..=200).map(Event::new).collect();
    broker.publish(&queue, &events).await;

    let slow = Recorder::ok().pausing(Duration::from_millis(50));
    // A shutdown that waited for an attempt to time out would wait an hour.
    let config = config(amqp_url(), &queue).prefetch(20).concurrency(4).handler_timeout(Duration::from_secs(3600));
    let first = InboxSupervisor::start(config.clone(), db.pool.clone(), slow).unwrap();
    eventually(WITHIN, "10 effects", || async { saw(effect_count(&db).await, |v| *v >= 10) }).await;
    let started = Instant::now();
    let both = tokio::time::timeout(WITHIN, async { tokio::join!(first.send(Shutdown), first.send(Shutdown)) });
    let (a, b) = both.await.unwrap_or_else(|_| panic!("no answer to the shutdown after {WITHIN:?}"));
    a.unwrap();
    b.unwrap();
    first.send(Shutdown).await.unwrap();
    let took = started.elapsed();
    let m = metrics(&first).await;
    let applied = effect_count(&db).await;
    assert!(m.received > 4, "deliveries were prefetched beyond the lanes: {m:?}");
    assert_eq!(m.handled, m.received, "every delivery in hand was handled: {m:?}");
    assert_eq!((m.requeued, m.duplicates), (0, 0), "{m:?}");
    assert_eq!(applied, m.handled as i64);
    assert_eq!(inbox_count(&db).await, applied);
    assert!(!m.connected);
    eprintln!("shutdown with a slow handler took {took:?}");
    assert_eq!(broker.depth(&queue).await as i64, 200 - applied, "the rest waits on the queue, acknowledged ones gone");

    let second = InboxSupervisor::start(config, db.pool.clone(), Recorder::ok()).unwrap();
    eventually(WITHIN, "200 messages recorded", || async { saw(inbox_count(&db).await, |v| *v == 200) }).await;
    second.send(Shutdown).await.unwrap();
    let m2 = metrics(&second).await;
    assert_eq!(m2.received as i64, 200 - applied, "{m2:?}");
    assert_eq!(m2.duplicates, 0, "nothing the first consumer handled came again");
    assert!(effects(&db).await.iter().all(|e| !e.redelivered), "nothing was redelivered");
    assert_one_effect_each(&db, 1..=200).await;
    assert_eq!(broker.depth(&queue).await, 0);
}

// ---------------------------------------------------------------------------------------------
// Migrations

/// A database that exists but is not migrated, dropped at the end.
struct BareDb {
    url: String,
    _scratch: ScratchDb,
}

impl BareDb {
    async fn new() -> Self {
        let scratch = ScratchDb::new();
        assert!(actix_outbox::admin::ensure_database(&scratch.url).await.unwrap(), "a new database");
        BareDb { url: scratch.url.clone(), _scratch: scratch }
    }

    async fn versions(&self) -> BTreeSet<String> {
        #[derive(diesel::QueryableByName)]
        struct V {
            #[diesel(sql_type = Text)]
            version: String,
        }
        let mut conn = AsyncPgConnection::establish(&self.url).await.unwrap();
        let rows: Vec<V> =
            diesel::sql_query("SELECT version FROM __diesel_schema_migrations").load(&mut conn).await.unwrap();
        rows.into_iter().map(|v| v.version).collect()
    }

    async fn tables(&self) -> BTreeSet<String> {
        #[derive(diesel::QueryableByName)]
        struct T {
            #[diesel(sql_type = Text)]
            name: String,
        }
        let mut conn = AsyncPgConnection::establish(&self.url).await.unwrap();
        let sql = "SELECT table_name::text AS name FROM information_schema.tables \
                   WHERE table_schema = 'public' AND table_name <> '__diesel_schema_migrations'";
        let rows: Vec<T> = diesel::sql_query(sql).load(&mut conn).await.unwrap();
        rows.into_iter().map(|t| t.name).collect()
    }
}

/// The inbox and outbox migration sets share diesel's one table without a shared version:
/// either can go first, each applies only its own migrations, and running either again (or
/// checking what is pending) sees nothing of the other.
#[actix_rt::test]
async fn inbox_and_outbox_migrations_apply_in_either_order_without_disturbing_each_other() {
    let outbox_tables = BTreeSet::from(["outbox".to_owned(), "outbox_horizon".to_owned()]);
    let inbox_tables = BTreeSet::from(["inbox".to_owned(), "inbox_aggregates".to_owned()]);
    let both: BTreeSet<String> = outbox_tables.union(&inbox_tables).cloned().collect();

    // Inbox first.
    let db = BareDb::new().await;
    let inbox_applied = inbox::migrate_inbox(&db.url).await.unwrap();
    assert_eq!(inbox_applied, vec!["20261201900001".to_owned(), "20261202900002".to_owned()]);
    assert_eq!(db.tables().await, inbox_tables);
    assert_eq!(actix_outbox::admin::pending_migrations(&db.url).await.unwrap().len(), 13, "the outbox is still to do");
    let outbox_applied = actix_outbox::migrate(&db.url).await.unwrap();
    assert_eq!(outbox_applied.len(), 13);
    assert_eq!(db.tables().await, both);
    assert!(inbox::migrate_inbox(&db.url).await.unwrap().is_empty());
    assert!(actix_outbox::migrate(&db.url).await.unwrap().is_empty());
    assert!(inbox::pending_inbox_migrations(&db.url).await.unwrap().is_empty());
    assert!(actix_outbox::admin::pending_migrations(&db.url).await.unwrap().is_empty());
    let versions = db.versions().await;
    assert_eq!(versions.len(), 15);

    // Outbox first.
    let db = BareDb::new().await;
    assert_eq!(actix_outbox::migrate(&db.url).await.unwrap(), outbox_applied);
    assert_eq!(db.tables().await, outbox_tables);
    assert_eq!(
        inbox::pending_inbox_migrations(&db.url).await.unwrap(),
        vec!["2026-12-01-900001_create_inbox", "2026-12-02-900002_inbox_source"]
    );
    let url = db.url.clone();
    let blocking = tokio::task::spawn_blocking(move || inbox::migrate_inbox_blocking(&url)).await.unwrap();
    assert_eq!(blocking.unwrap(), inbox_applied);
    assert_eq!(db.tables().await, both);
    assert!(actix_outbox::migrate(&db.url).await.unwrap().is_empty());
    assert!(inbox::migrate_inbox(&db.url).await.unwrap().is_empty());
    assert_eq!(db.versions().await, versions, "the same fifteen versions whatever the order");
}

/// The migration that keys the inbox by source, on a table that already holds rows: they keep
/// their ids under the empty source, so a copy of a message recorded before (a message of a
/// producer that sent no source) is still a duplicate, while the same id from a named source is
/// new; ordered consumers keep their high-water marks the same way.
#[actix_rt::test]
async fn the_source_migration_keeps_what_a_populated_inbox_recorded() {
    use actix_outbox::testing::inbox::{self as store, AggregateRef};
    use diesel_migrations::MigrationHarness;
    let db = BareDb::new().await;
    let url = db.url.clone();
    tokio::task::spawn_blocking(move || {
        let mut conn = <diesel_async::async_connection_wrapper::AsyncConnectionWrapper<AsyncPgConnection> as diesel::Connection>::establish(&url).unwrap();
        conn.run_next_migration(inbox::INBOX_MIGRATIONS).expect("the first inbox migration");
    })
    .await
    .unwrap();
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    conn.batch_execute(
        "INSERT INTO inbox (consumer, message_id, event_type) SELECT 'c', n, 'e' FROM generate_series(1, 1000) n;
         INSERT INTO inbox_aggregates (consumer, aggregate_type, aggregate_id, last_message_id) VALUES ('c', 'order', 'A', 900);",
    )
    .await
    .unwrap();
    assert_eq!(inbox::migrate_inbox(&db.url).await.unwrap(), vec!["20261202900002".to_owned()]);

    let legacy = InboxMessage::new(7, "e", serde_json::json!({}));
    assert!(!store::record(&mut conn, "c", &legacy).await.unwrap(), "a copy of a recorded message is a duplicate");
    assert!(store::record(&mut conn, "c", &legacy.clone().with_source("db-1")).await.unwrap());
    assert_eq!(count_in(&mut conn, "SELECT count(*) AS n FROM inbox WHERE source = ''").await, 1000);
    let old = AggregateRef { source: "", aggregate_type: "order", aggregate_id: "A" };
    assert_eq!(store::last_applied(&mut conn, "c", old).await.unwrap(), Some(900));
}

async fn count_in(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    diesel::sql_query(sql).get_result::<N>(conn).await.unwrap().n
}

/// The inbox's SQL on its own: a record is new once, the high-water mark only rises, purge
/// removes old rows.
#[actix_rt::test]
async fn inbox_store_records_once_and_tracks_the_newest_per_aggregate() {
    use actix_outbox::testing::inbox::{self as store, AggregateOrder, AggregateRef};
    let db = database().await;
    let mut conn = db.conn().await;
    let m = InboxMessage::new(7, "e", serde_json::json!({})).with_aggregate("order", "A").with_source("db-1");
    assert!(store::record(&mut conn, "c", &m).await.unwrap());
    assert!(!store::record(&mut conn, "c", &m).await.unwrap(), "the second copy is a duplicate");
    assert!(store::record(&mut conn, "other", &m).await.unwrap(), "another consumer has its own inbox");
    let twin = m.clone().with_source("db-2");
    assert!(store::record(&mut conn, "c", &twin).await.unwrap(), "the same id of another source is another message");
    assert!(store::is_recorded(&mut conn, "c", "db-1", 7).await.unwrap());
    assert!(store::is_recorded(&mut conn, "c", "db-2", 7).await.unwrap());
    assert!(!store::is_recorded(&mut conn, "c", "", 7).await.unwrap());
    assert!(!store::is_recorded(&mut conn, "c", "db-1", 8).await.unwrap());

    let a = |source| AggregateRef { source, aggregate_type: "order", aggregate_id: "A" };
    let advance = |source: &'static str, id| {
        let url = db.url.clone();
        async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            store::advance_aggregate(&mut conn, "c", a(source), id).await.unwrap()
        }
    };
    assert_eq!(advance("db-1", 10).await, AggregateOrder::InOrder);
    assert_eq!(advance("db-1", 20).await, AggregateOrder::InOrder);
    assert_eq!(advance("db-1", 15).await, AggregateOrder::Late { newest: 20 });
    assert_eq!(advance("db-1", 20).await, AggregateOrder::Late { newest: 20 });
    assert_eq!(advance("db-2", 3).await, AggregateOrder::InOrder, "another source's ids are not compared");
    assert_eq!(store::last_applied(&mut conn, "c", a("db-1")).await.unwrap(), Some(20));
    assert_eq!(store::last_applied(&mut conn, "c", a("db-2")).await.unwrap(), Some(3));
    let b = AggregateRef { source: "db-1", aggregate_type: "order", aggregate_id: "B" };
    assert_eq!(store::last_applied(&mut conn, "c", b).await.unwrap(), None);

    let future = chrono::Utc::now() + chrono::Duration::seconds(60);
    assert_eq!(inbox::purge_inbox(&mut conn, "c", future).await.unwrap(), 2);
    assert!(!store::is_recorded(&mut conn, "c", "db-1", 7).await.unwrap());
    assert!(store::is_recorded(&mut conn, "other", "db-1", 7).await.unwrap(), "purge keeps to its consumer");
}

/// The consumer behind a transaction pooler (a PgBouncer of the test's own in
/// `pool_mode = transaction`): 1,000 messages, 200 of them twice, exactly one effect each.
/// Every attempt is one transaction, and the pool keeps no prepared statement past it.
#[actix_rt::test]
async fn behind_a_transaction_pooler_every_message_has_one_effect() {
    let db = database().await;
    let bouncer = actix_outbox_test_support::PgBouncer::start(&postgres_addr()).await;
    let pool = actix_outbox::PoolConfig::new(bouncer.route(&db.url))
        .size(6)
        .pooler(actix_outbox::Pooler::Transaction)
        .connect()
        .await
        .unwrap();
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let mut events = Vec::new();
    for id in 1..=1000 {
        events.push(Event::new(id));
        if id % 5 == 0 {
            events.push(Event::new(id - 1));
        }
    }
    broker.publish(&queue, &events).await;

    let consumer = InboxSupervisor::start(config(amqp_url(), &queue).concurrency(4), pool, Recorder::ok()).unwrap();
    eventually(WITHIN, "1,200 deliveries settled", || async {
        saw(metrics(&consumer).await, |m| m.handled + m.duplicates == 1200)
    })
    .await;
    consumer.send(Shutdown).await.unwrap();

    assert_one_effect_each(&db, 1..=1000).await;
    assert_eq!(inbox_count(&db).await, 1000);
    let m = metrics(&consumer).await;
    assert_eq!((m.received, m.handled, m.duplicates, m.retried, m.dead_lettered), (1200, 1000, 200, 0, 0));
    assert_eq!(broker.depth(&queue).await, 0);
}

/// A CloudEvent of the AMQP binding, with none of the outbox's own properties (no message_id,
/// no type, no x-outbox-* header): the inbox takes its id, type, source and aggregate from the
/// `cloudEvents:*` application properties (or `cloudEvents_*`, the binding's later spelling).
/// Sent twice with one source (once in each spelling) and once with another (same id): two
/// effects, and the inbox rows name each source, the type and the aggregate of the subject.
#[actix_rt::test]
async fn a_cloudevent_without_the_outbox_properties_is_identified_by_its_attributes() {
    let db = database().await;
    let mut broker = Broker::new().await;
    let queue = broker.queue().await;
    let cloudevent = |source: &str, underscore: bool| {
        let mut headers = FieldTable::default();
        for (name, value) in [
            (wire::CE_SPECVERSION, "1.0"),
            (wire::CE_ID, "4711"),
            (wire::CE_SOURCE, source),
            (wire::CE_TYPE, "order.created"),
            (wire::CE_TIME, "2026-12-04T07:00:00Z"),
            (wire::CE_SUBJECT, "order/o-9"),
        ] {
            let name = if underscore { name.replacen(':', "_", 1) } else { name.to_owned() };
            headers.insert(name.into(), AMQPValue::LongString(value.into()));
        }
        BasicProperties::default().with_headers(headers).with_content_type("application/json".into())
    };
    for (source, underscore) in [("urn:shop:billing", false), ("urn:shop:billing", true), ("urn:shop:stock", true)] {
        broker.publish_raw(&queue, cloudevent(source, underscore), br#"{"order":"o-9"}"#).await.await.unwrap();
    }
    let consumer = InboxSupervisor::start(config(amqp_url(), &queue), db.pool.clone(), Recorder::ok()).unwrap();
    eventually(WITHIN, "two handled, one duplicate", || async {
        saw(metrics(&consumer).await, |m| m.handled == 2 && m.duplicates == 1)
    })
    .await;
    consumer.send(Shutdown).await.unwrap();
    assert_eq!(effects(&db).await.iter().map(|e| e.message_id).collect::<Vec<_>>(), vec![4711, 4711]);
    #[derive(diesel::QueryableByName, Debug, PartialEq)]
    struct Row {
        #[diesel(sql_type = Text)]
        source: String,
        #[diesel(sql_type = Text)]
        event_type: String,
        #[diesel(sql_type = Text)]
        aggregate_type: String,
        #[diesel(sql_type = Text)]
        aggregate_id: String,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT source, event_type, aggregate_type, aggregate_id FROM inbox WHERE message_id = 4711 ORDER BY source",
    )
    .load(&mut db.conn().await)
    .await
    .unwrap();
    let row = |source: &str| Row {
        source: source.into(),
        event_type: "order.created".into(),
        aggregate_type: "order".into(),
        aggregate_id: "o-9".into(),
    };
    assert_eq!(rows, vec![row("urn:shop:billing"), row("urn:shop:stock")]);
    assert_eq!(broker.depth(&queue).await, 0);
}
