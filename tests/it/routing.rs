//! Where a message goes and what it says it is, against the real broker (127.0.0.1:5672;
//! `TEST_AMQP_URL` overrides) and the real PostgreSQL: the event's own routing key and exchange
//! (`NewEvent::routing_key`, `NewEvent::exchange`), the sink's routing key template, and the
//! CloudEvents binary mode read back by the CloudEvents SDK. Every test has a database of its
//! own and uniquely named exchanges and queues, deleted at the end.

use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::{CloudEventsMode, ExchangeKind, RabbitConfig, RabbitError, RabbitSink};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor, StoreError, wire};
use cloudevents::message::{BinaryDeserializer, BinarySerializer, MessageAttributeValue};
use cloudevents::{AttributesReader, Data, Event};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_url, eventually, saw};

const WITHIN: Duration = PATIENCE;

fn dispatcher_config() -> DispatcherConfig {
    DispatcherConfig::default()
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(20))
        .backoff_cap(Duration::from_millis(200))
}

fn sink_config(exchange: &str) -> RabbitConfig {
    RabbitConfig::new(amqp_url())
        .exchange(exchange)
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

fn message_id(d: &Delivery) -> i64 {
    d.properties.message_id().as_ref().expect("message_id").as_str().parse().expect("decimal message_id")
}

async fn enqueue(db: &TestDb, event: NewEvent) -> i64 {
    actix_outbox::enqueue(&mut db.conn().await, &event).await.unwrap()
}

fn header_names(d: &Delivery) -> Vec<String> {
    d.properties.headers().as_ref().map_or(Vec::new(), |h| h.inner().keys().map(|k| k.to_string()).collect())
}

/// (a) The event's routing key wins over the sink's template, which wins over the event type
/// (the template's absence is the default, checked by a second sink): one queue per expected
/// key, bound to that key only, holds exactly its message.
#[actix_rt::test]
async fn the_events_key_wins_over_the_template_which_wins_over_the_event_type() {
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("keys").await;
    broker.declare(ExchangeKind::Topic).await;
    let own_q = broker.queue(&["eu.custom"], FieldTable::default()).await;
    let templated_q = broker.queue(&["order.o-2.created"], FieldTable::default()).await;
    let plain_q = broker.queue(&["created"], FieldTable::default()).await;
    let own =
        enqueue(&db, NewEvent::new("order", "o-1", "created", serde_json::json!({})).routing_key("eu.custom")).await;
    let templated = enqueue(&db, NewEvent::new("order", "o-2", "created", serde_json::json!({}))).await;

    let config = sink_config(&broker.exchange).routing_key_template("{aggregate_type}.{aggregate_id}.{event_type}");
    let sink = RabbitSink::connect(config).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();
    eventually(WITHIN, "both rows done", || async { saw(db.count_status("done").await, |v| *v == 2) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    // No template: the event type.
    let plain = enqueue(&db, NewEvent::new("order", "o-3", "created", serde_json::json!({}))).await;
    let sink = RabbitSink::connect(sink_config(&broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();
    eventually(WITHIN, "the third row done", || async { saw(db.count_status("done").await, |v| *v == 3) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    let got = |d: Vec<Delivery>| d.iter().map(|d| (message_id(d), d.routing_key.to_string())).collect::<Vec<_>>();
    assert_eq!(got(broker.take(&own_q, 1).await), [(own, "eu.custom".to_owned())]);
    assert_eq!(got(broker.take(&templated_q, 1).await), [(templated, "order.o-2.created".to_owned())]);
    assert_eq!(got(broker.take(&plain_q, 1).await), [(plain, "created".to_owned())]);
    let own_delivery_headers = {
        let row = db.row(own).await;
        row.headers
    };
    assert_eq!(own_delivery_headers, Some(serde_json::json!({"x-outbox-routing-key": "eu.custom"})));
}

/// (b) A row naming exchange B arrives on B's queue, and the default exchange's queue holds
/// only the other row; the reserved header is not published.
#[actix_rt::test]
async fn an_events_exchange_takes_its_message_elsewhere() {
    let db = TestDb::new().await;
    let (default, default_q) = TestBroker::with_queue("default").await;
    let (other, other_q) = TestBroker::with_queue("other").await;
    let elsewhere =
        enqueue(&db, NewEvent::new("order", "o-1", "moved", serde_json::json!({})).exchange(&other.exchange)).await;
    let here = enqueue(&db, NewEvent::new("order", "o-2", "stayed", serde_json::json!({}))).await;

    let sink = RabbitSink::connect(sink_config(&default.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();
    eventually(WITHIN, "both rows done", || async { saw(db.count_status("done").await, |v| *v == 2) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    let on_other = other.take(&other_q, 1).await;
    assert_eq!((message_id(&on_other[0]), on_other[0].exchange.as_str()), (elsewhere, other.exchange.as_str()));
    assert_eq!(on_other[0].routing_key.as_str(), "moved");
    assert_eq!(header_names(&on_other[0]), [wire::AGGREGATE_ID, wire::AGGREGATE_TYPE, wire::ATTEMPT, wire::SOURCE]);
    let on_default = default.take(&default_q, 1).await;
    assert_eq!((message_id(&on_default[0]), on_default[0].exchange.as_str()), (here, default.exchange.as_str()));
}

/// (c) A row naming an exchange that does not exist is retried (attempts counted, `last_error`
/// naming the exchange) while the other rows of its batch are delivered on the same channel
/// (the sink never reconnected); once the exchange is declared and bound, the row arrives, through
/// the same sink, to a dispatcher started again. (Attempts are
/// not capped here: at the default 12, a loaded host could take longer to declare the exchange
/// than the row's last retries.)
#[actix_rt::test]
async fn a_missing_exchange_is_retried_without_closing_the_shared_channel() {
    let db = TestDb::new().await;
    let (default, default_q) = TestBroker::with_queue("shared").await;
    let mut missing = TestBroker::new("missing").await;
    let mut ids = Vec::new();
    for n in 0..5 {
        let event = NewEvent::new("order", format!("o-{n}"), "placed", serde_json::json!({ "n": n }));
        let event = if n == 2 { event.exchange(&missing.exchange) } else { event };
        ids.push(enqueue(&db, event).await);
    }
    let waiting = ids[2];

    let sink = RabbitSink::connect(sink_config(&default.exchange)).await.unwrap();
    let config = dispatcher_config().max_attempts(1_000_000);
    let dispatcher = OutboxSupervisor::start(config.clone(), db.pool.clone(), sink.clone()).unwrap();
    eventually(WITHIN, "the four other rows done", || async { saw(db.count_status("done").await, |v| *v == 4) }).await;
    eventually(WITHIN, "the waiting row retried", || async { saw(db.row(waiting).await, |row| row.attempts >= 3) })
        .await;
    let row = db.row(waiting).await;
    assert!(matches!(row.status, Status::Pending | Status::Processing), "{:?}", row.status);
    let error = row.last_error.unwrap();
    assert!(error.contains(&format!("exchange {:?} (named by the event) does not exist", missing.exchange)), "{error}");
    let mut delivered: Vec<i64> = default.take(&default_q, 4).await.iter().map(message_id).collect();
    delivered.sort_unstable();
    assert_eq!(delivered, [ids[0], ids[1], ids[3], ids[4]]);
    assert_eq!(sink.reconnects(), 0, "the confirm channel survived");

    // The exchange and its queue's binding come while no dispatcher runs: a publish between the
    // two would find the exchange without a binding, which is unroutable, a permanent failure.
    dispatcher.send(Shutdown).await.unwrap();
    missing.declare(ExchangeKind::Topic).await;
    let missing_q = missing.queue(&["#"], FieldTable::default()).await;
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();
    eventually(WITHIN, "the waiting row done", || async {
        saw(db.row(waiting).await, |row| row.status == Status::Done)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;
    let arrived = missing.take(&missing_q, 1).await;
    assert_eq!((message_id(&arrived[0]), arrived[0].exchange.as_str()), (waiting, missing.exchange.as_str()));
    assert_eq!(db.count_status("dead").await, 0);
    assert_eq!(sink.reconnects(), 0);
}

/// (d) A template with an unknown placeholder or an unbalanced brace fails `connect` as a
/// configuration error saying which; an event whose own key or exchange AMQP cannot carry is
/// refused at enqueue, writing nothing.
#[actix_rt::test]
async fn bad_templates_and_bad_event_routes_are_refused_up_front() {
    for (template, says) in [
        ("{aggregate_type}.{tenant}", "unknown placeholder {tenant}"),
        ("{event_type", "the brace at byte 0 is not closed"),
        ("a}", "the brace at byte 1 closes nothing"),
    ] {
        match RabbitSink::connect(sink_config("unused").routing_key_template(template)).await {
            Err(RabbitError::Config(why)) => {
                assert_eq!(why.split(": ").next().unwrap(), format!("routing key template {template:?}"));
                assert!(why.contains(says), "{why}");
            }
            other => panic!("{template}: {:?}", other.map(|_| "connected")),
        }
    }
    let db = TestDb::new().await;
    let event = || NewEvent::new("order", "o-1", "created", serde_json::json!({}));
    let long = actix_outbox::enqueue(&mut db.conn().await, &event().routing_key("k".repeat(256))).await.unwrap_err();
    assert!(matches!(long, StoreError::InvalidEvent(_)), "{long}");
    assert_eq!(long.to_string(), "invalid event: routing key is 256 bytes long; AMQP allows 255");
    let bad = actix_outbox::enqueue(&mut db.conn().await, &event().exchange("a b")).await.unwrap_err();
    assert_eq!(
        bad.to_string(),
        "invalid event: exchange name \"a b\" holds ' '; RabbitMQ allows letters, digits, '-', '_', '.' and ':'"
    );
    let by_header = actix_outbox::enqueue(&mut db.conn().await, &event().header(wire::EXCHANGE, "")).await.unwrap_err();
    assert!(by_header.to_string().contains("empty exchange"), "{by_header}");
    assert_eq!(db.rows().await.len(), 0, "nothing written");
}

/// The delivery's AMQP headers and body as a CloudEvents binary-mode message, for the SDK's
/// generic deserializer: `cloudEvents:`-prefixed application properties are the attributes
/// (extensions when the spec version has no attribute of that name), `content_type` is
/// `datacontenttype`.
struct AmqpBinary<'a>(&'a Delivery);

impl BinaryDeserializer for AmqpBinary<'_> {
    fn deserialize_binary<R: Sized, V: BinarySerializer<R>>(self, mut visitor: V) -> cloudevents::message::Result<R> {
        let headers = self.0.properties.headers().clone().unwrap_or_default();
        let text = |v: &AMQPValue| match v {
            AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        };
        let version = headers.inner().get(wire::CE_SPECVERSION).and_then(text).unwrap_or_default();
        let version = cloudevents::event::SpecVersion::try_from(version.as_str())?;
        let names = version.attribute_names();
        visitor = visitor.set_spec_version(version)?;
        for (name, value) in headers.inner() {
            let Some(attribute) = name.as_str().strip_prefix(wire::CE_PREFIX) else { continue };
            if attribute == "specversion" {
                continue;
            }
            let value = MessageAttributeValue::String(text(value).expect("string attribute"));
            visitor = if names.contains(&attribute) {
                visitor.set_attribute(attribute, value)?
            } else {
                visitor.set_extension(attribute, value)?
            };
        }
        if let Some(content_type) = self.0.properties.content_type() {
            visitor =
                visitor.set_attribute("datacontenttype", MessageAttributeValue::String(content_type.to_string()))?;
        }
        visitor.end_with_data(self.0.data.clone())
    }
}

/// (e) In CloudEvents binary mode the CloudEvents SDK reads every attribute of a delivered
/// message: id, source, type, specversion, time, subject, datacontenttype and the data.
#[actix_rt::test]
async fn the_cloudevents_sdk_reads_every_attribute() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("ce").await;
    let payload = serde_json::json!({"total": 12.5, "lines": [{"sku": "ü-1"}]});
    let id =
        enqueue(&db, NewEvent::new("order", "o-42", "order.created", payload.clone()).header("tenant", "acme")).await;
    let sink = RabbitSink::connect(sink_config(&broker.exchange).cloudevents(CloudEventsMode::Binary)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();
    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(WITHIN, "row done", || async { saw(db.row(id).await, |row| row.status == Status::Done) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;
    let row = db.row(id).await;
    let source = db.source().await;

    let headers = delivered.properties.headers().clone().unwrap();
    assert_eq!(
        headers.inner().get(wire::CE_TIME),
        Some(&AMQPValue::LongString(
            row.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true).as_str().into()
        ))
    );
    assert_eq!(delivered.properties.content_type().as_ref().map(ShortString::as_str), Some("application/json"));
    let event: Event = AmqpBinary(&delivered).into_event().unwrap();
    assert_eq!(event.id(), id.to_string());
    assert_eq!(event.source(), &source);
    assert_eq!(event.ty(), "order.created");
    assert_eq!(event.specversion(), cloudevents::event::SpecVersion::V10);
    assert_eq!(event.time(), Some(&row.created_at));
    assert_eq!(event.subject(), Some("order/o-42"));
    assert_eq!(event.datacontenttype(), Some("application/json"));
    // The SDK keeps a binary-mode body as bytes: they are the payload's JSON.
    match event.data() {
        Some(Data::Binary(bytes)) => assert_eq!(serde_json::from_slice::<serde_json::Value>(bytes).unwrap(), payload),
        other => panic!("{other:?}"),
    }
    // The outbox's own headers and the producer's go along, as extensions a reader may ignore.
    let extensions: Vec<(&str, String)> = event.iter_extensions().map(|(k, v)| (k, v.to_string())).collect();
    assert_eq!(extensions, []);
    assert_eq!(
        header_names(&delivered),
        [
            wire::CE_ID,
            wire::CE_SOURCE,
            wire::CE_SPECVERSION,
            wire::CE_SUBJECT,
            wire::CE_TIME,
            wire::CE_TYPE,
            "tenant",
            wire::AGGREGATE_ID,
            wire::AGGREGATE_TYPE,
            wire::ATTEMPT,
            wire::SOURCE,
        ]
        .into_iter()
        .map(str::to_owned)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect::<Vec<_>>()
    );
}
