//! Queues the RabbitMQ sink declares and binds itself (`RabbitConfig::bind_queue`), against the
//! real broker: messages land in them, their type is the one asked for, a queue that exists
//! otherwise is refused with the fix in words, and a queue deleted while the link was down is
//! declared again on reconnecting. Every test has its own exchange and queues, deleted at the
//! end.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{QueueKind, RabbitConfig, RabbitError, RabbitSink};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, Publisher};
use lapin::message::Delivery;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

use crate::proxy::Proxy;
use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_addr, amqp_url, eventually, saw, unique};

const WITHIN: Duration = PATIENCE;

fn sink_config(url: String, exchange: &str) -> RabbitConfig {
    RabbitConfig::new(url).exchange(exchange).reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

fn message_id(d: &Delivery) -> i64 {
    d.properties.message_id().as_ref().expect("message_id").as_str().parse().expect("decimal message_id")
}

/// A fresh queue name, deleted when `broker` is dropped.
fn queue_of(broker: &mut TestBroker) -> String {
    let queue = unique("bound");
    broker.remove_queue_at_end(queue.clone());
    queue
}

/// Declares `queue` durable with `x-queue-type` = `kind` (`None`: no arguments, as most clients
/// do), or only checks that it exists (`passive`), on a connection of its own: a refusal closes
/// the channel. The broker's refusal as text.
async fn declare(queue: &str, kind: Option<&str>, passive: bool) -> Result<(), String> {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await.unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut arguments = FieldTable::default();
    if let Some(kind) = kind {
        arguments.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
    }
    let options = QueueDeclareOptions { durable: true, passive, ..QueueDeclareOptions::default() };
    let declared = channel.queue_declare(queue.into(), options, arguments).await.map(drop).map_err(|e| e.to_string());
    let _ = conn.close(200, "checked".into()).await;
    declared
}

/// (1) A sink that binds a queue for two patterns: the messages of both land in it, exactly,
/// and their rows are done; a message of a third routing key still has nowhere to go and dies.
#[actix_rt::test]
async fn messages_land_in_the_queue_the_sink_binds_and_their_rows_are_done() {
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("bind").await;
    let queue = queue_of(&mut broker);
    let (bound, lost) = {
        let mut conn = db.conn().await;
        let mut bound = BTreeSet::new();
        for kind in ["order.created", "refund.issued", "order.paid"] {
            let event = NewEvent::new("order", "o-1", kind, serde_json::json!({ "kind": kind }));
            bound.insert(actix_outbox::enqueue(&mut conn, &event).await.unwrap());
        }
        let event = NewEvent::new("order", "o-2", "invoice.sent", serde_json::json!({}));
        (bound, actix_outbox::enqueue(&mut conn, &event).await.unwrap())
    };
    let config = sink_config(amqp_url(), &broker.exchange).bind_queue(&queue, "order.#").bind_queue(&queue, "refund.*");
    let sink = RabbitSink::connect(config).await.unwrap();
    let dispatcher = OutboxSupervisor::start(
        DispatcherConfig::default().poll_interval(Duration::from_millis(50)),
        db.pool.clone(),
        sink.clone(),
    )
    .unwrap();

    eventually(WITHIN, "3 done and 1 dead", || async {
        let counts = (db.count_status("done").await, db.count_status("dead").await);
        saw(counts, |&(done, dead)| done == 3 && dead == 1)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();
    let delivered: BTreeSet<i64> = broker.take(&queue, 3).await.iter().map(message_id).collect();
    assert_eq!(delivered, bound);
    for id in &bound {
        assert_eq!(db.row(*id).await.status, Status::Done, "row {id}");
    }
    assert_eq!(db.row(lost).await.status, Status::Dead, "no queue is bound for invoice.sent");
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.done, m.dead), (3, 1));
    sink.close().await;
}

/// (2) A bound queue is quorum unless classic is asked for: each exists once the sink is
/// connected, and redeclaring it as the other type is refused by the broker.
#[tokio::test]
async fn bound_queues_are_quorum_by_default_and_classic_when_asked() {
    let mut broker = TestBroker::new("kinds").await;
    let (quorum, classic) = (queue_of(&mut broker), queue_of(&mut broker));
    let config = sink_config(amqp_url(), &broker.exchange).bind_queue(&quorum, "a.#").bind_queue_with(
        &classic,
        "b.#",
        QueueKind::Classic,
    );
    let sink = RabbitSink::connect(config).await.unwrap();

    declare(&quorum, None, true).await.expect("the quorum queue exists");
    declare(&classic, None, true).await.expect("the classic queue exists");
    declare(&quorum, Some("quorum"), false).await.expect("quorum as declared");
    let e = declare(&quorum, Some("classic"), false).await.unwrap_err();
    assert!(e.contains("PRECONDITION") && e.contains("x-queue-type"), "{e}");
    declare(&classic, Some("classic"), false).await.expect("classic as declared");
    let e = declare(&classic, Some("quorum"), false).await.unwrap_err();
    assert!(e.contains("PRECONDITION") && e.contains("x-queue-type"), "{e}");
    sink.close().await;
}

/// (3) A queue that exists as another type (a classic queue declared by another client, with
/// no arguments) fails the connection with an error that names the queue, what differs and
/// the fix; following the fix (binding it as classic) connects and delivers.
#[tokio::test]
async fn a_queue_that_exists_as_another_type_is_refused_with_the_fix() {
    let mut broker = TestBroker::new("conflict").await;
    let queue = queue_of(&mut broker);
    declare(&queue, None, false).await.unwrap();

    let err = RabbitSink::connect(sink_config(amqp_url(), &broker.exchange).bind_queue(&queue, "#")).await.unwrap_err();
    assert!(matches!(err, RabbitError::Refused { .. }) && !err.is_transient(), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&format!("queue {queue:?} already exists with other arguments")), "{text}");
    assert!(text.contains("x-queue-type"), "the broker's reply says what differs: {text}");
    assert!(text.contains("bind it as a classic queue") && text.contains("delete_queue"), "{text}");

    let config = sink_config(amqp_url(), &broker.exchange).bind_queue_with(&queue, "#", QueueKind::Classic);
    let sink = RabbitSink::connect(config).await.expect("bound as the classic queue it is");
    let message = OutboxMessage::new(5, "order", "o-5", "order.created", serde_json::value::to_raw_value(&1).unwrap());
    sink.publish(Arc::new(message)).await.expect("routed to the existing queue");
    assert_eq!(message_id(&broker.take(&queue, 1).await[0]), 5);
    sink.close().await;
}

/// (4) The queue is deleted while the link is down: the sink declares and binds it again when
/// it reconnects, so the next message is routed instead of dying unroutable.
#[tokio::test]
async fn a_queue_deleted_while_the_link_is_down_is_declared_again_on_reconnecting() {
    let mut broker = TestBroker::new("rebind").await;
    let queue = queue_of(&mut broker);
    let proxy = Proxy::start(amqp_addr()).await;
    let sink = RabbitSink::connect(sink_config(proxy.amqp_url(), &broker.exchange).bind_queue(&queue, "order.#"))
        .await
        .unwrap();

    proxy.refuse(true);
    proxy.sever();
    eventually(WITHIN, "the sink sees the link down", || async { saw(sink.state(), |_| !sink.is_connected()) }).await;
    broker.channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    declare(&queue, None, true).await.expect_err("the queue is gone");
    proxy.refuse(false);
    eventually(WITHIN, "the sink reconnects", || async { saw(sink.state(), |_| sink.is_connected()) }).await;
    assert!(sink.reconnects() >= 1);

    let payload = serde_json::value::to_raw_value(&7).unwrap();
    sink.publish(Arc::new(OutboxMessage::new(7, "order", "o-7", "order.created", payload)))
        .await
        .expect("routed to the queue declared again");
    assert_eq!(message_id(&broker.take(&queue, 1).await[0]), 7);
    sink.close().await;
}
