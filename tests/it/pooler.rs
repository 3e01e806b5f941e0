//! The dispatcher behind a transaction pooler: a PgBouncer of the test's own
//! (`pool_mode = transaction`, Debian's 1.18, which keeps no protocol-level prepared statement
//! for its clients) in front of the test server. The inbox behind one is in `inbox`, the
//! command line's commands in the command line's tests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix_outbox::dispatcher::{GetHealth, GetMetrics, Shutdown};
use actix_outbox::sink::ChannelSink;
use actix_outbox::{
    DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, PgPool, PoolConfig, Pooler, StoreError,
};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use tokio::sync::mpsc::UnboundedReceiver;

use actix_outbox_test_support::{PATIENCE, PgBouncer, TestDb, database_addr, eventually, saw};

const WITHIN: Duration = PATIENCE;

/// The advisory-lock key the armed insert listener of `public.outbox` holds (the migration's
/// trigger spells the same expression), as SQL.
pub(crate) const ARMED: &str = "hashtextextended('actix-outbox:armed:public.outbox', 0)";

/// The advisory-lock key the leading insert listener of `public.outbox` holds, as SQL.
pub(crate) const LEAD: &str = "hashtextextended('actix-outbox:lead:public.outbox', 0)";

/// A pool through `bouncer` to `db`, as a deployment behind PgBouncer makes it; the listener's
/// session goes straight to the server when `direct` says so.
async fn pooled(bouncer: &PgBouncer, db: &TestDb, direct: bool) -> PgPool {
    let mut config = PoolConfig::new(bouncer.route(&db.url)).size(6).pooler(Pooler::Transaction);
    if direct {
        config = config.direct_url(db.url.clone());
    }
    config.connect().await.expect("a pool through the bouncer")
}

/// A producer's connection through the bouncer: no statement cache, every insert in a
/// transaction, as a producer behind a transaction pooler must be set up.
async fn producer(bouncer: &PgBouncer, db: &TestDb) -> AsyncPgConnection {
    actix_outbox::admin::connect(&bouncer.route(&db.url)).await.expect("a producer through the bouncer")
}

async fn enqueue(conn: &mut AsyncPgConnection, n: usize, tag: &str) -> Vec<i64> {
    let events: Vec<_> = (0..n)
        .map(|i| NewEvent::new("test", format!("{tag}-{}", i % 7), "test.happened", serde_json::json!({"n": i})))
        .collect();
    conn.transaction(async |tx| actix_outbox::enqueue_many(tx, &events).await)
        .await
        .expect("enqueue through the bouncer")
}

fn delivered(rx: &mut UnboundedReceiver<Arc<OutboxMessage>>) -> BTreeMap<i64, usize> {
    let mut seen = BTreeMap::new();
    while let Ok(m) = rx.try_recv() {
        *seen.entry(m.id).or_default() += 1;
    }
    seen
}

/// Rows committed through the bouncer before and while the dispatcher runs, the dispatcher's
/// pool through the bouncer too: every row is published once and ends done, none dead, one
/// attempt each; the bouncer carried the dispatcher's transactions. With a direct URL for its
/// session, the insert listener is armed: with polling all but off, rows committed after the
/// drain arrive at once.
#[actix_rt::test]
async fn a_dispatcher_behind_a_transaction_pooler_delivers_every_row_once() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let mut conn = producer(&bouncer, &db).await;
    let before = enqueue(&mut conn, 300, "before").await;

    let (sink, mut rx) = ChannelSink::new();
    let config = DispatcherConfig::default().workers(3).batch(50).poll_interval(Duration::from_secs(3600));
    let dispatcher = OutboxSupervisor::start(config, pooled(&bouncer, &db, true).await, sink).unwrap();
    let mut during = Vec::new();
    for round in 0..10 {
        during.extend(enqueue(&mut conn, 20, &format!("during-{round}")).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all = before.len() + during.len();
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == all as i64) }).await;
    let through_bouncer = bouncer.transactions(&db.name).await;

    // Drained, with an hour's poll: only the listener, on its direct session, can wake a worker.
    assert!(dispatcher.send(GetHealth).await.unwrap().is_ready());
    eventually(WITHIN, "the listener armed on its session", || async {
        saw(advisory_locks(&db, Some(ARMED)).await, |v| *v == 1)
    })
    .await;
    let after = enqueue(&mut conn, 5, "after").await;
    eventually(WITHIN, "rows after the drain done without a poll", || async {
        saw(db.count_status("done").await, |v| *v == (all + after.len()) as i64)
    })
    .await;
    dispatcher.send(Shutdown).await.unwrap();

    let seen = delivered(&mut rx);
    let expected: Vec<i64> = before.iter().chain(&during).chain(&after).copied().collect();
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), expected, "every row published");
    assert!(
        seen.values().all(|n| *n == 1),
        "each once: {:?}",
        seen.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    let rows = db.rows().await;
    assert_eq!(rows.iter().map(|r| r.attempts).max(), Some(1));
    assert_eq!(db.count_status("dead").await, 0);
    let m = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((m.done as usize, m.dead, m.claim_errors, m.finalize_errors), (expected.len(), 0, 0, 0));
    // At least a claim and a finalize per batch of 50 went through the bouncer.
    assert!(through_bouncer >= (all / 50 * 2) as i64, "{through_bouncer} transactions through the bouncer");
}

/// Behind a transaction pooler with no direct URL, nothing holds a session: no listener, and the
/// workers find rows by polling.
#[actix_rt::test]
async fn without_a_direct_url_the_dispatcher_polls_through_the_pooler() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let mut conn = producer(&bouncer, &db).await;
    let (sink, mut rx) = ChannelSink::new();
    // Small batches from four workers, with a producer beside them: many transactions at once,
    // so that the bouncer hands out several server connections.
    let config = DispatcherConfig::default().workers(4).batch(5).poll_interval(Duration::from_millis(20));
    let dispatcher = OutboxSupervisor::start(config, pooled(&bouncer, &db, false).await, sink).unwrap();
    let mut ids = Vec::new();
    for round in 0..30 {
        ids.extend(enqueue(&mut conn, 10, &format!("polled-{round}")).await);
    }
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 300) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    assert_eq!(delivered(&mut rx).keys().copied().collect::<Vec<_>>(), ids);
    // Drained and idle: no listener armed itself (its session lock would outlive transactions).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(advisory_locks(&db, None).await, 0, "no session lock behind the pooler");
}

/// A pool set up for a direct connection (no `pooler`) whose statements go through a
/// transaction pooler after all, as `run --direct-url` without `--pooler transaction` makes
/// it: the first lost prepared statement switches the pool to the pooler's path by itself.
/// Every row is delivered and ends done, none dead, one attempt each; the pool says it is
/// behind a transaction pooler now; one WARN names the setting to make, and no other line
/// speaks of a prepared statement. Alone in its process, for its logs.
#[test]
fn a_pool_not_told_of_its_transaction_pooler_switches_by_itself_and_loses_no_row() {
    crate::alone::test_alone(
        "pooler::a_pool_not_told_of_its_transaction_pooler_switches_by_itself_and_loses_no_row",
        unnamed_pooler,
    );
}

async fn unnamed_pooler() {
    const ROWS: usize = 2000;
    let captured = crate::actors::Captured::install();
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let ids = db.seed(ROWS, "unnamed").await;
    // A producer beside the dispatcher keeps several server connections of the bouncer busy, so
    // that prepared statements go missing soon.
    let mut conn = producer(&bouncer, &db).await;
    let pool = PoolConfig::new(bouncer.route(&db.url)).size(6).direct_url(db.url.clone()).connect().await.unwrap();
    assert_eq!(pool.pooler(), Pooler::None);
    let (sink, mut rx) = ChannelSink::new();
    let config = DispatcherConfig::default().workers(3).batch(50).poll_interval(Duration::from_millis(50));
    let started = std::time::Instant::now();
    let dispatcher = OutboxSupervisor::start(config, pool.clone(), sink).unwrap();
    let mut later = Vec::new();
    for round in 0..10 {
        later.extend(enqueue(&mut conn, 20, &format!("later-{round}")).await);
    }
    let all = ROWS + later.len();
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == all as i64 }).await;
    let took = started.elapsed();
    dispatcher.send(Shutdown).await.unwrap();

    let logs = captured.text();
    let named: Vec<&str> = logs.lines().filter(|l| l.contains("`--pooler transaction`")).collect();
    let prepared: Vec<&str> =
        logs.lines().filter(|l| l.contains("prepared statement") && !l.contains("`--pooler transaction`")).collect();
    let warns = logs.lines().filter(|l| l.contains(" WARN ")).count();
    eprintln!(
        "grey: unnamed transaction pooler: {all} rows done in {:.1}s, {} line(s) naming the flag, {warns} WARN lines",
        took.as_secs_f64(),
        named.len()
    );
    assert_eq!(pool.pooler(), Pooler::Transaction, "the pool found its pooler");
    assert_eq!(named.len(), 1, "one line names the setting: {named:#?}");
    assert!(named[0].contains(" WARN "), "{}", named[0]);
    assert!(prepared.is_empty(), "lines about a prepared statement without the fix: {prepared:#?}");
    let seen = delivered(&mut rx);
    let expected: Vec<i64> = ids.iter().chain(&later).copied().collect();
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), expected, "every row published");
    assert!(seen.values().all(|n| *n == 1), "each once");
    assert_eq!(db.count_status("dead").await, 0);
    assert_eq!(db.rows().await.iter().map(|r| r.attempts).max(), Some(1), "no attempt spent on the pooler");
}

/// Advisory locks held on the test database, of `key` (an SQL expression) or of any: the
/// insert listener's session locks (the lead, and the armed lock) are the only ones that
/// outlive a transaction.
pub(crate) async fn advisory_locks(db: &TestDb, key: Option<&str>) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let count: Count = diesel::sql_query(format!(
        "SELECT count(*) AS n FROM pg_locks l JOIN pg_database d ON d.oid = l.database \
         WHERE d.datname = $1 AND l.locktype = 'advisory' AND l.granted \
           AND (l.classid::int8 << 32 | l.objid::int8) = coalesce({}, l.classid::int8 << 32 | l.objid::int8)",
        key.unwrap_or("NULL")
    ))
    .bind::<Text, _>(&db.name)
    .get_result(&mut db.conn().await)
    .await
    .unwrap();
    count.n
}

/// A pool made for a direct connection but pointed at a transaction pooler keeps its statements
/// prepared from one transaction to the next, and the next may run on another server
/// connection: the error says what is wrong and what to do, not just
/// `prepared statement "s1" does not exist`.
#[actix_rt::test]
async fn a_direct_pool_through_a_transaction_pooler_fails_with_an_error_naming_the_pooler() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let pool = actix_outbox::connect_pool(&bouncer.route(&db.url), 1).await.unwrap();
    let mut conn = pool.get().await.unwrap();
    let no_row = actix_outbox::dispatcher::Fence { id: 1, lease_version: 1 };
    // Prepared and kept on the server connection the bouncer hands out first...
    actix_outbox::testing::mark_done(&mut conn, &[no_row]).await.expect("the first run prepares it");
    // ...which another client then holds in a transaction (the bouncer reuses its most recently
    // used server connection first), so the next run lands on another one.
    let mut other = AsyncPgConnection::establish(&bouncer.route(&db.url)).await.unwrap();
    other.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let e = actix_outbox::testing::mark_done(&mut conn, &[no_row]).await.expect_err("the statement is not there");
    other.batch_execute("COMMIT").await.unwrap();
    assert!(matches!(e, StoreError::BehindTransactionPooler(_)), "{e:?}");
    let message = e.to_string();
    assert!(message.contains(r#"prepared statement "s"#), "the server's words: {message}");
    assert!(message.contains("transaction pooler") && message.contains("--pooler transaction"), "{message}");
    assert!(e.is_transient(), "another statement name may work: retried like an outage");
}

/// Under the FIFO gate behind a transaction pooler, the gate's index is built on the direct
/// session; with no direct URL and no index, claims fail with an error that says how to build
/// it, and nothing is claimed.
#[actix_rt::test]
async fn the_fifo_index_is_built_on_the_direct_session_or_asked_for() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let mut conn = producer(&bouncer, &db).await;
    let ids = enqueue(&mut conn, 10, "fifo").await;

    let (sink, _rx) = ChannelSink::new();
    let config = DispatcherConfig::default().fifo(actix_outbox::Fifo::All).poll_interval(Duration::from_millis(50));
    let without = OutboxSupervisor::start(config.clone(), pooled(&bouncer, &db, false).await, sink).unwrap();
    eventually(WITHIN, "claims failing", || async {
        saw(without.send(GetMetrics).await.unwrap().claim_errors, |v| *v >= 2)
    })
    .await;
    without.send(Shutdown).await.unwrap();
    assert_eq!(db.count_status("pending").await, 10, "nothing claimed without the gate's index");

    let (sink, mut rx) = ChannelSink::new();
    let with = OutboxSupervisor::start(config, pooled(&bouncer, &db, true).await, sink).unwrap();
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 10) }).await;
    with.send(Shutdown).await.unwrap();
    assert_eq!(delivered(&mut rx).keys().copied().collect::<Vec<_>>(), ids);
}

/// Many connections opened at once through the pooler, as a dispatcher's workers and a
/// console open them at start: every one is set up (the driver's own `SET`s at connect are
/// statements too, and a pooler hands each of them to whichever server is free) and answers.
/// Pools and single connections alike, three rounds of 12 at once.
#[actix_rt::test]
async fn connections_opened_at_once_through_the_pooler_all_work() {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    for round in 0..3 {
        let pool =
            PoolConfig::new(bouncer.route(&db.url)).size(12).pooler(Pooler::Transaction).connect().await.unwrap();
        let barrier = Arc::new(tokio::sync::Barrier::new(12));
        let checked_out = (0..12).map(|i| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            async move {
                let mut conn = pool.get().await.map_err(|e| format!("pooled connection {i}: {e}"))?;
                barrier.wait().await;
                let one: i64 = conn
                    .transaction(async |tx| {
                        diesel::select(diesel::dsl::sql::<BigInt>("1::bigint")).get_result(tx).await
                    })
                    .await
                    .map_err(|e: diesel::result::Error| format!("pooled connection {i}: {e}"))?;
                Ok::<_, String>(one)
            }
        });
        let opened = (0..12).map(|i| {
            let url = bouncer.route(&db.url);
            async move {
                let mut conn = actix_outbox::admin::connect(&url).await.map_err(|e| format!("connection {i}: {e}"))?;
                conn.transaction(async |tx| {
                    diesel::select(diesel::dsl::sql::<BigInt>("1::bigint")).get_result::<i64>(tx).await
                })
                .await
                .map_err(|e| format!("connection {i}: {e}"))
            }
        });
        let both = futures_util::future::join(
            futures_util::future::join_all(checked_out),
            futures_util::future::join_all(opened),
        );
        let (pooled, single) = tokio::time::timeout(WITHIN, both).await.unwrap_or_else(|_| {
            panic!("round {round}: connections still not set up after {WITHIN:?}\n{}", bouncer.log())
        });
        let failed: Vec<String> = pooled.into_iter().chain(single).filter_map(Result::err).collect();
        assert!(failed.is_empty(), "round {round}: {failed:#?}\n{}", bouncer.log());
    }
}
