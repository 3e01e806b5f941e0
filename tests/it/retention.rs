//! What the table keeps: the dispatcher's pruner deletes `done` rows once older than the
//! retention, and nothing else; and a table that holds rows of every kind migrates to the
//! current schema keeping each of them, and each guarantee.

use std::collections::BTreeSet;
use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::ChannelSink;
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor, Retention};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

use actix_outbox_test_support::{ScratchDb, TestDb, eventually};

const WITHIN: Duration = Duration::from_secs(30);

/// Rows of every status, some finished long ago: the pruner deletes exactly the `done` rows
/// finished more than the retention ago, and leaves the recent `done` rows, the `dead` ones
/// however old, and the unfinished ones.
#[actix_rt::test]
async fn the_pruner_deletes_exactly_the_expired_done_rows() {
    let db = TestDb::new().await;
    let ids = db.seed(12, "a").await;
    let mut conn = db.conn().await;
    // 0..5 done two hours ago, 5..7 done a minute ago, 7..9 dead two hours ago (parked as the
    // dispatcher parks them), 9 processing and 10 pending, created two hours ago; 11 pending.
    let list = |r: &[i64]| r.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    conn.batch_execute(&format!(
        "UPDATE outbox SET status = 'done', done_at = now() - interval '2 hours' WHERE id IN ({});
         UPDATE outbox SET status = 'done', done_at = now() - interval '1 minute' WHERE id IN ({});
         UPDATE outbox SET status = 'dead', available_at = '9999-12-31 00:00:00+00' WHERE id IN ({});
         UPDATE outbox SET status = 'processing', lease_until = now() + interval '1 hour', lease_version = 1,
                           attempts = 1 WHERE id = {};
         UPDATE outbox SET created_at = now() - interval '2 hours' WHERE id IN ({}, {});",
        list(&ids[..5]),
        list(&ids[5..7]),
        list(&ids[7..9]),
        ids[9],
        ids[9],
        ids[10],
    ))
    .await
    .unwrap();
    // The sink reports itself down, so no claim moves the unfinished rows meanwhile.
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_state(|| actix_outbox::sink::SinkState::Down("test".into()));
    let config = DispatcherConfig::default()
        .workers(1)
        .retention(Retention::KeepFor(Duration::from_secs(600)))
        .sink_probe_interval(Duration::from_secs(3600));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    eventually(WITHIN, "five rows pruned", || async { db.scalar("SELECT count(*) AS n FROM outbox").await == 7 }).await;
    // The pruner counts a stretch once its delete has committed: a moment after the table shows it
    // (and a shutdown does not wait for a pass).
    eventually(WITHIN, "five rows counted pruned", || async { dispatcher.send(GetMetrics).await.unwrap().pruned == 5 })
        .await;
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    let left: BTreeSet<i64> = db.rows().await.iter().map(|r| r.id).collect();
    assert_eq!(left, ids[5..].iter().copied().collect::<BTreeSet<_>>());
    assert_eq!(metrics.pruned, 5);
    let statuses: Vec<Status> = db.rows().await.iter().map(|r| r.status).collect();
    use Status::*;
    assert_eq!(statuses, vec![Done, Done, Dead, Dead, Processing, Pending, Pending]);
}

/// `Retention::Keep` keeps every `done` row, however old; the one-off `purge` still deletes
/// them by age.
#[actix_rt::test]
async fn keep_prunes_nothing_and_purge_still_deletes_by_age() {
    let db = TestDb::new().await;
    let ids = db.seed(4, "a").await;
    let mut conn = db.conn().await;
    conn.batch_execute(&format!(
        "UPDATE outbox SET status = 'done', done_at = now() - interval '2 hours' WHERE id IN ({}, {}, {})",
        ids[0], ids[1], ids[2]
    ))
    .await
    .unwrap();
    let (sink, _rx) = ChannelSink::new();
    let sink = sink.with_state(|| actix_outbox::sink::SinkState::Down("test".into()));
    let config = DispatcherConfig::default()
        .workers(1)
        .retention(Retention::Keep)
        .sink_probe_interval(Duration::from_secs(3600));
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    assert_eq!((metrics.pruned, db.rows().await.len()), (0, 4));
    let purged = actix_outbox::admin::purge_done(&mut conn, Duration::from_secs(3600), 2).await.unwrap();
    assert_eq!(purged, 3);
    assert_eq!(db.rows().await.iter().map(|r| r.id).collect::<Vec<_>>(), vec![ids[3]]);
}

/// A table from before this schema (the migrations up to the ninth) holding rows of every kind
/// migrates in place: every row keeps its id, status, attempts and fence; the dispatcher then
/// publishes each pending row once (those waiting for a retry when due), takes over the row
/// whose lease ran out with the next fence, leaves the row in flight to its live lease until
/// it runs out too, keeps the dead row dead and listed, and the new indexes are the only ones.
#[actix_rt::test]
async fn a_table_with_rows_migrates_keeping_every_row_and_every_guarantee() {
    use diesel_migrations::MigrationHarness;
    let scratch = ScratchDb::new();
    assert!(actix_outbox::admin::ensure_database(&scratch.url).await.unwrap());
    let url = scratch.url.clone();
    // The schema as it was: the first eight migrations (up to 2026-12-04-000009).
    tokio::task::spawn_blocking(move || {
        let mut conn: diesel_async::async_connection_wrapper::AsyncConnectionWrapper<AsyncPgConnection> =
            diesel::Connection::establish(&url).unwrap();
        for _ in 0..8 {
            conn.run_next_migration(actix_outbox::admin::MIGRATIONS).unwrap();
        }
        assert_eq!(conn.pending_migrations(actix_outbox::admin::MIGRATIONS).unwrap().len(), 5);
    })
    .await
    .unwrap();
    let mut conn = AsyncPgConnection::establish(&scratch.url).await.unwrap();
    // Rows as the old dispatcher left them: 1-3 pending (3 backing off for another second), 4
    // processing with a lease that ran out, 5 processing with a live lease, 6 done, 7 done after
    // a retry, 8 dead.
    conn.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'o' || n, 'order.created', jsonb_build_object('n', n) FROM generate_series(1, 8) n;
         UPDATE outbox SET available_at = now() + interval '1 second', attempts = 1, last_error = 'retryable: x'
             WHERE id = 3;
         UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_owner = 'old:1:worker-0',
                           lease_until = now() - interval '1 minute' WHERE id = 4;
         UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_owner = 'old:1:worker-1',
                           lease_until = now() + interval '3 seconds' WHERE id = 5;
         UPDATE outbox SET status = 'done', attempts = 1, lease_version = 1, done_at = now() WHERE id = 6;
         UPDATE outbox SET status = 'done', attempts = 2, lease_version = 2, done_at = now(),
                           available_at = now() + interval '1 minute' WHERE id = 7;
         UPDATE outbox SET status = 'dead', attempts = 3, lease_version = 3, last_error = 'permanent: x' WHERE id = 8;",
    )
    .await
    .unwrap();
    let applied = actix_outbox::migrate(&scratch.url).await.unwrap();
    assert_eq!(applied.len(), 5, "{applied:?}");

    #[derive(diesel::QueryableByName, Debug, PartialEq)]
    struct Kept {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        status: String,
        #[diesel(sql_type = diesel::sql_types::Integer)]
        attempts: i32,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        lease_version: i64,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        has_txid: bool,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        waits: bool,
    }
    let kept: Vec<Kept> = diesel_async::RunQueryDsl::load(
        diesel::sql_query(
            "SELECT id, status, attempts, lease_version, txid IS NOT NULL AS has_txid,
                    available_at > created_at AS waits FROM outbox ORDER BY id",
        ),
        &mut conn,
    )
    .await
    .unwrap();
    let k = |id, status: &str, attempts, lease_version, has_txid, waits| Kept {
        id,
        status: status.to_owned(),
        attempts,
        lease_version,
        has_txid,
        waits,
    };
    assert_eq!(
        kept,
        vec![
            k(1, "pending", 0, 0, true, false),
            k(2, "pending", 0, 0, true, false),
            k(3, "pending", 1, 0, true, true),
            k(4, "processing", 1, 1, true, false),
            k(5, "processing", 1, 1, true, false),
            k(6, "done", 1, 1, false, false),
            k(7, "done", 2, 2, false, false),
            k(8, "dead", 3, 3, false, true),
        ]
    );
    #[derive(diesel::QueryableByName, Debug)]
    struct Index {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    let indexes: Vec<Index> = diesel_async::RunQueryDsl::load(
        diesel::sql_query("SELECT indexname::text AS name FROM pg_indexes WHERE tablename = 'outbox' ORDER BY 1"),
        &mut conn,
    )
    .await
    .unwrap();
    assert_eq!(
        indexes.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(),
        ["outbox_later", "outbox_pkey", "outbox_txid"]
    );

    let pool = actix_outbox::connect_pool(&scratch.url, 8).await.unwrap();
    let (sink, mut rx) = ChannelSink::new();
    let config = DispatcherConfig::default().poll_interval(Duration::from_millis(50));
    let dispatcher = OutboxSupervisor::start(config, pool, sink).unwrap();
    let mut published = Vec::new();
    eventually(WITHIN, "rows 1-5 published", || {
        while let Ok(m) = rx.try_recv() {
            published.push((m.id, m.lease_version, m.attempts));
        }
        let n = published.len();
        async move { n >= 5 }
    })
    .await;
    // A new row after the migration goes too.
    let mut producer = AsyncPgConnection::establish(&scratch.url).await.unwrap();
    let new =
        actix_outbox::enqueue(&mut producer, &NewEvent::new("order", "o9", "order.created", serde_json::json!({})))
            .await
            .unwrap();
    eventually(WITHIN, "the new row published", || {
        while let Ok(m) = rx.try_recv() {
            published.push((m.id, m.lease_version, m.attempts));
        }
        let found = published.iter().any(|p| p.0 == new);
        async move { found }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    while let Ok(m) = rx.try_recv() {
        published.push((m.id, m.lease_version, m.attempts));
    }
    dispatcher.send(Shutdown).await.unwrap();
    published.sort_unstable();
    assert_eq!(published, vec![(1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 2, 2), (5, 2, 2), (new, 1, 1)]);
    let dead = actix_outbox::admin::dead_list(&mut conn, 10).await.unwrap();
    assert_eq!(dead.iter().map(|r| (r.id, r.status, r.attempts)).collect::<Vec<_>>(), vec![(8, Status::Dead, 3)]);
}
