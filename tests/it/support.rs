//! Test fixtures, shared by the library's integration tests and the command line's
//! (`cli/tests/cli.rs` includes this file with `#[path]`): databases, brokers, and helpers to
//! read rows back.
//!
//! Two environment variables say where the services are:
//!
//! - `TEST_DATABASE_URL`: the PostgreSQL server, as a URL or a `key=value` connection string;
//!   default `postgres://root@127.0.0.1:5432/test`. Its own database is never touched: each test
//!   creates a database of its own on that server (through the server's `postgres` database,
//!   with every other option of the string), so the role must be allowed to create databases.
//! - `TEST_AMQP_URL`: the RabbitMQ broker; default `amqp://guest:guest@127.0.0.1:5672/%2f`.
//!   Each test declares exchanges and queues of its own, uniquely named.
//!
//! Everything a test creates is removed when its fixture is dropped, even by a panic.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use actix_outbox::schema::outbox;
use actix_outbox::{ConnectionString, NewEvent, OutboxRow, PgPool};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

/// How long a fixture waits for messages to arrive.
const WAIT: Duration = Duration::from_secs(60);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// `outbox_it.<what>.<pid>.<n>.<random>`: unique across tests and concurrent runs.
pub fn unique(what: &str) -> String {
    format!("outbox_it.{what}.{}.{}.{:08x}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed), rand_suffix())
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

/// The test server (`TEST_DATABASE_URL`).
fn server() -> ConnectionString {
    let url = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    ConnectionString::parse(&url).unwrap_or_else(|e| panic!("TEST_DATABASE_URL: {e}"))
}

/// `host:port` of the test server over TCP, for a proxy in front of it.
pub fn database_addr() -> String {
    let url = std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let config: tokio_postgres::Config = url.parse().expect("TEST_DATABASE_URL parses");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    format!("{host}:{}", config.get_ports().first().copied().unwrap_or(5432))
}

/// The connection string of database `name` on the test server.
pub fn database_url(name: &str) -> String {
    server().with_database(name).expose().to_owned()
}

/// A uniquely named database on the test server, not created here, dropped (if it exists by
/// then) when this is.
pub struct ScratchDb {
    pub name: String,
    pub url: String,
}

impl ScratchDb {
    pub fn new() -> Self {
        let name = unique("db").replace('.', "_");
        ScratchDb { url: database_url(&name), name }
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        // Drop runs inside the test's runtime (maybe while it unwinds): clean up on a thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(mut admin) = AsyncPgConnection::establish(&database_url("postgres")).await {
                    let _ = admin.batch_execute(&sql).await;
                }
            });
        })
        .join();
    }
}

/// A uniquely named, migrated database with a pool, dropped when the test ends.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
    _scratch: ScratchDb,
}

impl TestDb {
    pub async fn new() -> Self {
        let scratch = ScratchDb::new();
        let mut admin = AsyncPgConnection::establish(&database_url("postgres"))
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432 (see README)");
        admin.batch_execute(&format!("CREATE DATABASE {}", scratch.name)).await.expect("create test database");
        actix_outbox::migrate(&scratch.url).await.expect("migrate test database");
        let pool = actix_outbox::connect_pool(&scratch.url, 16).await.expect("pool");
        TestDb { name: scratch.name.clone(), url: scratch.url.clone(), pool, _scratch: scratch }
    }

    /// The source name a dispatcher derives for this database (`x-outbox-source`).
    pub async fn source(&self) -> String {
        let source = actix_outbox::admin::outbox_source(&mut self.conn().await).await.unwrap();
        let (system, rest) = source.split_once('/').expect("system identifier first");
        assert!(system.parse::<u64>().is_ok(), "a decimal system identifier: {source}");
        assert_eq!(rest, format!("{}/public.outbox", self.name), "then the database and the table");
        source
    }

    pub async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.url).await.expect("connect to test database")
    }

    /// Inserts `n` events of aggregate `agg`, returning their ids.
    pub async fn seed(&self, n: usize, agg: &str) -> Vec<i64> {
        let events: Vec<_> =
            (0..n).map(|i| NewEvent::new("test", agg, "test.happened", serde_json::json!({"n": i}))).collect();
        let mut conn = self.conn().await;
        let mut ids = Vec::new();
        for chunk in events.chunks(1000) {
            ids.extend(actix_outbox::enqueue_many(&mut conn, chunk).await.expect("seed"));
        }
        ids
    }

    pub async fn row(&self, id: i64) -> OutboxRow {
        let mut conn = self.conn().await;
        outbox::table.find(id).select(OutboxRow::as_select()).first(&mut conn).await.expect("row")
    }

    pub async fn rows(&self) -> Vec<OutboxRow> {
        let mut conn = self.conn().await;
        outbox::table.order(outbox::id).select(OutboxRow::as_select()).load(&mut conn).await.expect("rows")
    }

    pub async fn count_status(&self, status: &str) -> i64 {
        let mut conn = self.conn().await;
        outbox::table.filter(outbox::status.eq(status)).count().get_result(&mut conn).await.expect("count")
    }

    /// Makes every pending row claimable now (skips a backoff or deferral).
    pub async fn make_available(&self) {
        let mut conn = self.conn().await;
        conn.batch_execute("UPDATE outbox SET available_at = now() WHERE status = 'pending'").await.unwrap();
    }
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    (h.finish() & 0xffff_ffff) as u32
}

/// Polls `check` until it returns true, failing the test after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ

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
    #[allow(dead_code)] // used by the inbox tests only
    pub fn remove_at_end(&mut self, queue: String, exchange: String) {
        self.queues.push(queue);
        self.exchanges.push(exchange);
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
    #[allow(dead_code)] // used by cli/tests/cli.rs only
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
