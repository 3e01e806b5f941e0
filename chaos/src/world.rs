//! The run's own database, exchange and queue; the producer that commits rows into it and the
//! consumer that records every delivery; and what the end of the run reads back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_outbox::{NewEvent, StoreError};
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::{mpsc, watch};

use crate::plan::{Kind, Rng};

/// The PostgreSQL server (trust authentication, as on the service machines).
pub const SERVER: &str = "postgres://root@127.0.0.1:5432";
/// The RabbitMQ broker (without `--cluster`).
pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Where the run's queue lives: the shared broker, or node 0 of the run's own cluster.
#[derive(Debug, Clone)]
pub struct Broker {
    /// The node the run declares on, consumes from and cleans up on.
    pub url: String,
    /// A quorum queue (on a cluster) rather than a classic one.
    pub quorum: bool,
}

impl Default for Broker {
    fn default() -> Self {
        Broker { url: AMQP.to_owned(), quorum: false }
    }
}

/// Routing keys the queue is bound to; a poison row's `poison.*` key matches none of them.
const BINDING: &str = "chaos.#";

/// The fencing audit, installed in the run's database only. Fencing promises that a write
/// after a claim lands only for the holder of the row's current `lease_version`; the row's
/// `lease_owner` names that holder. So a write that leaves a `processing` row at its version
/// (a finalize or a heartbeat; claims, the reaper and hand-backs move the version) must come
/// from the process whose name `lease_owner` carries. Each process's connections carry that
/// name as their `application_name`; a write from any other is recorded here as a stale write.
/// A write that leaves the row's state as it was (its status, lease, attempts and last error)
/// is not one: the sweep moves a new row whose lease expired into `outbox_later` by its
/// `available_at` alone, for the next claim to take over, and its holder may still finish it.
const AUDIT_SQL: &str = r#"
CREATE TABLE chaos_stale_writes (
    id bigint NOT NULL,
    old_status text NOT NULL,
    new_status text NOT NULL,
    lease_version bigint NOT NULL,
    lease_owner text,
    writer text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION chaos_stale_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF position(current_setting('application_name') || ':' IN coalesce(OLD.lease_owner, '')) <> 1 THEN
        INSERT INTO chaos_stale_writes (id, old_status, new_status, lease_version, lease_owner, writer)
        VALUES (OLD.id, OLD.status, NEW.status, OLD.lease_version, OLD.lease_owner,
                current_setting('application_name'));
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER chaos_stale_write AFTER UPDATE ON outbox FOR EACH ROW
    WHEN (OLD.status = 'processing' AND NEW.lease_version = OLD.lease_version
          AND (NEW.status, NEW.lease_owner, NEW.lease_until, NEW.attempts, NEW.last_error)
              IS DISTINCT FROM (OLD.status, OLD.lease_owner, OLD.lease_until, OLD.attempts, OLD.last_error))
    EXECUTE FUNCTION chaos_stale_write();
"#;

/// The run's database and broker objects, uniquely named; [`World::remove`] deletes them.
pub struct World {
    /// Database name.
    pub database: String,
    /// The database's URL, direct.
    pub url: String,
    /// Exchange the dispatchers publish to.
    pub exchange: String,
    /// The consumer's queue.
    pub queue: String,
    /// Where the queue lives.
    pub broker: Broker,
    amqp: Connection,
}

impl World {
    /// Creates and migrates the database, installs the audit, declares exchange and queue on
    /// `broker`.
    pub async fn create(tag: &str, broker: Broker) -> Result<World, String> {
        let database = format!("chaos_{tag}");
        let mut admin = AsyncPgConnection::establish(&format!("{SERVER}/postgres"))
            .await
            .map_err(|e| format!("PostgreSQL must be running on 127.0.0.1:5432 (user root, trust): {e}"))?;
        admin.batch_execute(&format!("CREATE DATABASE {database}")).await.map_err(|e| format!("create db: {e}"))?;
        let url = format!("{SERVER}/{database}");
        actix_outbox::migrate(&url).await.map_err(|e| format!("migrate: {e}"))?;
        let mut conn = actix_outbox::admin::connect(&url).await.map_err(|e| e.to_string())?;
        conn.batch_execute(AUDIT_SQL).await.map_err(|e| format!("install the audit: {e}"))?;

        let amqp = Connection::connect(&broker.url, ConnectionProperties::default())
            .await
            .map_err(|e| format!("RabbitMQ must be running on 127.0.0.1:5672 (guest/guest): {e}"))?;
        let channel = amqp.create_channel().await.map_err(|e| e.to_string())?;
        let exchange = format!("actix_outbox_chaos.{tag}");
        let queue = format!("actix_outbox_chaos.{tag}.deliveries");
        let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        channel
            .exchange_declare(exchange.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
            .await
            .map_err(|e| e.to_string())?;
        let mut arguments = FieldTable::default();
        // A safety net for a run killed before its cleanup: the broker drops the queue itself.
        arguments.insert("x-expires".into(), AMQPValue::LongInt(3_600_000));
        // A cap with reject-publish, as teams cap a queue whose consumer may fall behind: the
        // consumer keeps it near empty, and a full queue (its consumer stopped) nacks.
        arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(crate::plan::QUEUE_LIMIT));
        arguments.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
        if broker.quorum {
            arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
        }
        let options = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        channel.queue_declare(queue.as_str().into(), options, arguments).await.map_err(|e| e.to_string())?;
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                BINDING.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok(World { database, url, exchange, queue, broker, amqp })
    }

    /// Deletes the queue, the exchange and the database.
    pub async fn remove(&self) {
        if let Ok(channel) = self.amqp.create_channel().await {
            let _ = channel.queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default()).await;
            let _ = channel.exchange_delete(self.exchange.as_str().into(), ExchangeDeleteOptions::default()).await;
        }
        let _ = self.amqp.close(200, "chaos run over".into()).await;
        if let Ok(mut admin) = AsyncPgConnection::establish(&format!("{SERVER}/postgres")).await {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.database)).await;
        }
    }
}

/// What the producer committed, rolled back, or cannot tell.
#[derive(Debug, Default)]
pub struct Produced {
    /// Committed rows, not poison.
    pub committed: Vec<i64>,
    /// Committed poison rows, with the fault's index.
    pub poison: Vec<(i64, usize)>,
    /// Rows of rolled-back transactions: they must never be delivered.
    pub rolled_back: Vec<i64>,
    /// Rows of transactions whose commit failed: either way is right for them.
    pub uncertain: Vec<i64>,
    /// Single-row and batch transactions committed.
    pub transactions: (u64, u64),
}

/// What the fault runner asks the producer for, besides its steady rate.
#[derive(Debug, Clone, Copy)]
pub enum Request {
    /// A poison row of this kind, for the fault with this index.
    Poison(Kind, usize),
    /// This many rows in one transaction, just before a process fault, so that the fault hits
    /// a full in-flight window rather than an idle process.
    Burst(u64),
}

/// The connection string of the tool's own sessions: named, so that the fencing audit can
/// tell them from the dispatchers'.
pub fn tool_url(url: &str) -> String {
    format!("{url}?application_name=chaos-tool")
}

enum TxError {
    Db(diesel::result::Error),
    Store(StoreError),
    Rollback,
}

impl From<diesel::result::Error> for TxError {
    fn from(e: diesel::result::Error) -> Self {
        TxError::Db(e)
    }
}

/// Commits `rate` transactions a second until `stop` turns true: mostly single rows, some
/// batches of 2 to 8, one in twenty rolled back; poison rows when asked.
pub async fn produce(
    url: String,
    seed: u64,
    rate: u32,
    aggregates: u64,
    fifo: bool,
    mut requests: mpsc::UnboundedReceiver<Request>,
    mut stop: watch::Receiver<bool>,
) -> Result<Produced, String> {
    let mut rng = Rng::new(seed, 2);
    let url = tool_url(&url);
    let mut conn = actix_outbox::admin::connect(&url).await.map_err(|e| e.to_string())?;
    let mut out = Produced::default();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0_u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        let request = requests.try_recv().ok();
        let row = |rng: &mut Rng, seq: &mut u64| {
            *seq += 1;
            let agg = rng.below(0, aggregates);
            let kind = if rng.chance(0.5) { "chaos.created" } else { "chaos.updated" };
            NewEvent::new("acct", agg.to_string(), kind, serde_json::json!({"seq": *seq, "agg": agg}))
        };
        let (events, rollback, poisoned) = if let Some(Request::Poison(kind, fault)) = request {
            seq += 1;
            let event = match kind {
                Kind::PoisonUnroutable => {
                    NewEvent::new("poison", format!("u{seq}"), "poison.unroutable", serde_json::json!({"seq": seq}))
                }
                _ => NewEvent::new("poison", format!("h{seq}"), "chaos.poison", serde_json::json!({"seq": seq}))
                    .header("x".repeat(300), "a header name AMQP cannot carry"),
            };
            (vec![event], false, Some(fault))
        } else if let Some(Request::Burst(n)) = request {
            ((0..n).map(|_| row(&mut rng, &mut seq)).collect(), false, None)
        } else {
            let n = if rng.chance(0.35) { rng.below(2, 9) } else { 1 };
            let rollback = rng.chance(0.05);
            ((0..n).map(|_| row(&mut rng, &mut seq)).collect::<Vec<_>>(), rollback, None)
        };
        let single = events.len() == 1;
        let written = Arc::new(Mutex::new(Vec::new()));
        let result = conn
            .transaction::<(), TxError, _>({
                let written = written.clone();
                async move |tx| {
                    let ids = if fifo {
                        // In id order per aggregate, so that the gate sees the heads it should.
                        let mut ids = Vec::with_capacity(events.len());
                        for e in &events {
                            ids.push(actix_outbox::enqueue_ordered(tx, e).await.map_err(TxError::Store)?);
                        }
                        ids
                    } else if single {
                        vec![actix_outbox::enqueue(tx, &events[0]).await.map_err(TxError::Store)?]
                    } else {
                        actix_outbox::enqueue_many(tx, &events).await.map_err(TxError::Store)?
                    };
                    written.lock().unwrap_or_else(|e| e.into_inner()).extend(ids);
                    if rollback { Err(TxError::Rollback) } else { Ok(()) }
                }
            })
            .await;
        let ids = std::mem::take(&mut *written.lock().unwrap_or_else(|e| e.into_inner()));
        match result {
            Ok(()) => {
                if let Some(fault) = poisoned {
                    out.poison.extend(ids.iter().map(|&id| (id, fault)));
                } else {
                    out.committed.extend(&ids);
                    if single {
                        out.transactions.0 += 1;
                    } else {
                        out.transactions.1 += 1;
                    }
                }
            }
            Err(TxError::Rollback) => out.rolled_back.extend(ids),
            Err(TxError::Db(e)) => {
                eprintln!("chaos: producer transaction failed ({e}); its rows count as uncertain");
                out.uncertain.extend(ids);
                conn = actix_outbox::admin::connect(&url).await.map_err(|e| e.to_string())?;
            }
            Err(TxError::Store(e)) => return Err(format!("producer: {e}")),
        }
    }
    Ok(out)
}

/// One message as the consumer received it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// `message_id`, parsed.
    pub id: i64,
    /// `x-attempt`.
    pub attempt: Option<i64>,
    /// `x-outbox-source`, when the dispatcher sends it.
    pub source: Option<String>,
    /// Seconds since the start of production.
    pub at: f64,
}

/// Every delivery so far, in arrival order.
pub type Log = Arc<Mutex<Vec<Delivery>>>;

/// Consumes the run's queue on a direct connection (no proxy, no fault) until dropped,
/// appending each delivery to `log`; while `paused` says so (a full queue), it consumes
/// nothing. An error ends the run: its record would be incomplete.
pub async fn consume(
    broker: String,
    queue: String,
    log: Log,
    started: Instant,
    mut paused: watch::Receiver<bool>,
) -> Result<(), String> {
    let conn = Connection::connect(&broker, ConnectionProperties::default()).await.map_err(|e| e.to_string())?;
    let channel = conn.create_channel().await.map_err(|e| e.to_string())?;
    let options = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
    let start = async |generation: u32| {
        let tag = format!("chaos-consumer-{generation}");
        channel
            .basic_consume(queue.as_str().into(), tag.as_str().into(), options, FieldTable::default())
            .await
            .map_err(|e| e.to_string())
    };
    let mut generation = 0;
    let mut consumer = start(generation).await?;
    loop {
        let delivery = tokio::select! {
            delivery = consumer.next() => delivery,
            changed = paused.changed() => {
                if changed.is_err() || !*paused.borrow_and_update() {
                    continue;
                }
                // Stop consuming (what was delivered, unacknowledged-free, is logged as it
                // arrives), then wait to be resumed with a consumer of a new tag.
                let tag = format!("chaos-consumer-{generation}");
                channel.basic_cancel(tag.as_str().into(), Default::default()).await.map_err(|e| e.to_string())?;
                // Whatever the broker delivered before it took the cancel.
                while let Ok(Some(delivery)) = tokio::time::timeout(Duration::from_millis(200), consumer.next()).await {
                    record(&log, started, delivery.map_err(|e| format!("consumer: {e}"))?)?;
                }
                while *paused.borrow_and_update() {
                    if paused.changed().await.is_err() {
                        break;
                    }
                }
                generation += 1;
                consumer = start(generation).await?;
                continue;
            }
        };
        let Some(delivery) = delivery else { break };
        record(&log, started, delivery.map_err(|e| format!("consumer: {e}"))?)?;
    }
    Err("the consumer's stream ended".into())
}

/// Appends one delivery to `log`.
fn record(log: &Log, started: Instant, delivery: lapin::message::Delivery) -> Result<(), String> {
    let p = &delivery.properties;
    let Some(id) = p.message_id().as_ref().and_then(|m| m.as_str().parse().ok()) else {
        return Err(format!("a delivery without a numeric message_id: {p:?}"));
    };
    let header = |name: &str| p.headers().as_ref().and_then(|h| h.inner().get(name).cloned());
    let attempt = header("x-attempt").and_then(|v| match v {
        AMQPValue::LongInt(n) => Some(i64::from(n)),
        AMQPValue::LongLongInt(n) => Some(n),
        _ => None,
    });
    let source = header("x-outbox-source").map(|v| match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        other => format!("{other:?}"),
    });
    let at = started.elapsed().as_secs_f64();
    log.lock().unwrap_or_else(|e| e.into_inner()).push(Delivery { id, attempt, source, at });
    Ok(())
}

/// One row as the run leaves it.
#[derive(Debug, Clone, diesel::QueryableByName)]
pub struct Row {
    /// The outbox id.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// `pending`, `processing`, `done`, `dead`.
    #[diesel(sql_type = Text)]
    pub status: String,
    /// Claims spent.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// `aggregate_type/aggregate_id`.
    #[diesel(sql_type = Text)]
    pub aggregate: String,
    /// Why the last attempt failed.
    #[diesel(sql_type = Text)]
    pub last_error: String,
}

/// Every row.
pub async fn rows(url: &str) -> Result<Vec<Row>, String> {
    let mut conn = actix_outbox::admin::connect(&tool_url(url)).await.map_err(|e| e.to_string())?;
    diesel::sql_query(
        "SELECT id, status, attempts, aggregate_type || '/' || aggregate_id AS aggregate, \
         coalesce(last_error, '') AS last_error FROM outbox ORDER BY id",
    )
    .load(&mut conn)
    .await
    .map_err(|e| e.to_string())
}

/// A write the audit caught (see [`AUDIT_SQL`]).
#[derive(Debug, Clone, diesel::QueryableByName)]
pub struct StaleWrite {
    /// The row.
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// `processing` -> this.
    #[diesel(sql_type = Text)]
    pub new_status: String,
    /// The version the row was at.
    #[diesel(sql_type = BigInt)]
    pub lease_version: i64,
    /// Who held it.
    #[diesel(sql_type = Text)]
    pub lease_owner: String,
    /// Who wrote.
    #[diesel(sql_type = Text)]
    pub writer: String,
}

/// Every stale write the audit recorded.
pub async fn stale_writes(url: &str) -> Result<Vec<StaleWrite>, String> {
    let mut conn = actix_outbox::admin::connect(&tool_url(url)).await.map_err(|e| e.to_string())?;
    diesel::sql_query(
        "SELECT id, new_status, lease_version, coalesce(lease_owner, '') AS lease_owner, writer \
         FROM chaos_stale_writes ORDER BY at",
    )
    .load(&mut conn)
    .await
    .map_err(|e| e.to_string())
}

#[derive(diesel::QueryableByName)]
struct Name {
    #[diesel(sql_type = Text)]
    name: String,
}

/// The `application_name`s of the sessions on the run's database, to check that the
/// dispatchers' connections carry their owner names (the audit depends on it).
pub async fn session_names(url: &str, database: &str) -> Result<Vec<String>, String> {
    let mut conn = actix_outbox::admin::connect(&tool_url(url)).await.map_err(|e| e.to_string())?;
    let names: Vec<Name> = diesel::sql_query(format!(
        "SELECT DISTINCT application_name AS name FROM pg_stat_activity WHERE datname = '{database}' \
         AND application_name <> 'chaos-tool'"
    ))
    .load(&mut conn)
    .await
    .map_err(|e| e.to_string())?;
    Ok(names.into_iter().map(|n| n.name).collect())
}
