//! The RabbitMQ sink against the real broker on 127.0.0.1:5672 (guest/guest; `TEST_AMQP_URL`
//! overrides) and the real PostgreSQL. Every test declares its own uniquely named exchange and
//! queues and deletes them when it ends, even by a panic. Tests that cut or stall the broker go
//! through a [`proxy::Proxy`] of their own.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{ExchangeKind, RabbitConfig, RabbitError, RabbitSink};
use actix_outbox::wire;
use actix_outbox::{DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, PublishError, Publisher};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use crate::proxy::Proxy;
use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_addr, amqp_url, eventually, saw};

const WITHIN: Duration = PATIENCE;

fn dispatcher_config() -> DispatcherConfig {
    DispatcherConfig::default()
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(20))
        .backoff_cap(Duration::from_millis(200))
}

fn sink_config(url: String, exchange: &str) -> RabbitConfig {
    RabbitConfig::new(url).exchange(exchange).reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

fn header<'a>(d: &'a Delivery, name: &str) -> &'a AMQPValue {
    let headers = d.properties.headers().as_ref().expect("headers");
    headers.inner().get(name).unwrap_or_else(|| panic!("header {name} missing"))
}

fn long_string(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("expected a long string, got {other:?}"),
    }
}

fn message_id(d: &Delivery) -> i64 {
    d.properties.message_id().as_ref().expect("message_id").as_str().parse().expect("decimal message_id")
}

/// A claimed-looking message, for tests that drive the sink without a dispatcher.
fn message(id: i64, event_type: &str) -> Arc<OutboxMessage> {
    let payload = serde_json::value::to_raw_value(&serde_json::json!({"id": id})).unwrap();
    Arc::new(OutboxMessage::new(id, "order", format!("o-{id}"), event_type, payload))
}

/// (a) Every property and header the sink documents (see `RabbitSink`) arrives on a real consumer; the body is the payload.
#[actix_rt::test]
async fn message_carries_every_property_and_header() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("props").await;
    let payload = serde_json::json!({"total": 12.5, "lines": [{"sku": "ü-1", "qty": 2}], "note": null});
    let id = {
        let mut conn = db.conn().await;
        actix_outbox::enqueue(&mut conn, &NewEvent::new("order", "o-42", "order.created", payload.clone()))
            .await
            .unwrap()
    };
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(WITHIN, "row done", || async { saw(db.row(id).await, |row| row.status == Status::Done) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    let row = db.row(id).await;
    assert_eq!(delivered.exchange.as_str(), broker.exchange);
    assert_eq!(delivered.routing_key.as_str(), "order.created", "routing key = event type");
    let p = &delivered.properties;
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    assert_eq!(p.content_type().as_ref().map(ShortString::as_str), Some("application/json"));
    assert_eq!(p.message_id().as_ref().map(ShortString::as_str), Some(id.to_string().as_str()));
    assert_eq!(p.kind().as_ref().map(ShortString::as_str), Some("order.created"));
    assert_eq!(*p.timestamp(), Some(row.created_at.timestamp() as u64));
    assert_eq!(p.app_id().as_ref().map(ShortString::as_str), Some("actix-outbox"));
    assert_eq!(long_string(header(&delivered, wire::SOURCE)), db.source().await);
    assert_eq!(long_string(header(&delivered, wire::AGGREGATE_TYPE)), "order");
    assert_eq!(long_string(header(&delivered, wire::AGGREGATE_ID)), "o-42");
    assert_eq!(header(&delivered, wire::ATTEMPT), &AMQPValue::LongInt(1));
    assert_eq!(p.headers().as_ref().unwrap().inner().len(), 4, "exactly the four documented headers");
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&delivered.data).unwrap(), payload);
    assert_eq!((row.attempts, row.last_error), (1, None));
}

/// Many `mandatory` publishes in flight on the sink's one channel, one in seven unroutable: the
/// broker returns those and acks several publishes at once, and lapin hands a return to any
/// confirm of that ack. Each publish still reads its own fate: every returned message (and only
/// those) is unroutable, every routed one is Ok and on the queue.
#[actix_rt::test]
async fn each_returned_message_is_reported_to_its_own_publish() {
    let mut broker = TestBroker::new("returns").await;
    broker.declare(ExchangeKind::Topic).await;
    let queue = broker.queue(&["order.created"], FieldTable::default()).await;
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let unroutable = |id: i64| id % 7 == 3;
    let (mut wrong, mut returned, mut routed) = (Vec::new(), BTreeSet::new(), BTreeSet::new());
    for round in 0..5_i64 {
        let publishes = (1..=200).map(|n| {
            let id = round * 1000 + n;
            let kind = if unroutable(id) { "order.vanished" } else { "order.created" };
            let sink = sink.clone();
            async move { (id, sink.publish(message(id, kind)).await) }
        });
        for (id, result) in futures_util::future::join_all(publishes).await {
            match (&result, unroutable(id)) {
                (Err(PublishError::Permanent(e)), true) if e.starts_with("unroutable:") => {
                    returned.insert(id);
                }
                (Ok(()), false) => {
                    routed.insert(id);
                }
                _ => wrong.push((id, result)),
            }
        }
    }
    sink.close().await;
    assert_eq!(wrong, Vec::new(), "a publish read another message's fate");
    assert_eq!((returned.len(), routed.len()), (142, 858));
    let delivered: BTreeSet<i64> = broker.take(&queue, 858).await.iter().map(message_id).collect();
    assert_eq!(delivered, routed, "exactly the routed messages are on the queue");
}

/// (b) 500 rows through 4 workers: 500 messages, 500 distinct message ids, all rows done.
#[actix_rt::test]
async fn five_hundred_rows_through_four_workers() {
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("bulk").await;
    broker.declare(ExchangeKind::Topic).await;
    let queue = broker.queue(&["test.#"], FieldTable::default()).await;
    let ids = db.seed(500, "bulk").await;
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher =
        OutboxSupervisor::start(dispatcher_config().workers(4).batch(25), db.pool.clone(), sink.clone()).unwrap();

    eventually(WITHIN, "500 rows done", || async { saw(db.count_status("done").await, |v| *v == 500) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    assert_eq!(broker.depth(&queue).await, 500, "every confirmed message is on the queue, once");
    let delivered = broker.take(&queue, 500).await;
    let distinct: BTreeSet<i64> = delivered.iter().map(message_id).collect();
    assert_eq!(distinct, ids.iter().copied().collect::<BTreeSet<_>>(), "500 distinct message ids, one per row");
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.published, m.done, m.retried, m.dead), (500, 500, 0, 0));
    assert!(db.rows().await.iter().all(|r| r.attempts == 1));
    sink.close().await;
}

/// (c) A message nobody is bound for is returned by the broker: dead after one attempt with a
/// last_error naming exchange and routing key, while bound keys flow on.
#[actix_rt::test]
async fn unroutable_message_dies_after_one_attempt_while_bound_keys_flow() {
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("unroutable").await;
    broker.declare(ExchangeKind::Topic).await;
    let queue = broker.queue(&["order.created"], FieldTable::default()).await;
    let (routed, lost) = {
        let mut conn = db.conn().await;
        let mut routed = Vec::new();
        let mut lost = 0;
        for n in 0..21 {
            let kind = if n == 10 { "order.vanished" } else { "order.created" };
            let event = NewEvent::new("order", format!("o-{n}"), kind, serde_json::json!({ "n": n }));
            let id = actix_outbox::enqueue(&mut conn, &event).await.unwrap();
            if n == 10 { lost = id } else { routed.push(id) }
        }
        (routed, lost)
    };
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    eventually(WITHIN, "20 done and 1 dead", || async {
        let counts = (db.count_status("done").await, db.count_status("dead").await);
        saw(counts, |&(done, dead)| done == 20 && dead == 1)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    let dead = db.row(lost).await;
    assert_eq!(dead.status, Status::Dead);
    assert_eq!(dead.attempts, 1, "a permanent failure is not retried");
    let error = dead.last_error.unwrap();
    assert!(error.contains("unroutable"), "{error}");
    assert!(error.contains(&broker.exchange) && error.contains("order.vanished"), "{error}");
    let delivered: Vec<i64> = broker.take(&queue, 20).await.iter().map(message_id).collect();
    assert_eq!(delivered.iter().copied().collect::<BTreeSet<_>>(), routed.into_iter().collect());
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.done, m.dead, m.retried), (20, 1, 0));
    sink.close().await;
}

/// (d) The broker connection is cut while 200 publishes wait for their confirms (the broker
/// has them all; the proxy holds the confirms back), and stays refused while 100 more rows are
/// written. The 200 go back with their attempt refunded, nothing more is claimed but a probe
/// now and then, the sink reconnects by itself, every row ends done with one attempt spent,
/// nothing is lost, and the duplicates are exact: each of the 200 in flight twice, each later
/// row once, with the same message id and body.
#[actix_rt::test]
async fn connection_cut_mid_run_loses_nothing_and_duplicates_keep_their_id() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("cut").await;
    let proxy = Proxy::start(amqp_addr()).await;
    let sink = RabbitSink::connect(sink_config(proxy.amqp_url(), &broker.exchange)).await.unwrap();
    // The publish timeout is far above the time the test holds the confirms back, so that the
    // only failures are the cut's; three attempts: before outages were refunded, a cut this
    // long sent rows dead.
    let config = dispatcher_config()
        .workers(4)
        .batch(50)
        .max_attempts(3)
        .lease(Duration::from_secs(60))
        .publish_timeout(Duration::from_secs(40));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();

    let in_flight = seed_with_confirms_held(&db, &broker, &queue, &proxy, 200, "cut").await;

    proxy.refuse(true);
    proxy.sever();
    eventually(WITHIN, "every in-flight publish was handed back, its attempt refunded", || async {
        let seen = (dispatcher.send(GetMetrics).await.unwrap().released, sink.is_connected());
        saw(seen, |&(released, connected)| released >= 200 && !connected)
    })
    .await;
    assert_eq!(db.count_status("done").await, 0);
    let during = db.seed(100, "during").await;
    // Several probe intervals (500 ms) of outage: only probes touch rows, and give them back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rows = db.rows().await;
    assert!(rows.iter().all(|r| r.status != Status::Dead && r.attempts <= 1), "no attempt is spent on an outage");
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.retried, metrics.dead), (0, 0), "{metrics:?}");
    assert!(metrics.claimed <= 200 + 10, "only probes claim while the broker is away: {metrics:?}");

    proxy.resume();
    proxy.refuse(false);
    eventually(WITHIN, "all 300 rows done", || async { saw(db.count_status("done").await, |v| *v == 300) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    assert!(sink.reconnects() >= 1, "the sink reconnected by itself");
    assert_eq!(db.count_status("dead").await, 0);
    let attempts: BTreeSet<i32> = db.rows().await.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, BTreeSet::from([1]), "the outage cost no row an attempt");

    assert_eq!(broker.depth(&queue).await, 500, "200 × 2 + 100 × 1");
    let delivered = broker.take(&queue, 500).await;
    let rows: BTreeMap<i64, _> = db.rows().await.into_iter().map(|r| (r.id, r)).collect();
    let source = db.source().await;
    let mut copies: BTreeMap<i64, usize> = BTreeMap::new();
    for d in &delivered {
        let id = message_id(d);
        *copies.entry(id).or_default() += 1;
        assert_eq!(long_string(header(d, wire::SOURCE)), source, "a copy carries its outbox's source");
        let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body, rows[&id].payload, "a copy carries its row's body");
    }
    for id in &in_flight {
        assert_eq!(copies.get(id), Some(&2), "row {id} was in flight at the cut: delivered, then again");
    }
    for id in &during {
        assert_eq!(copies.get(id), Some(&1), "row {id} was written during the outage: delivered once");
    }
    assert_eq!(copies.len(), 300);
    sink.close().await;
}

/// (e) A broker that stops answering: each publish times out after the publish timeout, the
/// row goes back to pending with the timeout in last_error and its attempts counted, and it is
/// claimed again rather than stuck; once the broker answers, the row ends done, and every copy
/// of it that the broker got carries the same message id.
#[actix_rt::test]
async fn stalled_broker_times_out_and_reschedules_the_row() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("stall").await;
    let proxy = Proxy::start(amqp_addr()).await;
    let sink = RabbitSink::connect(sink_config(proxy.amqp_url(), &broker.exchange)).await.unwrap();
    let config = dispatcher_config()
        .publish_timeout(Duration::from_millis(300))
        .lease(Duration::from_secs(10))
        .backoff_base(Duration::from_millis(100))
        .backoff_cap(Duration::from_millis(400))
        .max_attempts(1000);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();

    proxy.stall();
    let id = db.seed(1, "stall").await[0];
    eventually(WITHIN, "row rescheduled after a publish timeout", || async {
        saw(db.row(id).await, |row| {
            row.status == Status::Pending
                && row.attempts >= 1
                && row.last_error.as_deref().is_some_and(|e| e.contains("publish timed out after 300ms"))
        })
    })
    .await;
    eventually(WITHIN, "row claimed again, not stuck", || async { saw(db.row(id).await, |row| row.attempts >= 3) })
        .await;
    assert_eq!(db.count_status("done").await, 0);
    assert!(sink.is_connected(), "a silent broker is not a lost connection");

    proxy.resume();
    eventually(WITHIN, "row done once the broker answers", || async {
        saw(db.row(id).await, |row| row.status == Status::Done)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    let row = db.row(id).await;
    let copies = broker.depth(&queue).await as usize;
    assert!(copies >= 1);
    let delivered = broker.take(&queue, copies).await;
    assert!(delivered.iter().all(|d| message_id(d) == id), "every copy carries the row's id");
    let attempts: BTreeSet<i32> = delivered
        .iter()
        .map(|d| match header(d, "x-attempt") {
            AMQPValue::LongInt(n) => *n,
            other => panic!("x-attempt {other:?}"),
        })
        .collect();
    assert_eq!(attempts.len(), copies, "each copy comes from a different attempt");
    assert!(attempts.iter().all(|a| (1..=row.attempts).contains(a)), "{attempts:?} vs {}", row.attempts);
    sink.close().await;
}

/// A queue that is full with `x-overflow = reject-publish` makes the broker nack: refused for
/// now (pushback, no attempt spent), not the message's failure; the channel is kept.
#[tokio::test]
async fn nack_from_a_full_queue_is_refused_for_now() {
    let mut broker = TestBroker::new("nack").await;
    broker.declare(ExchangeKind::Topic).await;
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(1));
    arguments.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    let queue = broker.queue(&["#"], arguments).await;
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();

    assert_eq!(sink.publish(message(1, "order.created")).await, Ok(()));
    match sink.publish(message(2, "order.created")).await {
        Err(e @ PublishError::Refused(_)) => {
            assert!(e.to_string().contains("nack"), "{e}");
            assert!(e.will_retry() && !e.spends_attempt() && !e.is_unavailable(), "{e:?}");
        }
        other => panic!("expected a nack refused for now, got {other:?}"),
    }
    assert!(sink.is_connected(), "a nack does not break the link");
    let third = sink.publish(message(3, "order.created")).await;
    assert!(matches!(third, Err(PublishError::Refused(ref e)) if e.contains("nack")), "{third:?}");
    let kept = broker.take(&queue, 1).await;
    assert_eq!(message_id(&kept[0]), 1);
    assert_eq!(sink.publish(message(4, "order.created")).await, Ok(()), "room again once consumed");
    assert_eq!(sink.reconnects(), 0);
    sink.close().await;
}

/// The routing key and app_id can be replaced.
#[tokio::test]
async fn custom_routing_key_and_app_id() {
    let mut broker = TestBroker::new("custom").await;
    broker.declare(ExchangeKind::Direct).await;
    let queue = broker.queue(&["order/order.created"], FieldTable::default()).await;
    let config = sink_config(amqp_url(), &broker.exchange)
        .exchange_kind(ExchangeKind::Direct)
        .app_id("billing")
        .routing_key(|m| format!("{}/{}", m.aggregate_type, m.event_type));
    let sink = RabbitSink::connect(config).await.unwrap();
    assert_eq!(sink.publish(message(7, "order.created")).await, Ok(()));
    let d = broker.take(&queue, 1).await.pop().unwrap();
    assert_eq!(d.routing_key.as_str(), "order/order.created");
    assert_eq!(d.properties.app_id().as_ref().map(ShortString::as_str), Some("billing"));
    // The event type still travels as `type`, whatever the routing key.
    assert_eq!(d.properties.kind().as_ref().map(ShortString::as_str), Some("order.created"));
    let too_long = sink.publish(message(8, &"x".repeat(300))).await;
    assert!(matches!(too_long, Err(PublishError::Permanent(ref e)) if e.contains("routing key")), "{too_long:?}");
    assert!(sink.is_connected(), "a message-level failure leaves the link alone");
    sink.close().await;
}

/// With `declare_exchange(false)` a missing exchange makes the broker close the channel:
/// publishes fail as the sink being unavailable (not the message's fault: nothing is spent),
/// and once someone creates the exchange the sink, having reopened its channel by itself,
/// publishes again.
#[tokio::test]
async fn missing_exchange_is_retryable_until_it_exists() {
    let mut broker = TestBroker::new("managed").await;
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange).declare_exchange(false)).await.unwrap();
    match sink.publish(message(1, "order.created")).await {
        Err(PublishError::Unavailable(e)) => assert!(e.contains("NOT_FOUND"), "{e}"),
        other => panic!("expected unavailable NOT_FOUND, got {other:?}"),
    }
    broker.declare(ExchangeKind::Topic).await;
    let queue = broker.queue(&["#"], FieldTable::default()).await;
    eventually(WITHIN, "publishing works once the exchange exists", || async {
        saw(sink.publish(message(2, "order.created")).await, |published| published.is_ok())
    })
    .await;
    assert!(sink.reconnects() >= 1, "the sink reopened its channel");
    assert_eq!(message_id(&broker.take(&queue, 1).await[0]), 2);
    sink.close().await;
}

/// Setup failures are reported at connect, classified, and never show the password.
#[tokio::test]
async fn connect_failures_are_classified() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let err =
        RabbitSink::connect(RabbitConfig::new(format!("amqp://guest:s3cret@127.0.0.1:{port}/%2f"))).await.unwrap_err();
    assert!(matches!(err, RabbitError::Unreachable { .. }) && err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("guest:***@") && !err.to_string().contains("s3cret"), "{err}");

    let broker = TestBroker::new("kind").await;
    broker.declare(ExchangeKind::Fanout).await;
    let err = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap_err();
    assert!(matches!(err, RabbitError::Refused { .. }) && !err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("PRECONDITION_FAILED"), "{err}");

    let err = RabbitSink::connect(RabbitConfig::new("http://127.0.0.1/")).await.unwrap_err();
    assert!(matches!(err, RabbitError::Config(_)), "{err:?}");
}

/// A lapin connection made on an arbiter that later stops would hang silently; the sink's
/// connection lives on the sink's own thread, so a sink created on a short-lived arbiter keeps
/// publishing after that arbiter is gone.
#[actix_rt::test]
async fn sink_outlives_the_arbiter_that_created_it() {
    let (broker, queue) = TestBroker::with_queue("arbiter").await;
    let config = sink_config(amqp_url(), &broker.exchange);
    let arbiter = actix_rt::Arbiter::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    assert!(arbiter.spawn(async move {
        let _ = tx.send(RabbitSink::connect(config).await);
    }));
    let sink = rx.await.unwrap().unwrap();
    arbiter.stop();
    arbiter.join().unwrap();

    let published = tokio::time::timeout(Duration::from_secs(10), sink.publish(message(1, "order.created"))).await;
    assert_eq!(published, Ok(Ok(())), "publishing after the creating arbiter stopped");
    assert_eq!(message_id(&broker.take(&queue, 1).await[0]), 1);
    sink.close().await;
}

/// The copies of each message id among `deliveries`.
fn copies_by_id(deliveries: &[Delivery]) -> BTreeMap<i64, usize> {
    let mut copies = BTreeMap::new();
    for d in deliveries {
        *copies.entry(message_id(d)).or_default() += 1;
    }
    copies
}

/// (f) The broker blocks the connection (`connection.blocked`, as under a memory alarm; the
/// proxy plays the broker's part) while 200 publishes wait for their confirms. They wait past
/// the publish timeout and past the lease, kept alive by heartbeats, instead of timing out and
/// going again; nothing new is claimed; when the broker unblocks, every row ends done on its
/// first attempt and the queue holds each message exactly once.
#[actix_rt::test]
async fn a_blocked_broker_is_waited_for_not_timed_out_and_republished() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("blocked").await;
    let proxy = Proxy::start(amqp_addr()).await;
    let sink =
        RabbitSink::connect(sink_config(proxy.amqp_url(), &broker.exchange).unresponsive_after(Duration::from_secs(1)))
            .await
            .unwrap();
    let config = dispatcher_config()
        .workers(2)
        .batch(100)
        .max_attempts(3)
        .lease(Duration::from_secs(4))
        .publish_timeout(Duration::from_secs(1));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();

    let first = seed_with_confirms_held(&db, &broker, &queue, &proxy, 200, "held").await;
    proxy.amqp_block();
    eventually(WITHIN, "the sink says the broker blocked it, and the dispatcher paused", || async {
        let seen = (sink.state(), dispatcher.send(GetMetrics).await.unwrap().sink_outages);
        saw(seen, |(state, outages)| matches!(state, actix_outbox::sink::SinkState::Blocked(_)) && *outages == 1)
    })
    .await;
    let later = db.seed(100, "later").await;
    // Past the publish timeout (1 s) and the lease (4 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.retried, metrics.released, metrics.lost_leases, metrics.dead), (0, 0, 0, 0), "{metrics:?}");
    assert_eq!(db.count_status("processing").await, 200, "the held publishes wait");
    assert_eq!(db.count_status("pending").await, 100, "nothing new is claimed while blocked");

    proxy.amqp_unblock();
    proxy.resume();
    eventually(WITHIN, "all 300 rows done", || async { saw(db.count_status("done").await, |v| *v == 300) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let rows = db.rows().await;
    assert!(rows.iter().all(|r| r.attempts == 1 && r.lease_version == 1), "no row retried or reclaimed");
    assert_eq!(broker.depth(&queue).await, 300, "no duplicates");
    let copies = copies_by_id(&broker.take(&queue, 300).await);
    let expected: BTreeSet<i64> = first.iter().chain(&later).copied().collect();
    assert_eq!(copies.keys().copied().collect::<BTreeSet<_>>(), expected);
    assert!(copies.values().all(|&n| n == 1));
    sink.close().await;
}

/// (g) The broker stops answering mid-run (the proxy holds every byte both ways, new
/// connections included) for six seconds. The sink notices the silence (no confirm for 1 s
/// while publishes wait), reports itself down and rebuilds its link; the dispatcher pauses,
/// refunds the publishes it gave up on, and resumes when the broker answers again: no row
/// dead, no attempt spent, every row delivered, and at most one in-flight window of duplicates.
#[actix_rt::test]
async fn a_silent_broker_is_ridden_out_with_no_attempt_spent() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("silent").await;
    let proxy = Proxy::start(amqp_addr()).await;
    let sink_config = sink_config(proxy.amqp_url(), &broker.exchange)
        .unresponsive_after(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(2));
    let sink = RabbitSink::connect(sink_config).await.unwrap();
    let config = dispatcher_config().workers(2).batch(50).max_attempts(3).publish_timeout(Duration::from_secs(3));
    let window = 2 * config.in_flight_limit();
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();
    let ids = db.seed(2000, "silent").await;
    eventually(WITHIN, "rows flowing", || async { saw(db.count_status("done").await, |v| *v >= 100) }).await;

    proxy.stall();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.retried, metrics.dead), (0, 0), "{metrics:?}");
    proxy.resume();

    eventually(WITHIN, "all 2000 rows done", || async { saw(db.count_status("done").await, |v| *v == 2000) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let rows = db.rows().await;
    let attempts: BTreeSet<i32> = rows.iter().map(|r| r.attempts).collect();
    assert_eq!(attempts, BTreeSet::from([1]), "the silence cost no attempt");
    let depth = broker.depth(&queue).await as usize;
    assert!((2000..=2000 + window).contains(&depth), "{depth} messages: duplicates beyond one window ({window})");
    let copies = copies_by_id(&broker.take(&queue, depth).await);
    assert_eq!(copies.keys().copied().collect::<Vec<_>>(), ids, "every row delivered");
    sink.close().await;
}

/// The AMQP headers of `d`, as a map of name to value.
fn headers_of(d: &Delivery) -> BTreeMap<String, AMQPValue> {
    let table = d.properties.headers().as_ref().expect("headers");
    table.inner().iter().map(|(k, v)| (k.as_str().to_owned(), v.clone())).collect()
}

fn ls(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

/// A producer's headers arrive at a real consumer as long strings, next to the sink's own four;
/// on a clash with a reserved name the sink's value is the one sent.
#[actix_rt::test]
async fn producer_headers_arrive_and_ours_win_a_clash() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("hdrs").await;
    let event = NewEvent::new("order", "o-7", "order.created", serde_json::json!({"n": 1}))
        .header("tenant", "acme")
        .header("correlation-id", "c-17 ü")
        .header("x-outbox-source", "forged")
        .header("x-outbox-id", "forged")
        .header("x-aggregate-id", "forged")
        .header("x-deduplication-header", "forged")
        .header("x-attempt", "99");
    let id = actix_outbox::enqueue(&mut db.conn().await, &event).await.unwrap();
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(WITHIN, "row done", || async { saw(db.row(id).await, |row| row.status == Status::Done) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    let expected = BTreeMap::from([
        ("correlation-id".to_owned(), ls("c-17 ü")),
        ("tenant".to_owned(), ls("acme")),
        ("x-aggregate-id".to_owned(), ls("o-7")),
        ("x-aggregate-type".to_owned(), ls("order")),
        ("x-attempt".to_owned(), AMQPValue::LongInt(1)),
        ("x-outbox-source".to_owned(), ls(&db.source().await)),
    ]);
    assert_eq!(headers_of(&delivered), expected, "the producer's two headers, and ours unchanged");
    assert_eq!(message_id(&delivered), id);
    let stored = db.row(id).await.headers.expect("headers stored");
    assert_eq!(stored["tenant"], "acme", "the row keeps the producer's headers as given: {stored}");
    assert_eq!(stored["x-attempt"], "99", "a reserved name is dropped from the message, not from the row");
}

/// Rows written by plain SQL: without the column (its default), with NULL, and with a
/// hand-written object of non-string values: all publish; the first two carry exactly the
/// sink's four headers, the third its entries stringified, `null` skipped.
#[actix_rt::test]
async fn rows_inserted_with_plain_sql_publish_with_lenient_headers() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("sqlhdrs").await;
    db.conn()
        .await
        .batch_execute(
            r#"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'a', 'order.plain', '{"k": 1}');
               INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES ('order', 'b', 'order.null', '{"k": 2}', NULL);
               INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
                   VALUES ('order', 'c', 'order.mixed', '{"k": 3}', '{"s": "x", "n": 7, "ok": true, "nothing": null, "list": [1, "a"]}');"#,
        )
        .await
        .unwrap();
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    let mut delivered = broker.take(&queue, 3).await;
    delivered.sort_by_key(message_id);
    eventually(WITHIN, "3 rows done", || async { saw(db.count_status("done").await, |v| *v == 3) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    let rows = db.rows().await;
    let ids: Vec<i64> = delivered.iter().map(message_id).collect();
    assert_eq!(ids, rows.iter().map(|r| r.id).collect::<Vec<_>>());
    let source = db.source().await;
    let ours = |agg: &str| {
        BTreeMap::from([
            ("x-aggregate-id".to_owned(), ls(agg)),
            ("x-aggregate-type".to_owned(), ls("order")),
            ("x-attempt".to_owned(), AMQPValue::LongInt(1)),
            ("x-outbox-source".to_owned(), ls(&source)),
        ])
    };
    assert_eq!(headers_of(&delivered[0]), ours("a"), "the column's default: the four headers");
    assert_eq!(headers_of(&delivered[1]), ours("b"), "NULL: the four headers");
    let mut mixed = ours("c");
    mixed.extend([
        ("s".to_owned(), ls("x")),
        ("n".to_owned(), ls("7")),
        ("ok".to_owned(), ls("true")),
        ("list".to_owned(), ls(r#"[1,"a"]"#)),
    ]);
    assert_eq!(headers_of(&delivered[2]), mixed, "non-strings as JSON text, null skipped");
    let bodies: Vec<serde_json::Value> = delivered.iter().map(|d| serde_json::from_slice(&d.data).unwrap()).collect();
    assert_eq!(bodies, [serde_json::json!({"k": 1}), serde_json::json!({"k": 2}), serde_json::json!({"k": 3})]);
}

/// With `outbox_headers(false)` a row without producer headers goes with no header table at
/// all, and one with producer headers carries those alone; every property stays.
#[actix_rt::test]
async fn without_outbox_headers_only_the_producers_headers_travel() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("lean").await;
    let plain = NewEvent::new("order", "o-1", "order.created", serde_json::json!({"n": 1}));
    let tagged = NewEvent::new("order", "o-2", "order.created", serde_json::json!({"n": 2})).header("tenant", "acme");
    let ids = actix_outbox::enqueue_many(&mut db.conn().await, &[plain, tagged]).await.unwrap();
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange).outbox_headers(false)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    let mut delivered = broker.take(&queue, 2).await;
    delivered.sort_by_key(message_id);
    eventually(WITHIN, "2 rows done", || async { saw(db.count_status("done").await, |v| *v == 2) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    assert_eq!(delivered.iter().map(message_id).collect::<Vec<_>>(), ids);
    assert_eq!(*delivered[0].properties.headers(), None, "no producer header: no table");
    assert_eq!(headers_of(&delivered[1]), BTreeMap::from([("tenant".to_owned(), ls("acme"))]));
    for d in &delivered {
        let p = &d.properties;
        assert_eq!(*p.delivery_mode(), Some(2), "persistent");
        assert_eq!(p.kind().as_ref().map(ShortString::as_str), Some("order.created"));
        assert_eq!(p.content_type().as_ref().map(ShortString::as_str), Some("application/json"));
        assert_eq!(p.app_id().as_ref().map(ShortString::as_str), Some("actix-outbox"));
        assert!(p.timestamp().is_some());
    }
}

/// `deduplication_header(true)` adds `x-deduplication-header` = `<source>/<id>`, with the source
/// a dispatcher was given by hand, for RabbitMQ's message-deduplication plugin; it is absent
/// by default (every test above).
#[actix_rt::test]
async fn the_deduplication_header_is_opt_in_and_names_the_source() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("dedup").await;
    let event = NewEvent::new("order", "o-1", "order.created", serde_json::json!({"n": 1}));
    let id = actix_outbox::enqueue(&mut db.conn().await, &event).await.unwrap();
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange).deduplication_header(true)).await.unwrap();
    let config = dispatcher_config().source("shop-eu");
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();

    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(WITHIN, "row done", || async { saw(db.row(id).await, |row| row.status == Status::Done) }).await;
    let health = dispatcher.send(actix_outbox::dispatcher::GetHealth).await.unwrap();
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    assert_eq!(health.source.as_deref(), Some("shop-eu"));
    assert_eq!(message_id(&delivered), id);
    assert_eq!(long_string(header(&delivered, wire::SOURCE)), "shop-eu", "the configured source wins");
    assert_eq!(long_string(header(&delivered, wire::DEDUPLICATION)), format!("shop-eu/{id}"));
    assert_eq!(headers_of(&delivered).len(), 5);
}

/// A header name AMQP cannot carry (256 bytes) fails its message permanently, with a reason that
/// names the header, while the next message flows.
#[actix_rt::test]
async fn a_header_name_over_255_bytes_fails_the_message_permanently() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("longhdr").await;
    let mut conn = db.conn().await;
    let bad = NewEvent::new("order", "o-1", "order.created", serde_json::json!({})).header("h".repeat(256), "v");
    let bad = actix_outbox::enqueue(&mut conn, &bad).await.unwrap();
    let good = NewEvent::new("order", "o-2", "order.created", serde_json::json!({})).header("h".repeat(255), "v");
    let good = actix_outbox::enqueue(&mut conn, &good).await.unwrap();
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    eventually(WITHIN, "bad row dead", || async { saw(db.row(bad).await, |row| row.status == Status::Dead) }).await;
    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(WITHIN, "good row done", || async { saw(db.row(good).await, |row| row.status == Status::Done) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;

    assert_eq!(message_id(&delivered), good);
    assert_eq!(long_string(header(&delivered, &"h".repeat(255))), "v");
    let row = db.row(bad).await;
    assert_eq!(row.attempts, 1, "permanent: one attempt");
    assert_eq!(
        row.last_error.as_deref(),
        Some(r#"permanent: header name "hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh..." is 256 bytes long; AMQP allows 255"#)
    );
}

/// Headers too large for the AMQP content header (which must fit one frame; the broker closes
/// the connection otherwise) fail their message permanently instead of cutting the link again
/// and again; headers at the bound go through.
#[actix_rt::test]
async fn headers_too_large_for_a_frame_fail_the_message_permanently() {
    use actix_outbox::wire::MAX_PRODUCER_HEADER_BYTES;
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("bighdr").await;
    let mut conn = db.conn().await;
    // One entry of name `big` takes 1 + 3 + 1 + 4 bytes besides its value.
    let fits = "v".repeat(MAX_PRODUCER_HEADER_BYTES - 9);
    let bad = NewEvent::new("order", "o-1", "order.created", serde_json::json!({})).header("big", format!("{fits}v"));
    let bad = actix_outbox::enqueue(&mut conn, &bad).await.unwrap();
    let good = NewEvent::new("order", "o-2", "order.created", serde_json::json!({})).header("big", fits.clone());
    let good = actix_outbox::enqueue(&mut conn, &good).await.unwrap();
    let sink = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange)).await.unwrap();
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();

    eventually(WITHIN, "bad row dead", || async { saw(db.row(bad).await, |row| row.status == Status::Dead) }).await;
    let delivered = broker.take(&queue, 1).await.pop().unwrap();
    eventually(WITHIN, "good row done", || async { saw(db.row(good).await, |row| row.status == Status::Done) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    assert_eq!(sink.reconnects(), 0, "the link was never cut");
    sink.close().await;

    assert_eq!((message_id(&delivered), long_string(header(&delivered, "big"))), (good, fits));
    let row = db.row(bad).await;
    assert_eq!(row.attempts, 1);
    assert_eq!(
        row.last_error,
        Some(format!(
            "permanent: the producer's headers take {} bytes encoded; at most {MAX_PRODUCER_HEADER_BYTES} fit the AMQP content header",
            MAX_PRODUCER_HEADER_BYTES + 1
        ))
    );
}

/// A cluster's nodes are tried in turn: the first node is down, so the sink connects to the
/// second; when that link is cut, it reconnects (moving on through the list) and goes on.
#[actix_rt::test]
async fn a_cluster_sink_moves_to_the_next_node() {
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("cluster").await;
    let down = Proxy::start(amqp_addr()).await;
    down.refuse(true);
    let up = Proxy::start(amqp_addr()).await;
    let config = RabbitConfig::cluster([down.amqp_url(), up.amqp_url()])
        .exchange(&broker.exchange)
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(200));
    let sink = RabbitSink::connect(config).await.expect("the second node answers");
    let dispatcher = OutboxSupervisor::start(dispatcher_config(), db.pool.clone(), sink.clone()).unwrap();
    db.seed(50, "first").await;
    eventually(WITHIN, "50 rows done through the second node", || async {
        saw(db.count_status("done").await, |v| *v == 50)
    })
    .await;
    up.sever();
    db.seed(50, "second").await;
    eventually(WITHIN, "100 rows done after reconnecting", || async {
        saw(db.count_status("done").await, |v| *v == 100)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    assert!(sink.reconnects() >= 1);
    assert!(broker.depth(&queue).await >= 100);
    sink.close().await;
}

/// Holds the broker's confirms back (the proxy stalls broker -> client) and writes `n` rows;
/// returns their ids once the broker has every one and all are processing.
async fn seed_with_confirms_held(
    db: &TestDb,
    broker: &TestBroker,
    queue: &str,
    proxy: &Proxy,
    n: usize,
    tag: &str,
) -> Vec<i64> {
    proxy.stall_downstream();
    let ids = db.seed(n, tag).await;
    eventually(WITHIN, &format!("the broker holds all {n} while their confirms are held back"), || async {
        let seen = (broker.depth(queue).await as usize, db.count_status("processing").await as usize);
        saw(seen, |&(queued, processing)| queued == n && processing == n)
    })
    .await;
    ids
}
