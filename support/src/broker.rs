//! RabbitMQ: the test broker (`TEST_AMQP_URL`) and a test's own exchange and queues on it.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use crate::unique;

/// How long a fixture waits for messages to arrive.
const WAIT: Duration = Duration::from_secs(60);

/// The test broker (`TEST_AMQP_URL`).
pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `host:port` of [`amqp_url`], for a proxy to forward to.
pub fn amqp_addr() -> String {
    let url = amqp_url();
    let after_at = url.rsplit('@').next().unwrap().trim_start_matches("amqp://");
    after_at.split('/').next().unwrap().to_owned()
}

/// The test's own view of the broker: a direct connection, the test's exchange and queues, and
/// their removal when the test ends.
pub struct TestBroker {
    conn: Connection,
    /// A channel of the test's own, to declare, consume and inspect with.
    pub channel: Channel,
    /// The test's exchange (declared by the sink, or by [`TestBroker::declare`]).
    pub exchange: String,
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl TestBroker {
    /// Connects and names a fresh exchange, tagged `tag`.
    pub async fn new(tag: &str) -> TestBroker {
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("RabbitMQ must be running on 127.0.0.1:5672 (rabbitmq-server -detached)");
        let channel = conn.create_channel().await.unwrap();
        let exchange = unique(tag);
        TestBroker { conn, channel, exchanges: vec![exchange.clone()], exchange, queues: Vec::new() }
    }

    /// A fresh exchange declared as the sink declares it (durable topic), with one queue bound
    /// to every routing key: the broker and the queue's name.
    pub async fn with_queue(tag: &str) -> (TestBroker, String) {
        let mut broker = TestBroker::new(tag).await;
        broker.declare(ExchangeKind::Topic).await;
        let queue = broker.queue(&["#"], FieldTable::default()).await;
        (broker, queue)
    }

    /// Declares the test's exchange as the sink would (durable), so that queues can be bound
    /// before the sink connects.
    pub async fn declare(&self, kind: ExchangeKind) {
        let options = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        self.channel
            .exchange_declare(self.exchange.as_str().into(), kind, options, FieldTable::default())
            .await
            .unwrap();
    }

    /// A new durable queue bound to the exchange with each of `keys`.
    pub async fn queue(&mut self, keys: &[&str], mut arguments: FieldTable) -> String {
        let name = unique("q");
        // A safety net for a test killed before its cleanup: the broker drops the queue itself.
        arguments.insert("x-expires".into(), AMQPValue::LongInt(300_000));
        let options = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        self.channel.queue_declare(name.as_str().into(), options, arguments).await.unwrap();
        for key in keys {
            self.channel
                .queue_bind(
                    name.as_str().into(),
                    self.exchange.as_str().into(),
                    (*key).into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        self.queues.push(name.clone());
        name
    }

    /// Deletes these queues and exchanges too when the test ends: ones that the component under
    /// test declares itself.
    pub fn remove_at_end(&mut self, queue: String, exchange: String) {
        self.queues.push(queue);
        self.exchanges.push(exchange);
    }

    /// Deletes `queue` too when the test ends: one that the component under test declares
    /// itself on the test's exchange.
    pub fn remove_queue_at_end(&mut self, queue: String) {
        self.queues.push(queue);
    }

    /// Messages ready in `queue`.
    pub async fn depth(&self, queue: &str) -> u32 {
        let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        self.channel.queue_declare(queue.into(), options, FieldTable::default()).await.unwrap().message_count()
    }

    /// Consumes exactly `n` messages from `queue` and checks that nothing else is left in it.
    pub async fn take(&self, queue: &str, n: usize) -> Vec<Delivery> {
        let channel = self.conn.create_channel().await.unwrap();
        let options = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
        let mut consumer = channel
            .basic_consume(queue.into(), unique("c").as_str().into(), options, FieldTable::default())
            .await
            .unwrap();
        let mut out = Vec::with_capacity(n);
        tokio::time::timeout(WAIT, async {
            while out.len() < n {
                out.push(consumer.next().await.expect("consumer ended").expect("delivery"));
            }
        })
        .await
        .unwrap_or_else(|_| panic!("only {} of {n} messages arrived on {queue}", out.len()));
        channel.close(200, "done".into()).await.unwrap();
        assert_eq!(self.depth(queue).await, 0, "more than {n} messages on {queue}");
        out
    }

    /// The `message_id` of every message in `queue`, waiting until `at_least` have arrived
    /// (duplicates included).
    pub async fn message_ids(&self, queue: &str, at_least: usize) -> Vec<i64> {
        let no_ack = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
        let mut consumer = self
            .channel
            .basic_consume(queue.into(), unique("c").as_str().into(), no_ack, FieldTable::default())
            .await
            .unwrap();
        let mut ids = Vec::new();
        let deadline = Instant::now() + WAIT;
        while ids.len() < at_least {
            let left = deadline.saturating_duration_since(Instant::now());
            let delivery = tokio::time::timeout(left, consumer.next())
                .await
                .unwrap_or_else(|_| panic!("only {} of {at_least} messages arrived", ids.len()))
                .expect("consumer open")
                .expect("delivery");
            let id = delivery.properties.message_id().as_ref().expect("message_id set").as_str().parse().unwrap();
            ids.push(id);
        }
        ids
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        let (queues, exchanges) = (std::mem::take(&mut self.queues), std::mem::take(&mut self.exchanges));
        // Drop runs inside the test's runtime (maybe while it unwinds): clean up on a thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let Ok(conn) = Connection::connect(&amqp_url(), ConnectionProperties::default()).await else { return };
                let Ok(channel) = conn.create_channel().await else { return };
                for q in queues {
                    let _ = channel.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
                }
                for x in exchanges {
                    let _ = channel.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default()).await;
                }
                let _ = conn.close(200, "cleanup".into()).await;
            });
        })
        .join();
    }
}
