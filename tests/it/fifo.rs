//! Per-aggregate FIFO (docs/architecture.md): the head gate in the claim, across workers, dispatchers and
//! lease takeovers; its event-type variant; the producer lock it relies on; the operator's view
//! of blocked aggregates and the two ways out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use actix_outbox::admin::{BlockedAggregate, Status, blocked_aggregates, dead_retry, dead_skip};
use actix_outbox::dispatcher::Fence;
use actix_outbox::sink::{ChannelSink, SinkAction};
use actix_outbox::testing::{Claim, ClaimParams, Reschedule, mark_dead, mark_done};
use actix_outbox::{
    DispatcherConfig, Fifo, NewEvent, OutboxMessage, OutboxSupervisor, StoreError, enqueue, enqueue_many,
    enqueue_ordered,
};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Bool, Int8, Text};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager};
use tokio::sync::mpsc::UnboundedReceiver;

use actix_outbox_test_support::{PATIENCE, Seen, TestBroker, TestDb, amqp_url, eventually, saw};

const LEASE: Duration = Duration::from_secs(60);
const WITHIN: Duration = PATIENCE;
const MAX_ATTEMPTS: i32 = 12;

fn params<'a>(owner: &'a str, fifo: &'a Fifo) -> ClaimParams<'a> {
    ClaimParams {
        owner,
        batch: 50,
        max_bytes: usize::MAX,
        lease: LEASE,
        max_attempts: MAX_ATTEMPTS,
        fifo,
        cursor: None,
        heads_after: None,
    }
}

/// A sweep, as the dispatcher runs one every second: rows whose lease expired go where the next
/// claim takes them over, or dead with no attempt left.
async fn sweep(conn: &mut AsyncPgConnection, max_attempts: i32) -> actix_outbox::testing::Swept {
    let params = actix_outbox::testing::SweepParams {
        max_attempts,
        chunk: 10_000,
        stray_after: Duration::from_secs(600),
        claimed_to: None,
    };
    // Another claim's sweep running at the same time does the same.
    actix_outbox::testing::sweep(conn, params).await.expect("sweep").unwrap_or_default()
}

/// A claim of every new row from the oldest (no cursor), after a sweep.
async fn claim(conn: &mut AsyncPgConnection, owner: &str, fifo: &Fifo) -> Claim {
    sweep(conn, MAX_ATTEMPTS).await;
    actix_outbox::testing::claim(conn, &params(owner, fifo)).await.expect("claim")
}

fn ids(claim: &Claim) -> Vec<i64> {
    claim.messages.iter().map(|m| m.id).collect()
}

fn fences(claim: &Claim) -> Vec<Fence> {
    claim.messages.iter().map(OutboxMessage::fence).collect()
}

/// Inserts one event per `(aggregate_type, aggregate_id, event_type)`, in order; returns ids.
async fn insert(conn: &mut AsyncPgConnection, rows: &[(&str, &str, &str)]) -> Vec<i64> {
    let events: Vec<_> =
        rows.iter().map(|(t, a, e)| NewEvent::new(*t, *a, *e, serde_json::json!({"agg": a, "type": e}))).collect();
    enqueue_many(conn, &events).await.expect("insert")
}

async fn done(conn: &mut AsyncPgConnection, fences: &[Fence]) {
    let won = mark_done(conn, fences).await.expect("mark done");
    assert_eq!(won, fences.iter().map(|f| f.id).collect::<Vec<_>>(), "every fence must win");
}

async fn bury(conn: &mut AsyncPgConnection, claim: &Claim, error: &str) {
    let rows: Vec<_> =
        fences(claim).into_iter().map(|fence| actix_outbox::testing::Bury { fence, error: error.to_owned() }).collect();
    let won = mark_dead(conn, &rows).await.expect("mark dead");
    assert_eq!(won, ids(claim));
}

/// Whether row `id`'s lease has run out by the database clock, seen with the lease and the
/// clock.
async fn lease_expired(conn: &mut AsyncPgConnection, id: i64) -> Seen {
    #[derive(QueryableByName, Debug)]
    #[allow(dead_code)] // Read through `Debug`, in the message of a wait that runs out.
    struct Lease {
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = Text)]
        lease_until: String,
        #[diesel(sql_type = Text)]
        now: String,
        #[diesel(sql_type = Bool)]
        expired: bool,
    }
    let lease: Lease = diesel::sql_query(
        "SELECT id, coalesce(lease_until::text, 'none') AS lease_until, now()::text AS now,
                coalesce(lease_until < now(), false) AS expired FROM outbox WHERE id = $1",
    )
    .bind::<BigInt, _>(id)
    .get_result(conn)
    .await
    .expect("lease");
    saw(lease, |l| l.expired)
}

fn blocked_summary(blocked: &[BlockedAggregate]) -> Vec<(String, i64, i64)> {
    blocked.iter().map(|b| (b.aggregate_id.clone(), b.dead_id, b.waiting)).collect()
}

// (a)
#[actix_rt::test]
async fn first_claim_returns_only_each_aggregates_head_and_the_next_follows_when_it_is_done() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let t = "test.happened";
    // Interleaved, so that id order alone would hand out the tails too.
    let ids_in =
        insert(&mut conn, &[("test", "X", t), ("test", "Y", t), ("test", "X", t), ("test", "Y", t), ("test", "X", t)])
            .await;
    let [x1, y1, x2, y2, x3] = ids_in[..] else { panic!("5 ids") };
    let fifo = Fifo::All;

    let first = claim(&mut conn, "w1", &fifo).await;
    assert_eq!(ids(&first), vec![x1, y1], "only the head of each aggregate");
    assert!(first.messages.iter().all(|m| m.lease_version == 1 && m.attempts == 1));
    assert_eq!(ids(&claim(&mut conn, "w2", &fifo).await), Vec::<i64>::new(), "tails wait while heads are processing");

    done(&mut conn, &[first.messages[0].fence()]).await;
    let second = claim(&mut conn, "w2", &fifo).await;
    assert_eq!(ids(&second), vec![x2], "X's next row follows once X's head is done; Y's head is still processing");

    done(&mut conn, &[first.messages[1].fence()]).await;
    let third = claim(&mut conn, "w1", &fifo).await;
    assert_eq!(ids(&third), vec![y2]);

    done(&mut conn, &fences(&second)).await;
    let fourth = claim(&mut conn, "w3", &fifo).await;
    assert_eq!(ids(&fourth), vec![x3]);
    done(&mut conn, &fences(&third)).await;
    done(&mut conn, &fences(&fourth)).await;
    assert!(claim(&mut conn, "w1", &fifo).await.messages.is_empty());
    assert_eq!(db.count_status("done").await, 5);
    assert!(db.rows().await.iter().all(|r| r.lease_version == 1 && r.attempts == 1), "each row claimed exactly once");
}

#[actix_rt::test]
async fn without_the_gate_every_ready_row_is_claimed() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let x = db.seed(3, "X").await;
    let y = db.seed(2, "Y").await;
    let all = claim(&mut conn, "w1", &Fifo::Off).await;
    assert_eq!(ids(&all), [x, y].concat());
}

#[actix_rt::test]
async fn an_aggregate_is_its_type_and_id() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let rows = insert(
        &mut conn,
        &[("order", "42", "order.created"), ("customer", "42", "customer.created"), ("order", "42", "order.paid")],
    )
    .await;
    let first = claim(&mut conn, "w1", &Fifo::All).await;
    assert_eq!(ids(&first), vec![rows[0], rows[1]], "customer/42 does not wait for order/42");
}

#[actix_rt::test]
async fn a_head_waiting_for_its_backoff_blocks_its_tail() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let x = db.seed(2, "X").await;
    let first = claim(&mut conn, "w1", &Fifo::All).await;
    assert_eq!(ids(&first), vec![x[0]]);
    let back = actix_outbox::testing::reschedule(
        &mut conn,
        &[Reschedule {
            fence: first.messages[0].fence(),
            delay: Duration::from_secs(3600),
            error: "retryable (attempt 1): broker away".into(),
            refund_attempt: false,
            dead_if_older_than: None,
        }],
    )
    .await
    .unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].status, Status::Pending);
    assert!(claim(&mut conn, "w1", &Fifo::All).await.messages.is_empty(), "the tail waits for the head's retry");

    db.make_available().await;
    let retry = claim(&mut conn, "w2", &Fifo::All).await;
    assert_eq!(ids(&retry), vec![x[0]], "the head again, not the tail");
    assert_eq!((retry.messages[0].lease_version, retry.messages[0].attempts), (2, 2));
}

/// A gated dispatcher (4 workers, batch 10) over `ids`, whose sink publishes earlier rows
/// slower: without the gate, a batch published concurrently would reach the channel (and be
/// finalized) out of order.
fn gated_with_earlier_rows_slower(
    db: &TestDb,
    ids: &[i64],
    owner: &str,
    base: DispatcherConfig,
) -> (Addr<OutboxSupervisor>, UnboundedReceiver<Arc<OutboxMessage>>) {
    let last = *ids.last().unwrap();
    let (sink, rx) = ChannelSink::new();
    let sink = sink.with_script(move |m| SinkAction::Stall(Duration::from_millis(((last - m.id) % 4 * 3) as u64)));
    let config = base
        .workers(4)
        .batch(10)
        .poll_interval(Duration::from_millis(20))
        .owner(format!("{owner}-{}", db.name))
        .fifo(Fifo::All);
    (OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap(), rx)
}

// (b)
#[actix_rt::test]
async fn thirty_rows_of_one_aggregate_through_four_workers_finalize_in_id_order() {
    let db = TestDb::new().await;
    let seeded = db.seed(30, "X").await;
    let (dispatcher, mut rx) = gated_with_earlier_rows_slower(&db, &seeded, "fifo-b", DispatcherConfig::default());

    let received = receive(&mut rx, seeded.len()).await;
    assert_eq!(received.iter().map(|m| m.id).collect::<Vec<_>>(), seeded, "publish order is id order");
    eventually(WITHIN, "all 30 rows done", || async { saw(db.count_status("done").await, |v| *v == 30) }).await;
    dispatcher.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
    assert!(rx.try_recv().is_err(), "no message was published twice");

    let mut rows = db.rows().await;
    assert!(rows.iter().all(|r| r.attempts == 1 && r.lease_version == 1), "one claim per row");
    rows.sort_by_key(|r| r.done_at.expect("done_at"));
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), seeded, "finalize order is id order");
    for pair in rows.windows(2) {
        assert!(pair[0].done_at < pair[1].done_at, "row {} finalized no later than row {}", pair[1].id, pair[0].id);
    }
}

/// Under the gate a claim comes back short while rows wait behind their heads; the worker must
/// not then sit out its poll interval once per row. With a 60 s poll interval, 10 rows of one
/// aggregate arrive only if each finished publish triggers the next claim.
#[actix_rt::test]
async fn a_finished_head_triggers_the_next_claim_without_waiting_for_the_poll_interval() {
    let db = TestDb::new().await;
    let seeded = db.seed(10, "X").await;
    let (sink, mut rx) = ChannelSink::new();
    let config = DispatcherConfig::default()
        .workers(2)
        .poll_interval(Duration::from_secs(60))
        .owner(format!("fifo-trigger-{}", db.name))
        .fifo(Fifo::All);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
    let mut received = Vec::new();
    while received.len() < seeded.len() {
        // Far below one poll interval: only the trigger can deliver the next row in time.
        match tokio::time::timeout(Duration::from_secs(15), rx.recv()).await {
            Ok(Some(m)) => received.push(m.id),
            other => panic!("row {} of 10 did not follow ({other:?}): received {received:?}", received.len() + 1),
        }
    }
    assert_eq!(received, seeded);
    dispatcher.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
}

async fn receive(rx: &mut UnboundedReceiver<Arc<OutboxMessage>>, n: usize) -> Vec<Arc<OutboxMessage>> {
    let mut received = Vec::with_capacity(n);
    while received.len() < n {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(m)) => received.push(m),
            Ok(None) => panic!("sink channel closed after {} messages", received.len()),
            Err(_) => panic!("timed out after {} of {n} messages", received.len()),
        }
    }
    received
}

// (c)
#[actix_rt::test]
async fn a_dead_head_blocks_its_tail_until_retried_or_skipped() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let t = "test.happened";
    let rows = insert(
        &mut conn,
        &[("test", "A", t), ("test", "B", t), ("test", "A", t), ("test", "B", t), ("test", "A", t), ("test", "B", t)],
    )
    .await;
    let [a1, b1, a2, b2, a3, _b3] = rows[..] else { panic!("6 ids") };

    let heads = claim(&mut conn, "w1", &Fifo::All).await;
    assert_eq!(ids(&heads), vec![a1, b1]);
    bury(&mut conn, &heads, "permanent: boom").await;
    assert!(claim(&mut conn, "w1", &Fifo::All).await.messages.is_empty(), "both aggregates blocked");

    let blocked = blocked_aggregates(&mut conn, &Fifo::All, 100).await.unwrap();
    assert_eq!(blocked_summary(&blocked), vec![("A".into(), a1, 2), ("B".into(), b1, 2)]);
    assert_eq!(blocked[0].aggregate_type, "test");
    assert_eq!(blocked[0].event_type, t);
    assert_eq!(blocked[0].last_error.as_deref(), Some("permanent: boom"));
    assert_eq!(blocked[0].attempts, 1);
    assert!(blocked_aggregates(&mut conn, &Fifo::Off, 100).await.unwrap().is_empty(), "no gate, nothing blocked");

    // Way out 1: retry the head.
    assert_eq!(dead_retry(&mut conn, &[a1]).await.unwrap(), vec![a1]);
    let row = db.row(a1).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 0));
    let retried = claim(&mut conn, "w2", &Fifo::All).await;
    assert_eq!(ids(&retried), vec![a1], "the retried head first, its tail still waits");
    assert_eq!((retried.messages[0].lease_version, retried.messages[0].attempts), (2, 1));
    assert_eq!(
        blocked_summary(&blocked_aggregates(&mut conn, &Fifo::All, 100).await.unwrap()),
        vec![("B".into(), b1, 2)]
    );
    done(&mut conn, &fences(&retried)).await;
    let next = claim(&mut conn, "w2", &Fifo::All).await;
    assert_eq!(ids(&next), vec![a2], "A moves again; B stays blocked");

    // Way out 2: skip the head.
    let reason = "poison payload, accepted gap (OPS-7)";
    assert_eq!(dead_skip(&mut conn, &[b1], reason).await.unwrap(), vec![b1]);
    let skipped = db.row(b1).await;
    assert_eq!(skipped.status, Status::Done);
    assert!(skipped.done_at.is_some());
    assert_eq!(
        skipped.last_error.as_deref(),
        Some(format!("{}{reason} (was: permanent: boom)", actix_outbox::admin::SKIPPED_PREFIX).as_str())
    );
    let after_skip = claim(&mut conn, "w3", &Fifo::All).await;
    assert_eq!(ids(&after_skip), vec![b2], "B's next row is the head now; A's next waits for {a2}");
    assert!(blocked_aggregates(&mut conn, &Fifo::All, 100).await.unwrap().is_empty());
    done(&mut conn, &fences(&next)).await;
    assert_eq!(ids(&claim(&mut conn, "w3", &Fifo::All).await), vec![a3]);
}

// (d)
#[actix_rt::test]
async fn a_crashed_workers_head_is_reclaimed_and_its_tail_waits_until_the_head_is_done() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let x = db.seed(3, "X").await;
    let fifo = Fifo::All;

    // The crashed worker: claims the head with a short lease and never finalizes it.
    let short = ClaimParams { lease: Duration::from_millis(200), ..params("crashed", &fifo) };
    let crashed = actix_outbox::testing::claim(&mut conn, &short).await.unwrap();
    assert_eq!(ids(&crashed), vec![x[0]]);
    let stale = crashed.messages[0].fence();
    assert_eq!(stale.lease_version, 1);
    assert!(claim(&mut conn, "rescuer", &fifo).await.messages.is_empty(), "nothing while the lease runs");

    eventually(WITHIN, "the crashed worker's lease to expire", || async {
        lease_expired(&mut db.conn().await, x[0]).await
    })
    .await;
    let rescued = claim(&mut conn, "rescuer", &fifo).await;
    assert_eq!(ids(&rescued), vec![x[0]], "the head is reclaimed, the tail is not claimed with it");
    assert_eq!((rescued.messages[0].lease_version, rescued.messages[0].attempts), (2, 2));
    assert_eq!(db.row(x[0]).await.lease_owner.as_deref(), Some("rescuer"));
    assert!(claim(&mut conn, "other", &fifo).await.messages.is_empty(), "the tail waits for the reclaimed head");

    // The crashed worker's late finalize is fenced off and unblocks nothing.
    assert_eq!(mark_done(&mut conn, &[stale]).await.unwrap(), Vec::<i64>::new());
    assert_eq!(db.row(x[0]).await.status, Status::Processing);
    assert!(claim(&mut conn, "other", &fifo).await.messages.is_empty());

    done(&mut conn, &fences(&rescued)).await;
    let tail = claim(&mut conn, "other", &fifo).await;
    assert_eq!(ids(&tail), vec![x[1]]);
    assert_eq!(tail.messages[0].lease_version, 1);
}

/// The expired-lease branch is gated too: rows a dispatcher without the gate left processing
/// (both X rows at once) come back one head at a time.
#[actix_rt::test]
async fn expired_leases_are_reclaimed_one_head_at_a_time() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let x = db.seed(2, "X").await;
    let unordered = ClaimParams { lease: Duration::from_millis(200), ..params("no-gate", &Fifo::Off) };
    assert_eq!(ids(&actix_outbox::testing::claim(&mut conn, &unordered).await.unwrap()), x);

    for id in [x[1], x[0]] {
        eventually(WITHIN, "both leases to expire", || async { lease_expired(&mut db.conn().await, id).await }).await;
    }
    let reclaimed = claim(&mut conn, "gated", &Fifo::All).await;
    assert_eq!(ids(&reclaimed), vec![x[0]], "the tail's expired lease waits for the head");
    assert_eq!(reclaimed.messages[0].lease_version, 2);
    done(&mut conn, &fences(&reclaimed)).await;
    let tail = claim(&mut conn, "gated", &Fifo::All).await;
    assert_eq!(ids(&tail), vec![x[1]]);
    assert_eq!(tail.messages[0].lease_version, 2);
}

#[actix_rt::test]
async fn the_reaper_works_under_the_gate_and_a_reaped_head_keeps_blocking() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let x = db.seed(3, "X").await;
    let fifo = Fifo::All;
    let last_chance = ClaimParams { lease: Duration::from_millis(200), max_attempts: 1, ..params("crashed", &fifo) };
    let crashed = actix_outbox::testing::claim(&mut conn, &last_chance).await.unwrap();
    assert_eq!(ids(&crashed), vec![x[0]]);

    eventually(WITHIN, "the lease to expire", || async { lease_expired(&mut db.conn().await, x[0]).await }).await;
    assert_eq!(sweep(&mut conn, 1).await.reaped, vec![crashed.messages[0].fence()]);
    assert_eq!(db.row(x[0]).await.status, Status::Dead);
    assert!(claim(&mut conn, "w", &fifo).await.messages.is_empty(), "a reaped head blocks like any dead row");

    let blocked = blocked_aggregates(&mut conn, &fifo, 10).await.unwrap();
    assert_eq!(blocked_summary(&blocked), vec![("X".into(), x[0], 2)]);
    let why = blocked[0].last_error.as_deref().unwrap();
    assert!(why.starts_with("reaped: lease expired after 1 of 1 attempts"), "{why}");
}

// (e)
#[actix_rt::test]
async fn with_the_gate_limited_to_some_types_unordered_events_of_a_blocked_aggregate_flow() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let fifo = Fifo::event_types(["order.created", "order.paid"]);

    // A's ordered head and B's unordered row go dead.
    let first = insert(&mut conn, &[("order", "A", "order.created"), ("order", "B", "email.sent")]).await;
    let heads = claim(&mut conn, "w1", &fifo).await;
    assert_eq!(ids(&heads), first);
    bury(&mut conn, &heads, "permanent: rejected").await;

    let later = insert(
        &mut conn,
        &[
            ("order", "A", "email.sent"),    // unordered, behind A's dead ordered head
            ("order", "A", "order.paid"),    // ordered: blocked by order.created
            ("order", "A", "email.sent"),    // unordered
            ("order", "B", "order.created"), // ordered, behind a dead unordered row
            ("order", "C", "email.sent"),    // unordered, in backoff
            ("order", "C", "order.created"), // ordered, behind an unfinished unordered row
        ],
    )
    .await;
    let [a_email1, a_paid, a_email2, b_created, c_email, c_created] = later[..] else { panic!("6 ids") };
    db.conn()
        .await
        .batch_execute(&format!("UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = {c_email}"))
        .await
        .unwrap();

    let flowing = claim(&mut conn, "w2", &fifo).await;
    assert_eq!(
        ids(&flowing),
        vec![a_email1, a_email2, b_created, c_created],
        "unordered rows of blocked A flow; ordered rows wait only for ordered rows"
    );

    let blocked = blocked_aggregates(&mut conn, &fifo, 10).await.unwrap();
    assert_eq!(blocked_summary(&blocked), vec![("A".into(), first[0], 1)], "only order.paid waits; B is not blocked");
    let blocked_if_all = blocked_aggregates(&mut conn, &Fifo::All, 10).await.unwrap();
    assert_eq!(blocked_summary(&blocked_if_all), vec![("A".into(), first[0], 3), ("B".into(), first[1], 1)]);

    done(&mut conn, &fences(&flowing)).await;
    assert!(claim(&mut conn, "w2", &fifo).await.messages.is_empty(), "order.paid still waits for order.created");
    assert_eq!(dead_retry(&mut conn, &[first[0]]).await.unwrap(), vec![first[0]]);
    let retried = claim(&mut conn, "w3", &fifo).await;
    assert_eq!(ids(&retried), vec![first[0]]);
    done(&mut conn, &fences(&retried)).await;
    assert_eq!(ids(&claim(&mut conn, "w3", &fifo).await), vec![a_paid]);
}

// (f)
#[actix_rt::test]
async fn many_aggregates_through_two_dispatchers_reach_the_sink_in_id_order_per_aggregate() {
    const AGGREGATES: usize = 25;
    const ROWS: usize = 12;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Round robin, so that every claim sees many aggregates' rows mixed together.
    let names: Vec<String> = (0..AGGREGATES).map(|a| format!("agg-{a:02}")).collect();
    let plan: Vec<(&str, &str, &str)> =
        (0..AGGREGATES * ROWS).map(|i| ("test", names[i % AGGREGATES].as_str(), "test.happened")).collect();
    let seeded = insert(&mut conn, &plan).await;
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (id, (_, agg, _)) in seeded.iter().zip(&plan) {
        expected.entry((*agg).to_owned()).or_default().push(*id);
    }

    let (sink, mut rx) = ChannelSink::new();
    let sink = sink.with_script(|m| SinkAction::Stall(Duration::from_millis((m.id % 3) as u64)));
    let config = |owner: &str| {
        DispatcherConfig::default()
            .workers(2)
            .batch(10)
            .poll_interval(Duration::from_millis(20))
            .owner(format!("{owner}-{}", db.name))
            .fifo(Fifo::All)
    };
    // The gate's index built first, as `migrate --fifo` does before a deployment's dispatchers
    // start: otherwise the second waits for the first one's build while the first takes it all.
    actix_outbox::admin::ensure_fifo_index(&mut conn).await.unwrap();
    let one = OutboxSupervisor::start(config("dispatcher-1"), db.pool.clone(), sink.clone()).unwrap();
    let pool_two = actix_outbox::connect_pool(&db.url, 8).await.unwrap();
    let two = OutboxSupervisor::start(config("dispatcher-2"), pool_two, sink).unwrap();

    let received = receive(&mut rx, seeded.len()).await;
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in &received {
        seen.entry(m.aggregate_id.clone()).or_default().push(m.id);
    }
    assert_eq!(seen, expected, "per aggregate, the sink received every row once, in id order");
    eventually(WITHIN, "all rows done", || async { saw(db.count_status("done").await, |v| *v == seeded.len() as i64) })
        .await;
    let (m1, m2) = (
        one.send(actix_outbox::dispatcher::GetMetrics).await.unwrap(),
        two.send(actix_outbox::dispatcher::GetMetrics).await.unwrap(),
    );
    assert_eq!(m1.claimed + m2.claimed, seeded.len() as u64, "no row claimed twice");
    assert!(m1.claimed > 0 && m2.claimed > 0, "both dispatchers took part ({} / {})", m1.claimed, m2.claimed);
    one.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
    two.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
}

// Producer discipline.
#[actix_rt::test]
async fn enqueue_ordered_serialises_the_writers_of_one_aggregate() {
    let db = TestDb::new().await;
    let (mut first, mut second) = (db.conn().await, db.conn().await);
    let second_pid = backend_pid(&mut second).await;
    let event = |n: i32| NewEvent::new("order", "42", "order.changed", serde_json::json!({"n": n}));

    AnsiTransactionManager::begin_transaction(&mut first).await.unwrap();
    let a1 = enqueue_ordered(&mut first, &event(1)).await.unwrap();

    let writer = actix_rt::spawn(async move {
        AnsiTransactionManager::begin_transaction(&mut second).await.unwrap();
        let id = enqueue_ordered(&mut second, &event(2)).await.unwrap();
        AnsiTransactionManager::commit_transaction(&mut second).await.unwrap();
        id
    });
    eventually(WITHIN, "the second writer to wait for the aggregate's lock", || async {
        saw(advisory_lock_waits(&mut db.conn().await, second_pid).await, |v| *v == 1)
    })
    .await;
    assert!(!writer.is_finished(), "the second writer must not insert while the first is open");

    // The first transaction goes on writing the aggregate while the second waits.
    let a2 = enqueue_ordered(&mut first, &event(3)).await.unwrap();
    AnsiTransactionManager::commit_transaction(&mut first).await.unwrap();
    let b = writer.await.unwrap();
    assert!(a1 < a2 && a2 < b, "ids follow commit order: {a1}, {a2} committed before {b} was drawn");
    assert_eq!(advisory_lock_waits(&mut db.conn().await, second_pid).await, 0);
}

#[actix_rt::test]
async fn enqueue_ordered_does_not_hold_back_other_aggregates() {
    let db = TestDb::new().await;
    let (mut first, mut second) = (db.conn().await, db.conn().await);
    AnsiTransactionManager::begin_transaction(&mut first).await.unwrap();
    enqueue_ordered(&mut first, &NewEvent::new("order", "42", "order.paid", serde_json::json!({}))).await.unwrap();

    AnsiTransactionManager::begin_transaction(&mut second).await.unwrap();
    let other = NewEvent::new("order", "43", "order.paid", serde_json::json!({}));
    // A guard against hanging, not a measurement: the lock of order/43 is free.
    tokio::time::timeout(Duration::from_secs(10), enqueue_ordered(&mut second, &other))
        .await
        .expect("order/43 must not wait for order/42's lock")
        .unwrap();
    AnsiTransactionManager::commit_transaction(&mut second).await.unwrap();
    AnsiTransactionManager::commit_transaction(&mut first).await.unwrap();
    assert_eq!(db.rows().await.len(), 2);
}

#[actix_rt::test]
async fn enqueue_ordered_refuses_to_run_outside_a_transaction() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let result = enqueue_ordered(&mut conn, &NewEvent::new("order", "42", "order.paid", serde_json::json!({}))).await;
    assert!(matches!(result, Err(StoreError::OutsideTransaction(_))), "{result:?}");
    assert!(db.rows().await.is_empty(), "nothing written");
}

/// Why the producer lock exists: with plain `enqueue`, a later id of the aggregate can commit
/// while an earlier one is still open, and the gate then hands the later one out as the head.
#[actix_rt::test]
async fn without_the_producer_lock_a_later_id_can_be_claimed_first() {
    let db = TestDb::new().await;
    let (mut first, mut second, mut dispatcher) = (db.conn().await, db.conn().await, db.conn().await);
    let event = || NewEvent::new("order", "42", "order.changed", serde_json::json!({}));
    AnsiTransactionManager::begin_transaction(&mut first).await.unwrap();
    let early = enqueue(&mut first, &event()).await.unwrap();
    AnsiTransactionManager::begin_transaction(&mut second).await.unwrap();
    let late = tokio::time::timeout(Duration::from_secs(10), enqueue(&mut second, &event())).await.unwrap().unwrap();
    AnsiTransactionManager::commit_transaction(&mut second).await.unwrap();

    assert!(early < late);
    let claimed = claim(&mut dispatcher, "w", &Fifo::All).await;
    assert_eq!(ids(&claimed), vec![late], "the gate cannot see the uncommitted earlier row");
    AnsiTransactionManager::commit_transaction(&mut first).await.unwrap();
}

async fn backend_pid(conn: &mut AsyncPgConnection) -> i32 {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Int4)]
        pid: i32,
    }
    let pid: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid").get_result(conn).await.unwrap();
    pid.pid
}

/// Advisory locks backend `pid` is waiting for.
async fn advisory_lock_waits(conn: &mut AsyncPgConnection, pid: i32) -> i64 {
    #[derive(QueryableByName)]
    struct Waits {
        #[diesel(sql_type = Int8)]
        n: i64,
    }
    let waits: Waits = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted",
    )
    .bind::<diesel::sql_types::Int4, _>(pid)
    .get_result(conn)
    .await
    .unwrap();
    waits.n
}

// The index: only where the gate is used.
#[actix_rt::test]
async fn the_migrations_leave_the_gate_index_out_and_its_migration_reverts() {
    let db = TestDb::new().await;
    assert_eq!(fifo_indexes(&db).await, Vec::<String>::new(), "no gate index without the gate");
    let url = db.url.clone();
    tokio::task::spawn_blocking(move || {
        use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
        use diesel_migrations::MigrationHarness;
        let mut conn: AsyncConnectionWrapper<AsyncPgConnection> = diesel::Connection::establish(&url).unwrap();
        let migrations =
            diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::admin::MIGRATIONS).unwrap();
        let gate = migrations
            .iter()
            .find(|m| m.name().to_string().ends_with("_fifo_index_only_with_fifo"))
            .expect("the migration that drops the gate index");
        conn.revert_migration(gate.as_ref()).expect("down.sql runs");
    })
    .await
    .unwrap();
    assert_eq!(fifo_indexes(&db).await, vec!["outbox_fifo_gate".to_owned()], "down restores the index");
    actix_outbox::migrate(&db.url).await.expect("up again");
    assert_eq!(fifo_indexes(&db).await, Vec::<String>::new());
}

#[actix_rt::test]
async fn ensure_fifo_index_builds_it_once_among_concurrent_callers() {
    let db = TestDb::new().await;
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(db.conn().await);
    }
    let built = futures_util::future::join_all(conns.iter_mut().map(actix_outbox::admin::ensure_fifo_index)).await;
    let built: Vec<bool> = built.into_iter().map(|b| b.expect("ensure_fifo_index")).collect();
    assert_eq!(built.iter().filter(|b| **b).count(), 1, "exactly one caller builds: {built:?}");
    assert_eq!(fifo_indexes(&db).await, vec!["outbox_fifo_gate".to_owned()]);
    assert_eq!(fifo_index_valid(&db).await, Some(true));
    assert!(!actix_outbox::admin::ensure_fifo_index(&mut db.conn().await).await.unwrap(), "there already");
}

#[actix_rt::test]
async fn ensure_fifo_index_rebuilds_an_invalid_one() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    assert!(actix_outbox::admin::ensure_fifo_index(&mut conn).await.unwrap());
    // What a CREATE INDEX CONCURRENTLY that failed half-way leaves: the index, marked invalid.
    conn.batch_execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'outbox_fifo_gate'::regclass")
        .await
        .unwrap();
    assert_eq!(fifo_index_valid(&db).await, Some(false));
    assert!(actix_outbox::admin::ensure_fifo_index(&mut conn).await.unwrap(), "an invalid index is built again");
    assert_eq!(fifo_index_valid(&db).await, Some(true));
}

#[actix_rt::test]
async fn a_dispatcher_builds_the_gate_index_only_with_the_gate_on() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for (round, fifo) in [Fifo::Off, Fifo::All].into_iter().enumerate() {
        let gated = fifo.is_on();
        let seeded = insert(&mut conn, &[("order", "1", "order.created"), ("order", "1", "order.paid")]).await;
        let (sink, mut rx) = ChannelSink::new();
        let config = DispatcherConfig::default().workers(2).owner(format!("fifo-index-{round}-{}", db.name)).fifo(fifo);
        let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink).unwrap();
        let mut received: Vec<i64> = receive(&mut rx, seeded.len()).await.iter().map(|m| m.id).collect();
        if !gated {
            // Two publishes at once: either may reach the sink first.
            received.sort_unstable();
        }
        assert_eq!(received, seeded, "under the gate in id order");
        eventually(WITHIN, "both rows done", || async {
            saw(db.count_status("done").await, |v| *v == 2 * (round as i64 + 1))
        })
        .await;
        dispatcher.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
        let expected: Vec<String> = if round == 0 { vec![] } else { vec!["outbox_fifo_gate".to_owned()] };
        assert_eq!(fifo_indexes(&db).await, expected, "the gate {} builds its index", ["off never", "on"][round]);
    }
    assert_eq!(fifo_index_valid(&db).await, Some(true));
}

async fn fifo_index_valid(db: &TestDb) -> Option<bool> {
    #[derive(QueryableByName)]
    struct Valid {
        #[diesel(sql_type = diesel::sql_types::Nullable<Bool>)]
        valid: Option<bool>,
    }
    let row: Valid = diesel::sql_query(
        "SELECT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('outbox_fifo_gate')) AS valid",
    )
    .get_result(&mut db.conn().await)
    .await
    .unwrap();
    row.valid
}

async fn fifo_indexes(db: &TestDb) -> Vec<String> {
    #[derive(QueryableByName)]
    struct Index {
        #[diesel(sql_type = Text)]
        indexname: String,
    }
    let rows: Vec<Index> = diesel::sql_query(
        "SELECT indexname FROM pg_indexes WHERE tablename = 'outbox' AND indexname LIKE 'outbox_fifo%' ORDER BY 1",
    )
    .load(&mut db.conn().await)
    .await
    .unwrap();
    rows.into_iter().map(|r| r.indexname).collect()
}

#[actix_rt::test]
async fn explain_claim_with_analyze_runs_the_claim_and_rolls_it_back() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    db.seed(3, "X").await;
    let plan = actix_outbox::testing::explain_claim(&mut conn, &params("explain", &Fifo::All), true).await.unwrap();
    let text = plan.join("\n");
    assert!(text.contains("actual time="), "{text}");
    assert_eq!(db.count_status("pending").await, 3, "rolled back");
    assert!(db.rows().await.iter().all(|r| r.lease_version == 0 && r.attempts == 0));

    let estimate =
        actix_outbox::testing::explain_claim(&mut conn, &params("explain", &Fifo::event_types(["x"])), false)
            .await
            .unwrap();
    assert!(!estimate.join("\n").contains("actual time="));
}

// (f) at a real RabbitMQ consumer.
/// 50 aggregates × 20 rows through 4 workers in 2 dispatchers, each with a RabbitMQ connection
/// of its own: per aggregate, the order of the messages in the consumer's queue is id order.
/// (Each head is confirmed by the broker before it is finalized, and its successor is claimed
/// only after that, so the queue receives an aggregate's messages one after the other.)
#[actix_rt::test]
async fn rabbitmq_consumer_sees_each_aggregates_messages_in_id_order() {
    use actix_outbox::sink::{RabbitConfig, RabbitSink};
    use futures_util::StreamExt;
    use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;

    const AGGREGATES: usize = 50;
    const ROWS: usize = 20;
    let db = TestDb::new().await;
    // Declared as the sink declares it (durable topic), so that the queue is bound before any
    // publish.
    let (broker, queue) = TestBroker::with_queue("fifo").await;
    let channel = &broker.channel;

    let mut conn = db.conn().await;
    let names: Vec<String> = (0..AGGREGATES).map(|a| format!("agg-{a:02}")).collect();
    let plan: Vec<(&str, &str, &str)> =
        (0..AGGREGATES * ROWS).map(|i| ("order", names[i % AGGREGATES].as_str(), "order.changed")).collect();
    let seeded = insert(&mut conn, &plan).await;
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (id, (_, agg, _)) in seeded.iter().zip(&plan) {
        expected.entry((*agg).to_owned()).or_default().push(*id);
    }

    let config = |owner: &str| {
        DispatcherConfig::default()
            .workers(2)
            .batch(25)
            .poll_interval(Duration::from_millis(20))
            .owner(format!("{owner}-{}", db.name))
            .fifo(Fifo::All)
    };
    let sink = || async { RabbitSink::connect(RabbitConfig::new(amqp_url()).exchange(&broker.exchange)).await };
    let (sink_one, sink_two) = (sink().await.unwrap(), sink().await.unwrap());
    // The gate's index built first, as `migrate --fifo` does before a deployment's dispatchers
    // start: otherwise the second waits for the first one's build while the first takes it all.
    actix_outbox::admin::ensure_fifo_index(&mut conn).await.unwrap();
    let one = OutboxSupervisor::start(config("rabbit-1"), db.pool.clone(), sink_one.clone()).unwrap();
    let two = OutboxSupervisor::start(
        config("rabbit-2"),
        actix_outbox::connect_pool(&db.url, 8).await.unwrap(),
        sink_two.clone(),
    )
    .unwrap();
    eventually(WITHIN, "all 1000 rows done", || async {
        saw(db.count_status("done").await, |v| *v == seeded.len() as i64)
    })
    .await;
    let (m1, m2) = (
        one.send(actix_outbox::dispatcher::GetMetrics).await.unwrap(),
        two.send(actix_outbox::dispatcher::GetMetrics).await.unwrap(),
    );
    one.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
    two.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
    sink_one.close().await;
    sink_two.close().await;
    assert_eq!(m1.published + m2.published, seeded.len() as u64, "one publish per row");
    assert!(m1.published > 0 && m2.published > 0, "both dispatchers took part ({} / {})", m1.published, m2.published);

    let options = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
    let mut consumer = channel
        .basic_consume(queue.as_str().into(), "fifo-check".into(), options, FieldTable::default())
        .await
        .unwrap();
    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for n in 0..seeded.len() {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {n} of {} messages reached the consumer", seeded.len()))
            .expect("consumer ended")
            .expect("delivery");
        let id: i64 = delivery.properties.message_id().as_ref().expect("message_id").as_str().parse().unwrap();
        let body: serde_json::Value = serde_json::from_slice(&delivery.data).unwrap();
        seen.entry(body["agg"].as_str().unwrap().to_owned()).or_default().push(id);
    }
    assert_eq!(seen, expected, "per aggregate, the consumer received every row once, in id order");
    let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    let left = channel.queue_declare(queue.as_str().into(), passive, FieldTable::default()).await.unwrap();
    assert_eq!(left.message_count(), 0, "no duplicate left in the queue");
}

/// When the oldest pending rows all wait behind their aggregate's row in flight, the claim
/// still finds the heads of other aggregates further on (the skip scan over aggregates), in
/// claim order, and never a row behind an unfinished one.
#[tokio::test]
async fn heads_beyond_a_blocked_backlog_are_found() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let fifo = Fifo::All;
    // Aggregate `hot` has 30 rows; `b` and `c` one each, after all of them.
    let hot: Vec<(&str, &str, &str)> = vec![("order", "hot", "e"); 30];
    let hot_ids = insert(&mut conn, &hot).await;
    let later = insert(&mut conn, &[("order", "c", "e"), ("order", "b", "e")]).await;
    let small = |batch| ClaimParams { batch, ..params("A", &fifo) };

    let first = actix_outbox::testing::claim(&mut conn, &small(1)).await.unwrap();
    assert_eq!(ids(&first), vec![hot_ids[0]], "the oldest head first");
    // Batch 2: the walk looks at the 8 oldest pending rows, all behind `hot`'s first row.
    let second = actix_outbox::testing::claim(&mut conn, &small(2)).await.unwrap();
    assert_eq!(ids(&second), later, "`c` and `b` head their aggregates");
    let third = actix_outbox::testing::claim(&mut conn, &small(2)).await.unwrap();
    assert!(third.messages.is_empty(), "every pending row waits: {:?}", ids(&third));

    done(&mut conn, &fences(&first)).await;
    let fourth = actix_outbox::testing::claim(&mut conn, &small(2)).await.unwrap();
    assert_eq!(ids(&fourth), vec![hot_ids[1]], "only `hot`'s next row");
}

/// The scan for free heads visits at most `4 × batch` aggregates per claim and the next claim
/// goes on after the last one visited, so a free head far along the aggregates is reached in
/// turn, and the scan starts over after the last aggregate.
#[tokio::test]
async fn the_heads_scan_takes_turns_over_the_aggregates() {
    use actix_outbox::testing::{AggregateKey, HeadsScan};

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let fifo = Fifo::All;
    // agg-0 .. agg-8: a head then a second row each; agg-9's only row comes last.
    let keys: Vec<String> = (0..10).map(|i| format!("agg-{i}")).collect();
    let heads: Vec<(&str, &str, &str)> = keys[..9].iter().map(|k| ("order", k.as_str(), "e")).collect();
    insert(&mut conn, &heads).await;
    insert(&mut conn, &heads).await;
    let free = insert(&mut conn, &[("order", "agg-9", "e")]).await;
    let taken = actix_outbox::testing::claim(&mut conn, &ClaimParams { batch: 9, ..params("A", &fifo) }).await.unwrap();
    assert_eq!(taken.messages.len(), 9, "the nine heads are now in flight");

    let key = |i: usize| AggregateKey { aggregate_type: "order".into(), aggregate_id: keys[i].clone() };
    // Batch 1: the walk sees 4 blocked rows, then the scan visits 4 aggregates per claim.
    let mut after: Option<AggregateKey> = None;
    let mut scans = Vec::new();
    let mut claimed = Vec::new();
    for _ in 0..4 {
        let p = ClaimParams { batch: 1, heads_after: after.as_ref(), ..params("B", &fifo) };
        let c = actix_outbox::testing::claim(&mut conn, &p).await.unwrap();
        claimed.push(ids(&c));
        after = match &c.heads {
            HeadsScan::StoppedAfter(k) => Some(k.clone()),
            HeadsScan::ReachedEnd | HeadsScan::NotRun => None,
        };
        scans.push(c.heads);
    }
    assert_eq!(
        scans,
        vec![
            HeadsScan::StoppedAfter(key(3)),
            HeadsScan::StoppedAfter(key(7)),
            HeadsScan::ReachedEnd,
            HeadsScan::StoppedAfter(key(3)),
        ]
    );
    assert_eq!(claimed, vec![vec![], vec![], free.clone(), vec![]], "agg-9's row on the third turn");
}

/// Under `Retention::Delete` the gate still admits an aggregate's rows one at a time in id
/// order (a head is in the table until its delete, which is what releases its tail), and the
/// table ends empty.
#[actix_rt::test]
async fn under_delete_retention_each_aggregate_still_publishes_in_id_order() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let rows: Vec<(&str, &str, &str)> =
        (0..24).map(|i| ("order", if i % 2 == 0 { "A" } else { "B" }, "order.changed")).collect();
    let ids = insert(&mut conn, &rows).await;
    let delete = DispatcherConfig::default().retention(actix_outbox::Retention::Delete);
    let (dispatcher, mut rx) = gated_with_earlier_rows_slower(&db, &ids, "fifo-delete", delete);

    let received = receive(&mut rx, ids.len()).await;
    eventually(WITHIN, "every row deleted", || async { saw(db.rows().await.len(), |left| *left == 0) }).await;
    dispatcher.send(actix_outbox::dispatcher::Shutdown).await.unwrap();
    assert!(rx.try_recv().is_err(), "no message was published twice");
    for aggregate in ["A", "B"] {
        let got: Vec<i64> = received.iter().filter(|m| m.aggregate_id == aggregate).map(|m| m.id).collect();
        let want: Vec<i64> = ids.iter().zip(&rows).filter(|(_, r)| r.1 == aggregate).map(|(id, _)| *id).collect();
        assert_eq!(got, want, "aggregate {aggregate} in id order");
    }
}
