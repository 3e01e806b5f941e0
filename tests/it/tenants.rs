//! Several outboxes in one database, one a schema (`tenant_a.outbox`, `tenant_b.outbox`), each
//! relayed by a dispatcher of its own in one process: each leads and arms its own listener and
//! is woken by its own inserts only, each stamps its own source, and a backlog in one does not
//! hold back a row of another.

use std::sync::Arc;
use std::time::Duration;

use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::ChannelSink;
use actix_outbox::{ConnectionString, DispatcherConfig, NewEvent, OutboxMessage, OutboxSupervisor, PoolConfig};
use diesel_async::SimpleAsyncConnection;
use tokio::sync::mpsc::UnboundedReceiver;

use actix_outbox_test_support::{PATIENCE, TestDb, eventually, saw};

const WITHIN: Duration = PATIENCE;

/// Creates the schemas `names` in `db`, each with a migrated outbox; returns their strings.
async fn tenants(db: &TestDb, names: &[&str]) -> Vec<ConnectionString> {
    let url = ConnectionString::parse(&db.url).unwrap();
    let mut urls = Vec::new();
    for name in names {
        assert!(actix_outbox::admin::ensure_schema(&db.url, name).await.unwrap(), "{name} created");
        assert!(!actix_outbox::admin::ensure_schema(&db.url, name).await.unwrap(), "{name} there already");
        let tenant = url.in_schema(name).unwrap();
        let applied = actix_outbox::migrate(tenant.expose()).await.unwrap();
        assert_eq!(applied.len(), 13, "{name}: every migration, in its schema: {applied:?}");
        assert_eq!(applied.last().map(String::as_str), Some("20261205000014"), "{name}");
        assert_eq!(actix_outbox::admin::pending_migrations(tenant.expose()).await.unwrap(), Vec::<String>::new());
        urls.push(tenant);
    }
    urls
}

/// A dispatcher on `url` that finds new rows only when woken (it polls once an hour).
async fn dispatcher(url: &ConnectionString, name: &str, sink: ChannelSink) -> actix::Addr<OutboxSupervisor> {
    let pool = PoolConfig::new(url.expose()).size(6).connect().await.unwrap();
    let config = DispatcherConfig::default().poll_interval(Duration::from_secs(3600)).name(name).owner(name.to_owned());
    OutboxSupervisor::start(config, pool, sink).unwrap()
}

async fn enqueue(url: &ConnectionString, aggregate: &str) -> i64 {
    let mut conn = actix_outbox::admin::connect(url.expose()).await.unwrap();
    let event = NewEvent::new("tenant", aggregate, "tenant.row", serde_json::json!({}));
    actix_outbox::enqueue(&mut conn, &event).await.unwrap()
}

/// Messages received so far.
fn drain(rx: &mut UnboundedReceiver<Arc<OutboxMessage>>, into: &mut Vec<Arc<OutboxMessage>>) {
    while let Ok(m) = rx.try_recv() {
        into.push(m);
    }
}

/// Waits until `into` holds at least `n` messages of `rx` (`what` names them if it never does).
async fn received(
    rx: &mut UnboundedReceiver<Arc<OutboxMessage>>,
    into: &mut Vec<Arc<OutboxMessage>>,
    n: usize,
    what: &str,
) {
    eventually(WITHIN, what, || {
        drain(rx, into);
        std::future::ready(saw(into.len(), |&got| got >= n))
    })
    .await;
}

#[actix_rt::test]
async fn outboxes_in_two_schemas_each_lead_arm_and_wake_only_their_own() {
    let db = TestDb::new().await;
    let urls = tenants(&db, &["tenant_a", "tenant_b"]).await;
    let listed = actix_outbox::admin::outbox_schemas(&mut db.conn().await, "tenant\\_%").await.unwrap();
    assert_eq!(listed, ["tenant_a", "tenant_b"]);
    let (sink_a, mut rx_a) = ChannelSink::new();
    let (sink_b, mut rx_b) = ChannelSink::new();
    let a = dispatcher(&urls[0], "tenant_a.outbox", sink_a).await;
    let b = dispatcher(&urls[1], "tenant_b.outbox", sink_b).await;
    for tenant in ["tenant_a", "tenant_b"] {
        let lead = format!("hashtextextended('actix-outbox:lead:{tenant}.outbox', 0)");
        let armed = format!("hashtextextended('actix-outbox:armed:{tenant}.outbox', 0)");
        eventually(WITHIN, &format!("{tenant}'s listener leads and is armed"), || async {
            let held = (
                crate::pooler::advisory_locks(&db, Some(&lead)).await,
                crate::pooler::advisory_locks(&db, Some(&armed)).await,
            );
            saw(held, |&held| held == (1, 1))
        })
        .await;
    }
    // public.outbox, the test database's own, has no dispatcher: its keys are free.
    assert_eq!(crate::pooler::advisory_locks(&db, Some(crate::pooler::LEAD)).await, 0);

    // A row in b wakes b's dispatcher, and only it: a's finds nothing to publish.
    let id_b = enqueue(&urls[1], "b1").await;
    let mut got_b = Vec::new();
    received(&mut rx_b, &mut got_b, 1, "b's row published").await;
    assert_eq!(got_b[0].id, id_b);
    assert!(got_b[0].source.ends_with("/tenant_b.outbox"), "{}", got_b[0].source);
    let id_a = enqueue(&urls[0], "a1").await;
    let mut got_a = Vec::new();
    received(&mut rx_a, &mut got_a, 1, "a's row published").await;
    assert_eq!((got_a[0].id, got_a[0].aggregate_id.as_str()), (id_a, "a1"));
    assert!(got_a[0].source.ends_with("/tenant_a.outbox"), "{}", got_a[0].source);
    // Each table holds its own row, done (its finalize commits after the sink has the
    // message); the public outbox none.
    for (tenant, id) in [("tenant_a", id_a), ("tenant_b", id_b)] {
        eventually(WITHIN, &format!("{tenant}'s row done"), || async {
            saw(status_of(&mut db.conn().await, tenant, id).await, |status| status == "done")
        })
        .await;
    }
    assert_eq!(db.count_status("done").await, 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    drain(&mut rx_a, &mut got_a);
    drain(&mut rx_b, &mut got_b);
    assert_eq!((got_a.len(), got_b.len()), (1, 1), "no message twice, none of the other outbox");
    a.send(Shutdown).await.unwrap();
    b.send(Shutdown).await.unwrap();
}

/// The status of row `id` of `schema.outbox`.
async fn status_of(conn: &mut diesel_async::AsyncPgConnection, schema: &str, id: i64) -> String {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        status: String,
    }
    let row: Row = diesel_async::RunQueryDsl::get_result(
        diesel::sql_query(format!("SELECT status FROM {schema}.outbox WHERE id = $1"))
            .bind::<diesel::sql_types::BigInt, _>(id),
        conn,
    )
    .await
    .unwrap();
    row.status
}

/// Fair between outboxes: with 50,000 rows waiting in tenant_a's outbox and its dispatcher
/// draining them, one row committed to tenant_b's is published while most of that backlog is
/// still to go, through the one sink both share. An order, not a time: the drain need not
/// finish (both dispatchers are shut down once b's row is out), and what a published is done,
/// once each.
#[actix_rt::test]
async fn a_backlog_in_one_outbox_does_not_hold_back_another_outboxs_row() {
    const BACKLOG: usize = 50_000;
    let db = TestDb::new().await;
    let urls = tenants(&db, &["tenant_a", "tenant_b"]).await;
    let mut conn = db.conn().await;
    conn.batch_execute(&format!(
        "INSERT INTO tenant_a.outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'tenant', 'a' || (n % 100), 'tenant.row', '{{}}' FROM generate_series(1, {BACKLOG}) n"
    ))
    .await
    .unwrap();
    let (sink, mut rx) = ChannelSink::new();
    let a = dispatcher(&urls[0], "tenant_a.outbox", sink.clone()).await;
    let b = dispatcher(&urls[1], "tenant_b.outbox", sink).await;
    let mut got = Vec::new();
    received(&mut rx, &mut got, 1000, "a's drain under way").await;
    let id_b = enqueue(&urls[1], "b1").await;
    let from_b = |m: &Arc<OutboxMessage>| m.source.ends_with("/tenant_b.outbox");
    eventually(WITHIN, "b's row published", || {
        drain(&mut rx, &mut got);
        std::future::ready(saw(got.len(), |_| got.iter().any(from_b)))
    })
    .await;
    let before_b = got.iter().position(from_b).unwrap();
    assert_eq!(got[before_b].id, id_b);
    assert!(before_b < BACKLOG / 2, "b's row came after {before_b} of a's {BACKLOG}");
    a.send(Shutdown).await.unwrap();
    b.send(Shutdown).await.unwrap();
    drain(&mut rx, &mut got);
    let of_a: std::collections::BTreeSet<i64> = got.iter().filter(|m| !from_b(m)).map(|m| m.id).collect();
    assert_eq!((of_a.len(), got.len()), (got.len() - 1, got.len()), "every row once, b's once");
    let mut conn = db.conn().await;
    assert_eq!(count_status(&mut conn, "tenant_a", "done").await, of_a.len() as i64, "a's published rows done");
    assert_eq!(count_status(&mut conn, "tenant_a", "processing").await, 0, "a's drain stopped cleanly");
    assert_eq!(count_status(&mut conn, "tenant_b", "done").await, 1);
}

/// Rows of `schema.outbox` in `status`.
async fn count_status(conn: &mut diesel_async::AsyncPgConnection, schema: &str, status: &str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let count: Count = diesel_async::RunQueryDsl::get_result(
        diesel::sql_query(format!("SELECT count(*) AS n FROM {schema}.outbox WHERE status = $1"))
            .bind::<diesel::sql_types::Text, _>(status),
        conn,
    )
    .await
    .unwrap();
    count.n
}
