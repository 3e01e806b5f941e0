//! Grey failures: faults that close nothing. A database link that stops answering without a FIN
//! or an RST (the test proxy's freeze: the connections open at that moment forward nothing and
//! stay open, new ones pass), the whole database gone silent (frozen and new connections
//! refused), and a queue at its length limit that nacks (`x-overflow = reject-publish`). The
//! transaction pooler nobody named is in `pooler`, the inbox's frozen link in `inbox`.
//!
//! The figures of docs/operations.md ("Grey failures") come from these tests' `eprintln!`
//! lines (`--nocapture`); the tests themselves assert outcomes, with deadlines sized for a slow
//! host.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_outbox::dispatcher::{GetHealth, GetMetrics, GetPace, Shutdown};
use actix_outbox::sink::{ChannelSink, RabbitConfig, RabbitSink, SinkAction};
use actix_outbox::{DispatcherConfig, OutboxMessage, OutboxSupervisor, PoolConfig, StoreError};
use lapin::types::{AMQPValue, FieldTable};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::actors::Captured;
use crate::proxy::Proxy;
use actix_outbox_test_support::{TestBroker, TestDb, amqp_url, database_addr, eventually};

const WITHIN: Duration = Duration::from_secs(60);

/// Copies received so far, by id.
fn copies(rx: &mut UnboundedReceiver<Arc<OutboxMessage>>, seen: &mut BTreeMap<i64, usize>) {
    while let Ok(m) = rx.try_recv() {
        *seen.entry(m.id).or_default() += 1;
    }
}

/// The log lines that contain `what`.
fn lines<'a>(logs: &'a str, what: &str) -> Vec<&'a str> {
    logs.lines().filter(|l| l.contains(what)).collect()
}

/// A pool of one connection through `proxy`, which misses its deadline once the proxy freezes
/// it: the pool drops that connection rather than hand it out again, the next unit of work runs
/// on a fresh connection, and the error names the server (password masked) and the wait.
#[actix_rt::test]
async fn a_connection_that_misses_its_deadline_is_dropped_not_handed_out_again() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(database_addr()).await;
    let url = proxy.route(&db.url).replace("root@", "root:s3cret@");
    let pool = PoolConfig::new(url).size(1).query_timeout(Duration::from_millis(500)).connect().await.expect("a pool");
    let one = async |pool: &actix_outbox::PgPool| {
        pool.run(async |conn| {
            use diesel_async::SimpleAsyncConnection;
            conn.batch_execute("SELECT 1").await.map_err(StoreError::from)
        })
        .await
    };
    one(&pool).await.expect("the first unit answers");

    proxy.freeze();
    let silent = one(&pool).await.expect_err("a frozen link does not answer");
    let StoreError::NoAnswer { server, waited } = &silent else { panic!("not a silent link: {silent:?}") };
    assert_eq!(*waited, Duration::from_millis(500));
    assert!(server.contains(&proxy.addr().to_string()) && !server.contains("s3cret"), "{server}");
    assert!(silent.is_transient(), "{silent}");
    assert!(silent.to_string().contains("did not answer within 500ms"), "{silent}");

    // The frozen connection was dropped: the next unit opens a fresh one, which passes.
    // The frozen connection was dropped: the next units run on a fresh one, which answers (a
    // frozen one handed out again would miss its deadline again). The proxy also saw the
    // request that cancels the frozen statement, on a connection of its own.
    one(&pool).await.expect("a fresh connection answers");
    one(&pool).await.expect("and keeps answering");
    assert!(proxy.connections() >= 2, "a fresh connection was opened");
}

/// The run: a third of the rows done, then every connection open at that moment
/// freezes (no FIN, no RST) while new ones pass, every setting at its default (a query timeout
/// of 5 s). A WARN names the (masked) server and how long it waited; every row ends done, none
/// dead, none with more than two attempts; fresh connections replaced the frozen ones. Alone in
/// its process, for its logs.
#[test]
fn a_frozen_database_link_is_found_out_and_every_row_done() {
    crate::alone::test_alone("grey::a_frozen_database_link_is_found_out_and_every_row_done", frozen_link);
}

async fn frozen_link() {
    const ROWS: usize = 6000;
    let captured = Captured::install();
    let db = TestDb::new().await;
    let proxy = Proxy::start(database_addr()).await;
    let pool = PoolConfig::new(proxy.route(&db.url)).connect().await.expect("a pool through the proxy");
    let (sink, mut rx) = ChannelSink::new();
    // A little time per message, so that the freeze finds rows in every state.
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_millis(2)));
    let ids: BTreeSet<i64> = db.seed(ROWS, "frozen").await.into_iter().collect();
    let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink).unwrap();
    eventually(WITHIN, "a third of the rows done", || async { db.count_status("done").await >= ROWS as i64 / 3 }).await;

    let open = proxy.connections();
    proxy.freeze();
    let frozen_at = Instant::now();
    eventually(WITHIN, "a WARN that the database did not answer", || async {
        lines(&captured.text(), " WARN ").iter().any(|l| l.contains("did not answer within 5s"))
    })
    .await;
    let warned_after = frozen_at.elapsed();
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == ROWS as i64 }).await;
    let done_after = frozen_at.elapsed();
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();

    let logs = captured.text();
    let warned: Vec<&str> =
        lines(&logs, " WARN ").into_iter().filter(|l| l.contains("did not answer within")).collect();
    assert!(warned[0].contains(&proxy.addr().to_string()), "the WARN names the server: {}", warned[0]);
    let rows = db.rows().await;
    let max_attempts = rows.iter().map(|r| r.attempts).max().unwrap_or(0);
    eprintln!(
        "grey: frozen database link: {open} connections frozen, first WARN after {:.1}s, every row done after \
         {:.1}s, {} database WARN lines, max attempts {max_attempts}, {} new connections",
        warned_after.as_secs_f64(),
        done_after.as_secs_f64(),
        warned.len(),
        proxy.connections() - open
    );
    assert_eq!(db.count_status("dead").await, 0, "{metrics:?}");
    assert!(max_attempts <= 2, "max attempts {max_attempts}");
    let mut seen = BTreeMap::new();
    copies(&mut rx, &mut seen);
    assert_eq!(seen.keys().copied().collect::<BTreeSet<_>>(), ids, "every row delivered");
    assert!(proxy.connections() > open, "fresh connections replaced the frozen ones");
    assert!(metrics.claim_errors + metrics.finalize_retries > 0, "the silence was noticed: {metrics:?}");
}

/// The whole database goes silent (the open connections frozen, new ones refused): within
/// seconds the dispatcher is not ready and says why; the summary leaves out the backlog it can
/// no longer sample and says how old its last sample is; and a shutdown answers within the
/// publish timeout and a few seconds. Alone in its process, for its logs.
#[test]
fn a_silent_database_makes_the_dispatcher_not_ready_and_a_shutdown_still_ends() {
    crate::alone::test_alone(
        "grey::a_silent_database_makes_the_dispatcher_not_ready_and_a_shutdown_still_ends",
        silent_database,
    );
}

async fn silent_database() {
    let captured = Captured::install();
    let db = TestDb::new().await;
    let proxy = Proxy::start(database_addr()).await;
    let pool = PoolConfig::new(proxy.route(&db.url)).connect().await.expect("a pool through the proxy");
    let (sink, _rx) = ChannelSink::new();
    // Slow enough that the silence finds rows in flight.
    let sink = sink.with_script(|_| SinkAction::Stall(Duration::from_secs(1)));
    db.seed(20_000, "silent").await;
    let config = DispatcherConfig::default()
        .table_metrics_interval(Some(Duration::from_millis(200)))
        .summary_interval(Some(Duration::from_secs(1)));
    let publish_timeout = config.publish_timeout;
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    let ready = tokio::time::timeout(WITHIN, async {
        while !(db.count_status("processing").await >= 100 && captured.text().contains("backlog=")) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        ready.is_ok(),
        "no rows in flight ({} processing) or no summary with the backlog:\n{}",
        db.count_status("processing").await,
        captured.text()
    );
    assert!(dispatcher.send(GetHealth).await.unwrap().is_ready());

    proxy.freeze();
    proxy.refuse(true);
    let silent_at = Instant::now();
    eventually(WITHIN, "not ready", || async { !dispatcher.send(GetHealth).await.unwrap().is_ready() }).await;
    let not_ready_after = silent_at.elapsed();
    let health = dispatcher.send(GetHealth).await.unwrap();
    let why = health.not_ready_reason().unwrap();
    assert!(why.contains("database"), "{why}");
    let summaries_before = lines(&captured.text(), "outbox summary").len();
    eventually(WITHIN, "a summary that says the sample is old", || async {
        lines(&captured.text(), "outbox summary").iter().skip(summaries_before).any(|l| l.contains("sampled="))
    })
    .await;
    let logs = captured.text();
    let stale: Vec<&str> = lines(&logs, "outbox summary").into_iter().filter(|l| l.contains("sampled=")).collect();
    assert!(!stale[0].contains("backlog="), "a stale backlog is not shown as current: {}", stale[0]);

    let asked = Instant::now();
    tokio::time::timeout(publish_timeout + Duration::from_secs(30), dispatcher.send(Shutdown))
        .await
        .expect("the shutdown answered")
        .unwrap();
    let stopped_after = asked.elapsed();
    eprintln!(
        "grey: silent database: not ready after {:.1}s ({why}); shutdown answered after {:.1}s (publish timeout \
         {publish_timeout:?})",
        not_ready_after.as_secs_f64(),
        stopped_after.as_secs_f64()
    );
    assert!(
        stopped_after <= publish_timeout + Duration::from_secs(5),
        "the shutdown took {stopped_after:?}, over the publish timeout + 5 s"
    );
}

/// The full queue: the exchange's queue holds 1,000 messages at most and turns the rest
/// away (`x-overflow = reject-publish`), 5,000 rows, nobody consuming for ten seconds, every
/// dispatcher setting at its default (no `max_rate`). The nacks are pushback: no row goes dead
/// or spends an attempt on them, the claims slow down (the pace shows it), one WARN says so for
/// the whole episode, and once a consumer empties the queue every row arrives, once.
#[test]
fn a_full_queue_is_pushback_that_costs_no_attempt() {
    crate::alone::test_alone("grey::a_full_queue_is_pushback_that_costs_no_attempt", full_queue);
}

async fn full_queue() {
    const ROWS: usize = 5000;
    let captured = Captured::install();
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("full").await;
    broker.declare(lapin::ExchangeKind::Topic).await;
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(1000));
    arguments.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    let queue = broker.queue(&["#"], arguments).await;
    let ids: BTreeSet<i64> = db.seed(ROWS, "full").await.into_iter().collect();
    let sink = RabbitSink::connect(RabbitConfig::new(amqp_url()).exchange(broker.exchange.clone())).await.unwrap();
    let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), db.pool.clone(), sink.clone()).unwrap();

    eventually(WITHIN, "the pace held back by the refusals", || async {
        dispatcher.send(GetPace).await.unwrap().is_pushed_back()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let held = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!(broker.depth(&queue).await, 1000, "the queue is full");
    assert_eq!(db.count_status("dead").await, 0);

    let consumer_at = Instant::now();
    let mut delivered = broker.message_ids(&queue, ROWS).await;
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == ROWS as i64 }).await;
    let done_after = consumer_at.elapsed();
    // Whatever came after the first 5,000 (duplicates would push rows past them).
    tokio::time::sleep(Duration::from_secs(1)).await;
    delivered.extend(broker.message_ids(&queue, broker.depth(&queue).await as usize).await);
    eventually(WITHIN, "the pace lifted", || async { dispatcher.send(GetPace).await.unwrap().rate.is_none() }).await;
    // After the shutdown, which waits for the finalizes: a row's new state is committed a moment
    // before the finalizer counts it.
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    sink.close().await;

    let logs = captured.text();
    let warns = lines(&logs, " WARN ");
    let episodes = lines(&logs, "the broker refuses messages");
    let rows = db.rows().await;
    let max_attempts = rows.iter().map(|r| r.attempts).max().unwrap_or(0);
    eprintln!(
        "grey: full queue: {} refusals while full ({} in all), every row done {:.1}s after the consumer started, max \
         attempts {max_attempts}, {} WARN lines ({} episodes)",
        held.refused,
        metrics.refused,
        done_after.as_secs_f64(),
        warns.len(),
        episodes.len()
    );
    let mut per_id: BTreeMap<i64, usize> = BTreeMap::new();
    for id in &delivered {
        *per_id.entry(*id).or_default() += 1;
    }
    let missing: Vec<_> = ids.iter().filter(|id| !per_id.contains_key(id)).collect();
    let twice: Vec<_> = per_id.iter().filter(|(_, n)| **n > 1).collect();
    assert!(missing.is_empty(), "{} rows never arrived: {missing:?}", missing.len());
    assert!(twice.is_empty(), "{} rows arrived more than once: {twice:?}", twice.len());
    assert_eq!((db.count_status("dead").await, metrics.dead), (0, 0));
    assert!(max_attempts <= 2, "the refusals spent attempts: max {max_attempts}");
    assert!(held.refused > 0, "the broker refused: {held:?}");
    assert!(!episodes.is_empty() && episodes.len() <= 3, "one WARN an episode: {episodes:#?}");
    assert!(warns.len() <= 5, "a few WARN lines, not one per nack: {warns:#?}");
    assert!(lines(&logs, "publish failed").is_empty(), "no per-row retry line");
}
