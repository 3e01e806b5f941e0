//! Many producers, one consumer: two producer databases whose outbox ids overlap exactly relay
//! through real dispatchers and the real broker to one inbox consumer, which must apply every
//! event of both once, tell a true redelivery from a twin of the other producer, and refuse
//! poison without losing the good messages behind it.
//!
//! The second producer starts only once the first one's events are all applied, so that every
//! one of its ids arrives after the same id (and a higher one of the same aggregate) of the
//! first: an inbox keyed by message id alone would take each as a duplicate, or as late.

use std::collections::BTreeSet;
use std::time::Duration;

use actix::Addr;
use actix_outbox::admin::Status;
use actix_outbox::dispatcher::Shutdown;
use actix_outbox::inbox::{
    self, GetMetrics, HandlerError, InboxConfig, InboxHandler, InboxMessage, InboxMetrics, InboxSupervisor,
};
use actix_outbox::sink::{RabbitConfig, RabbitSink};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor};
use diesel::sql_types::{BigInt, Bool, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::future::BoxFuture;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::AMQPValue;

use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_url, eventually, saw};

const WITHIN: Duration = PATIENCE;
/// Events each producer writes: ids 1..=EVENTS in both databases.
const EVENTS: i64 = 12;

/// The consumer's database: the inbox, and the handler's `applied` table.
async fn consumer_database() -> TestDb {
    let db = TestDb::new().await;
    inbox::migrate_inbox(&db.url).await.unwrap();
    db.conn()
        .await
        .batch_execute(
            "CREATE TABLE applied (
                seq bigserial PRIMARY KEY,
                source text NOT NULL,
                message_id bigint NOT NULL,
                aggregate_id text NOT NULL,
                late boolean NOT NULL,
                payload text
            )",
        )
        .await
        .unwrap();
    db
}

/// Records every message it is handed in `applied`.
struct Apply;

impl InboxHandler for Apply {
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        message: &'a InboxMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            diesel::sql_query(
                "INSERT INTO applied (source, message_id, aggregate_id, late, payload) VALUES ($1, $2, $3, $4, $5)",
            )
            .bind::<Text, _>(&message.source)
            .bind::<BigInt, _>(message.message_id)
            .bind::<Text, _>(&message.aggregate_id)
            .bind::<Bool, _>(message.late)
            .bind::<Nullable<Text>, _>(message.payload.as_ref().map(|p| p.to_string()))
            .execute(conn)
            .await?;
            Ok(())
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, diesel::QueryableByName)]
struct Applied {
    #[diesel(sql_type = Text)]
    source: String,
    #[diesel(sql_type = BigInt)]
    message_id: i64,
    #[diesel(sql_type = Bool)]
    late: bool,
    #[diesel(sql_type = Nullable<Text>)]
    payload: Option<String>,
}

async fn applied(db: &TestDb) -> Vec<Applied> {
    diesel::sql_query("SELECT source, message_id, late, payload FROM applied ORDER BY seq")
        .load(&mut db.conn().await)
        .await
        .unwrap()
}

async fn metrics(consumer: &Addr<InboxSupervisor>) -> InboxMetrics {
    consumer.send(GetMetrics).await.unwrap()
}

/// A producer database with `EVENTS` events over aggregates `A` and `B` (ids 1..=EVENTS).
async fn producer() -> TestDb {
    let db = TestDb::new().await;
    let events: Vec<_> = (1..=EVENTS)
        .map(|n| {
            NewEvent::new("order", if n % 2 == 0 { "A" } else { "B" }, "order.placed", serde_json::json!({"n": n}))
        })
        .collect();
    let ids = actix_outbox::enqueue_many(&mut db.conn().await, &events).await.unwrap();
    assert_eq!(ids, (1..=EVENTS).collect::<Vec<_>>(), "both producers number their rows alike");
    db
}

/// Runs a dispatcher on `db` until its rows are all done.
async fn relay(db: &TestDb, exchange: &str) {
    let sink = RabbitSink::connect(RabbitConfig::new(amqp_url()).exchange(exchange)).await.unwrap();
    let config = DispatcherConfig::default().poll_interval(Duration::from_millis(50));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();
    eventually(WITHIN, "every row of the producer done", || async {
        saw(db.count_status(Status::Done.as_str()).await, |v| *v == EVENTS)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;
}

/// Puts row `id` of `db` back to pending, so that its dispatcher publishes it again: the copy
/// a consumer gets after a lease takeover, with the same source and id.
async fn republish(db: &TestDb, id: i64) {
    diesel::sql_query("UPDATE outbox SET status = 'pending', available_at = now(), done_at = NULL WHERE id = $1")
        .bind::<BigInt, _>(id)
        .execute(&mut db.conn().await)
        .await
        .unwrap();
}

/// Both producers through one exchange into one consumer (ordered or not): every event of
/// both applied exactly once and in time, each producer's redelivered row a duplicate.
async fn two_producers_into_one_consumer(ordered: bool) {
    let consumer_db = consumer_database().await;
    let (mut broker, queue) = TestBroker::with_queue("producers").await;
    broker.remove_at_end(format!("{queue}.dlq"), format!("{queue}.dlx"));
    let config = InboxConfig::new("it", amqp_url(), &queue)
        .ordered(ordered)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50));
    let consumer = InboxSupervisor::start(config, consumer_db.pool.clone(), Apply).unwrap();
    let (first, second) = (producer().await, producer().await);
    let (one, two) = (first.source().await, second.source().await);
    assert_ne!(one, two, "two databases, two sources");

    relay(&first, &broker.exchange).await;
    eventually(WITHIN, "the first producer's events applied", || async {
        saw(metrics(&consumer).await.handled, |v| *v == EVENTS as u64)
    })
    .await;
    relay(&second, &broker.exchange).await;
    eventually(WITHIN, "the second producer's events applied", || async {
        saw(metrics(&consumer).await.handled, |v| *v == 2 * EVENTS as u64)
    })
    .await;
    // A true redelivery of each: the same source, the same id.
    republish(&first, 3).await;
    republish(&second, 4).await;
    relay(&first, &broker.exchange).await;
    relay(&second, &broker.exchange).await;
    eventually(WITHIN, "both redeliveries received", || async { saw(metrics(&consumer).await.received, |v| *v == 26) })
        .await;
    consumer.send(inbox::Shutdown).await.unwrap();

    let m = metrics(&consumer).await;
    assert_eq!((m.handled, m.duplicates, m.dead_lettered), (24, 2, 0), "{m:?}");
    let got: Vec<(String, i64)> = applied(&consumer_db).await.into_iter().map(|a| (a.source, a.message_id)).collect();
    let unique: BTreeSet<_> = got.iter().cloned().collect();
    assert_eq!(unique.len(), got.len(), "nothing applied twice: {got:?}");
    let expected: BTreeSet<(String, i64)> =
        [&one, &two].into_iter().flat_map(|s| (1..=EVENTS).map(move |id| (s.clone(), id))).collect();
    assert_eq!(unique, expected);
    assert!(applied(&consumer_db).await.iter().all(|a| !a.late), "ids of two sources are never compared");
    assert_eq!(broker.depth(&format!("{queue}.dlq")).await, 0);
}

#[actix_rt::test]
async fn two_producers_with_the_same_ids_are_each_applied_once() {
    two_producers_into_one_consumer(false).await;
}

#[actix_rt::test]
async fn an_ordered_consumer_orders_each_producer_on_its_own() {
    two_producers_into_one_consumer(true).await;
}

fn error_of(d: &Delivery) -> String {
    match d.properties.headers().as_ref().and_then(|h| h.inner().get(inbox::ERROR_HEADER).cloned()) {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("no reason on the dead letter: {other:?}"),
    }
}

/// Poison in front of good messages: no id, an id that is not a number, a JSON-typed body that
/// is not JSON, and one that is not even UTF-8. The poison is dead-lettered with its reason and
/// its body intact; the good messages behind it are applied; with `raw_bodies`, the two
/// undecodable bodies reach the handler instead, with no payload rather than an invented one.
#[actix_rt::test]
async fn poison_is_dead_lettered_with_its_reason_and_the_good_messages_behind_it_applied() {
    for raw_bodies in [false, true] {
        let db = consumer_database().await;
        let (mut broker, queue) = TestBroker::with_queue("poison").await;
        broker.remove_at_end(format!("{queue}.dlq"), format!("{queue}.dlx"));
        broker.channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        let json = |id: &str| {
            BasicProperties::default().with_content_type("application/json".into()).with_message_id(id.into())
        };
        let poison: [(BasicProperties, &[u8], &str); 4] = [
            (BasicProperties::default().with_content_type("application/json".into()), b"{}", "no message_id"),
            (json("abc"), b"{}", "\"abc\" is not a decimal"),
            (json("101"), b"{not json", "body is not JSON"),
            (json("102"), b"\xff\xfe{}", "body is not JSON"),
        ];
        let good = [(json("1"), &br#"{"ok": 1}"#[..]), (json("2"), br#"{"ok": 2}"#)];
        for (properties, body) in poison.iter().map(|(p, b, _)| (p, *b)).chain(good.iter().map(|(p, b)| (p, *b))) {
            let sent = broker
                .channel
                .basic_publish(
                    broker.exchange.as_str().into(),
                    "order.poison".into(),
                    BasicPublishOptions::default(),
                    body,
                    properties.clone(),
                )
                .await
                .unwrap();
            assert!(sent.await.unwrap().is_ack());
        }
        let config = InboxConfig::new("it", amqp_url(), &queue).raw_bodies(raw_bodies);
        let consumer = InboxSupervisor::start(config, db.pool.clone(), Apply).unwrap();
        let (handled, dead) = if raw_bodies { (4, 2) } else { (2, 4) };
        eventually(WITHIN, "every message handled or dead-lettered", || async {
            saw(metrics(&consumer).await, |m| m.handled == handled && m.dead_lettered == dead)
        })
        .await;
        consumer.send(inbox::Shutdown).await.unwrap();

        let letters = broker.take(&format!("{queue}.dlq"), dead as usize).await;
        let expected = if raw_bodies { &poison[..2] } else { &poison[..] };
        for (letter, (_, body, reason)) in letters.iter().zip(expected) {
            let got = error_of(letter);
            assert!(got.starts_with("unusable message: ") && got.contains(reason), "{got:?} should say {reason:?}");
            assert_eq!(letter.data, *body, "the dead letter keeps the body as sent");
        }
        let mut got = applied(&db).await;
        got.sort();
        let row = |id, payload: Option<&str>| Applied {
            source: String::new(),
            message_id: id,
            late: false,
            payload: payload.map(str::to_owned),
        };
        let mut want = vec![row(1, Some(r#"{"ok":1}"#)), row(2, Some(r#"{"ok":2}"#))];
        if raw_bodies {
            want.extend([row(101, None), row(102, None)]);
        }
        assert_eq!(got, want, "raw_bodies {raw_bodies}");
    }
}
