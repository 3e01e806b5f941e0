//! The store against a real PostgreSQL: claims, takeovers, fencing, retries, deferral, poison rows, plus the
//! batch fences, the heartbeat, the producer and the schema.

use std::collections::HashSet;
use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::testing::ClaimParams;
use actix_outbox::testing::{Step, decide};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxMessage, PublishError};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use actix_outbox_test_support::{PATIENCE, TestDb, eventually, saw};

const LONG: Duration = Duration::from_secs(30);

/// A sweep, as the dispatcher runs one every second: rows whose lease expired go where the next
/// claim takes them over, or dead with no attempt left.
async fn sweep(conn: &mut AsyncPgConnection, max: i32) -> actix_outbox::testing::Swept {
    let params = actix_outbox::testing::SweepParams {
        max_attempts: max,
        chunk: 10_000,
        stray_after: Duration::from_secs(600),
        claimed_to: None,
    };
    // Another claim's sweep running at the same time does the same.
    actix_outbox::testing::sweep(conn, params).await.expect("sweep").unwrap_or_default()
}

/// A claim of every new row from the oldest (no cursor), after a sweep.
async fn claim(
    conn: &mut AsyncPgConnection,
    owner: &str,
    batch: usize,
    lease: Duration,
    max: i32,
) -> actix_outbox::testing::Claim {
    sweep(conn, max).await;
    actix_outbox::testing::claim(
        conn,
        &ClaimParams {
            owner,
            batch,
            max_bytes: usize::MAX,
            lease,
            max_attempts: max,
            fifo: &actix_outbox::Fifo::Off,
            cursor: None,
            heads_after: None,
        },
    )
    .await
    .expect("claim")
}

/// Applies the write that `outcome` calls for, as the finalize actor would; returns whether it won.
async fn finalize(
    conn: &mut AsyncPgConnection,
    message: &OutboxMessage,
    outcome: Result<(), PublishError>,
    config: &DispatcherConfig,
) -> bool {
    let won = match decide(message, &outcome, config) {
        Step::Done(f) => actix_outbox::testing::mark_done(conn, &[f]).await.unwrap(),
        Step::Reschedule(r) => {
            actix_outbox::testing::reschedule(conn, &[r]).await.unwrap().into_iter().map(|r| r.id).collect()
        }
        Step::Dead(b) => actix_outbox::testing::mark_dead(conn, &[b]).await.unwrap(),
    };
    won == [message.id]
}

fn fast_backoff(max_attempts: i32) -> DispatcherConfig {
    DispatcherConfig::default()
        .max_attempts(max_attempts)
        .backoff_base(Duration::from_millis(1))
        .backoff_cap(Duration::from_millis(2))
}

/// Waits until the database clock has passed every lease in the table.
async fn until_leases_expired(db: &TestDb) {
    eventually(PATIENCE, "leases expired", || async {
        let mut conn = db.conn().await;
        #[derive(QueryableByName)]
        struct Live {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let live: Live =
            diesel::sql_query("SELECT count(*) AS n FROM outbox WHERE status = 'processing' AND lease_until >= now()")
                .get_result(&mut conn)
                .await
                .unwrap();
        saw(live.n, |n| *n == 0)
    })
    .await;
}

/// Scenario 1: 4 workers on 4 connections claim 200 rows in batches of 7, concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_workers_claim_200_rows_without_overlap() {
    let db = TestDb::new().await;
    let seeded: HashSet<i64> = db.seed(200, "a").await.into_iter().collect();
    let mut tasks = Vec::new();
    for w in 0..4 {
        let url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
            let owner = format!("w{w}");
            let mut got = Vec::new();
            loop {
                let c = claim(&mut conn, &owner, 7, LONG, 12).await;
                if c.messages.is_empty() {
                    return got;
                }
                assert!(c.messages.len() <= 7);
                got.extend(c.messages.iter().map(|m| (m.id, m.lease_version, m.attempts)));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    assert_eq!(all.len(), 200, "every row claimed exactly once");
    let ids: HashSet<i64> = all.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(ids, seeded);
    assert!(all.iter().all(|&(_, v, a)| v == 1 && a == 1), "first claim: version 1, attempt 1");
    assert_eq!(db.count_status("processing").await, 200);
}

/// Scenario 2: the broken design (claim with SKIP LOCKED, COMMIT, then publish) publishes the
/// same rows twice when a second worker claims while the first is still publishing. This is the
/// reason the lease and the fencing token exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_design_publishes_twice() {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    async fn broken_claim(conn: &mut AsyncPgConnection) -> Vec<i64> {
        conn.transaction(async |tx| {
            let rows: Vec<Id> = diesel::sql_query(
                "SELECT id FROM outbox WHERE status = 'pending' ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED",
            )
            .load(tx)
            .await?;
            Ok::<_, diesel::result::Error>(rows.into_iter().map(|r| r.id).collect())
        })
        .await
        .unwrap()
        // COMMIT here: the row locks are gone, the rows are still 'pending'.
    }
    let db = TestDb::new().await;
    let seeded = db.seed(3, "a").await;
    let published = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (paused_tx, paused_rx) = tokio::sync::oneshot::channel::<()>();
    let (resume_tx, resume_rx) = tokio::sync::oneshot::channel::<()>();

    let (url, log) = (db.url.clone(), published.clone());
    let worker_a = tokio::spawn(async move {
        let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
        let ids = broken_claim(&mut conn).await;
        paused_tx.send(()).unwrap(); // paused mid-publish (a slow broker, a GC pause)
        resume_rx.await.unwrap();
        for id in &ids {
            log.lock().unwrap().push(("A", *id));
            diesel::sql_query("UPDATE outbox SET status = 'done' WHERE id = $1")
                .bind::<diesel::sql_types::BigInt, _>(id)
                .execute(&mut conn)
                .await
                .unwrap();
        }
    });
    paused_rx.await.unwrap();
    let mut conn_b = db.conn().await;
    let ids_b = broken_claim(&mut conn_b).await;
    for id in &ids_b {
        published.lock().unwrap().push(("B", *id));
    }
    resume_tx.send(()).unwrap();
    worker_a.await.unwrap();

    let log = published.lock().unwrap().clone();
    assert_eq!(ids_b, seeded, "worker B claimed the very rows A was publishing");
    for id in &seeded {
        let by: Vec<_> = log.iter().filter(|(_, i)| i == id).map(|(w, _)| *w).collect();
        assert_eq!(by.len(), 2, "row {id} published twice (by {by:?})");
    }

    // The lease design on the same situation: B's claim while A holds the lease gets nothing.
    let db = TestDb::new().await;
    db.seed(3, "a").await;
    let mut conn_a = db.conn().await;
    assert_eq!(claim(&mut conn_a, "A", 10, LONG, 12).await.messages.len(), 3);
    let mut conn_b = db.conn().await;
    assert!(claim(&mut conn_b, "B", 10, LONG, 12).await.messages.is_empty());
}

/// Scenario 4: a worker claims and stops; while leased nobody else gets the row; after expiry
/// another worker takes it with version + 1 and attempts 2; the old finalize loses, the new wins.
#[tokio::test]
async fn expired_lease_is_taken_over_and_stale_finalize_is_fenced() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let (mut ca, mut cb) = (db.conn().await, db.conn().await);
    let a = claim(&mut ca, "A", 10, Duration::from_millis(200), 12).await.messages;
    assert_eq!(a.len(), 1);
    assert_eq!((a[0].id, a[0].lease_version, a[0].attempts), (id, 1, 1));
    assert!(claim(&mut cb, "B", 10, LONG, 12).await.messages.is_empty(), "leased rows are not claimable");

    until_leases_expired(&db).await;
    let b = claim(&mut cb, "B", 10, LONG, 12).await.messages;
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].id, b[0].lease_version, b[0].attempts), (id, 2, 2));
    assert_eq!(db.row(id).await.lease_owner.as_deref(), Some("B"));

    assert!(
        actix_outbox::testing::mark_done(&mut ca, &[a[0].fence()]).await.unwrap().is_empty(),
        "A's finalize is fenced off"
    );
    assert_eq!(db.row(id).await.status, Status::Processing, "A wrote nothing");
    assert_eq!(actix_outbox::testing::mark_done(&mut cb, &[b[0].fence()]).await.unwrap(), vec![id]);
    let row = db.row(id).await;
    assert_eq!((row.status, row.lease_version, row.attempts), (Status::Done, 2, 2));
    assert!(row.done_at.is_some() && row.lease_owner.is_none() && row.lease_until.is_none());
}

/// Scenario 5: the lease expired but nobody took over: the original worker still finalizes
/// (the predicate is the version, not the clock).
#[tokio::test]
async fn expired_lease_not_taken_over_still_finalizes() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let mut conn = db.conn().await;
    let a = claim(&mut conn, "A", 10, Duration::from_millis(50), 12).await.messages;
    until_leases_expired(&db).await;
    assert_eq!(actix_outbox::testing::mark_done(&mut conn, &[a[0].fence()]).await.unwrap(), vec![id]);
    assert_eq!(db.row(id).await.status, Status::Done);
}

/// Scenario 6: a retryable failure three times with max attempts 3: pending (attempts 1),
/// pending (attempts 2), dead (attempts 3).
#[tokio::test]
async fn retryable_failures_back_off_then_go_dead_at_max_attempts() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let config = fast_backoff(3);
    let mut conn = db.conn().await;
    for attempt in 1..=3 {
        db.make_available().await;
        let m = claim(&mut conn, "A", 10, LONG, 3).await.messages;
        assert_eq!(m.len(), 1, "attempt {attempt} claims the row");
        assert_eq!(m[0].attempts, attempt);
        assert!(finalize(&mut conn, &m[0], Err(PublishError::Retryable("broker away".into())), &config).await);
        let row = db.row(id).await;
        let expected = if attempt < 3 { Status::Pending } else { Status::Dead };
        assert_eq!((row.status, row.attempts), (expected, attempt), "after attempt {attempt}");
        assert!(row.last_error.as_deref().unwrap().contains("broker away"));
        assert!(row.lease_owner.is_none() && row.lease_until.is_none());
    }
    let row = db.row(id).await;
    assert!(row.last_error.unwrap().starts_with("retries exhausted after 3 attempts"));
    db.make_available().await;
    assert!(claim(&mut conn, "A", 10, LONG, 3).await.messages.is_empty(), "dead rows are never claimed");
}

/// The backoff lands `available_at` inside `[now, now + min(cap, base * 2^attempts)]`.
#[tokio::test]
async fn retry_backoff_is_bounded_by_the_full_jitter_ceiling() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let config = DispatcherConfig::default().backoff_base(Duration::from_secs(10)).backoff_cap(Duration::from_secs(15));
    let mut conn = db.conn().await;
    let m = claim(&mut conn, "A", 10, LONG, 12).await.messages;
    let before = chrono::Utc::now();
    assert!(finalize(&mut conn, &m[0], Err(PublishError::Retryable("x".into())), &config).await);
    let row = db.row(id).await;
    // attempts = 1: ceiling min(15 s, 10 s × 2) = 15 s.
    let delay = row.available_at - before;
    assert!(delay <= chrono::Duration::seconds(16), "delay {delay} above the cap");
    assert!(delay >= chrono::Duration::seconds(-1), "delay {delay} in the past");
}

/// Scenario 7: a business deferral keeps the row pending, refunds the attempt (attempts 0) and
/// pushes `available_at` back.
#[tokio::test]
async fn defer_refunds_the_attempt_and_pushes_available_at() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let config = DispatcherConfig::default();
    let mut conn = db.conn().await;
    let m = claim(&mut conn, "A", 10, LONG, 12).await.messages;
    let before = chrono::Utc::now();
    let defer = PublishError::Defer { delay: Duration::from_secs(60), reason: "customer not created yet".into() };
    assert!(finalize(&mut conn, &m[0], Err(defer), &config).await);
    let row = db.row(id).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 0));
    assert!(row.available_at >= before + chrono::Duration::seconds(59), "available_at {}", row.available_at);
    assert!(row.last_error.unwrap().contains("customer not created yet"));
    assert!(claim(&mut conn, "A", 10, LONG, 12).await.messages.is_empty(), "not claimable before available_at");
}

/// A deferral of a row older than `max_defer_age` sends it dead: deferrals end.
#[tokio::test]
async fn deferral_past_the_maximum_age_goes_dead() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let mut conn = db.conn().await;
    conn.batch_execute("UPDATE outbox SET created_at = now() - interval '2 hours'").await.unwrap();
    let config = DispatcherConfig::default().max_defer_age(Duration::from_secs(3600));
    let m = claim(&mut conn, "A", 10, LONG, 12).await.messages;
    let defer = PublishError::Defer { delay: Duration::from_secs(60), reason: "still waiting".into() };
    assert!(finalize(&mut conn, &m[0], Err(defer), &config).await);
    let row = db.row(id).await;
    assert_eq!(row.status, Status::Dead);
    assert!(row.last_error.unwrap().starts_with("deferred past the maximum deferral age"));
}

/// Scenario 8: a permanent failure sends the row dead at once.
#[tokio::test]
async fn permanent_failure_goes_dead_at_once() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let mut conn = db.conn().await;
    let m = claim(&mut conn, "A", 10, LONG, 12).await.messages;
    assert!(
        finalize(
            &mut conn,
            &m[0],
            Err(PublishError::Permanent("schema rejected".into())),
            &DispatcherConfig::default()
        )
        .await
    );
    let row = db.row(id).await;
    assert_eq!((row.status, row.attempts), (Status::Dead, 1));
    assert_eq!(row.last_error.as_deref(), Some("permanent: schema rejected"));
}

/// Scenario 9: claimed and never finalized three times with max attempts 3 (a message that
/// kills its worker): the sweep's reaper sends it dead with attempts 3, and it is never claimed
/// again.
#[tokio::test]
async fn poison_message_is_reaped_after_max_attempts() {
    let db = TestDb::new().await;
    let [id] = db.seed(1, "a").await[..] else { unreachable!() };
    let mut conn = db.conn().await;
    for attempt in 1..=3 {
        let c = claim(&mut conn, "A", 10, Duration::from_millis(50), 3).await;
        assert_eq!(c.messages.len(), 1, "attempt {attempt}");
        assert_eq!((c.messages[0].attempts, c.messages[0].lease_version), (attempt, i64::from(attempt)));
        until_leases_expired(&db).await; // the worker "crashed": no finalize
    }
    let swept = sweep(&mut conn, 3).await;
    assert_eq!(swept.reaped.iter().map(|f| (f.id, f.lease_version)).collect::<Vec<_>>(), vec![(id, 3)]);
    let c = claim(&mut conn, "A", 10, LONG, 3).await;
    assert!(c.messages.is_empty());
    let row = db.row(id).await;
    assert_eq!((row.status, row.attempts), (Status::Dead, 3));
    assert_eq!(row.lease_version, 4, "reaping moves the fence on: no write of the dead claim can count it");
    assert!(row.last_error.unwrap().starts_with("reaped: lease expired after 3 of 3 attempts"));
    assert!(row.lease_owner.is_none());
    let again = claim(&mut conn, "A", 10, LONG, 3).await;
    assert!(again.messages.is_empty(), "never claimed again");
    assert!(sweep(&mut conn, 3).await.reaped.is_empty(), "reaped once");
}

/// A batch finalize is one statement that reports exactly the rows it won: rows taken over by
/// another worker are left untouched.
#[tokio::test]
async fn batch_finalize_reports_winners_and_leaves_losers_alone() {
    let db = TestDb::new().await;
    let ids = db.seed(6, "a").await;
    let mut conn = db.conn().await;
    let claimed = claim(&mut conn, "A", 10, Duration::from_millis(50), 12).await.messages;
    assert_eq!(claimed.len(), 6);
    until_leases_expired(&db).await;
    // B takes over the first two rows (the oldest-expired first; force the pick with batch 2
    // after making the others live again).
    conn.batch_execute(&format!(
        "UPDATE outbox SET lease_until = now() + interval '1 hour' WHERE id NOT IN ({}, {})",
        ids[0], ids[1]
    ))
    .await
    .unwrap();
    let taken = claim(&mut db.conn().await, "B", 10, LONG, 12).await.messages;
    assert_eq!(taken.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..2]);

    let fences: Vec<_> = claimed.iter().map(|m| m.fence()).collect();
    let won = actix_outbox::testing::mark_done(&mut conn, &fences).await.unwrap();
    let mut won_sorted = won.clone();
    won_sorted.sort();
    assert_eq!(won_sorted, ids[2..]);
    for (i, row) in db.rows().await.iter().enumerate() {
        let expected = if i < 2 { (Status::Processing, 2) } else { (Status::Done, 1) };
        assert_eq!((row.status, row.lease_version), expected, "row {}", row.id);
    }
}

/// `Status` is the `status` column's type: written as its text and read back, and a text that is
/// no status fails to read rather than becoming one.
#[tokio::test]
async fn status_is_written_and_read_as_the_columns_text() {
    use diesel::sql_types::Text;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for &status in Status::ALL {
        let back: (String, Status) =
            diesel::select((status.into_sql::<Text>(), status.into_sql::<Text>())).get_result(&mut conn).await.unwrap();
        assert_eq!(back, (status.as_str().to_owned(), status));
    }
    let bogus = diesel::select("bogus".into_sql::<Text>()).get_result::<Status>(&mut conn).await;
    assert!(
        matches!(&bogus, Err(diesel::result::Error::DeserializationError(e)) if format!("{e:?}").contains(r#"UnknownStatus("bogus")"#)),
        "{bogus:?}"
    );
}

/// In a batch, each row gets its own values (error, delay, refund, maximum age), whatever the
/// order of the batch; a stale claim in it writes nothing, also beside the current claim of the
/// same row.
#[tokio::test]
async fn batch_writes_give_each_row_its_own_values() {
    let db = TestDb::new().await;
    let ids = db.seed(8, "a").await;
    let mut conn = db.conn().await;
    conn.batch_execute(&format!(
        "UPDATE outbox SET created_at = now() - interval '2 days' WHERE id IN ({}, {})",
        ids[3], ids[4]
    ))
    .await
    .unwrap();
    let claimed = claim(&mut conn, "A", 10, LONG, 12).await.messages;
    assert_eq!(claimed.len(), 8);
    let fence = |i: usize| claimed[i].fence();
    let stale = |i: usize| actix_outbox::dispatcher::Fence {
        lease_version: claimed[i].lease_version - 1,
        ..claimed[i].fence()
    };

    let mut buried: Vec<actix_outbox::testing::Bury> = (0..3)
        .rev()
        .map(|i| actix_outbox::testing::Bury { fence: fence(i), error: format!("permanent: {i}") })
        .collect();
    buried.insert(1, actix_outbox::testing::Bury { fence: stale(0), error: "stale".into() });
    let mut dead = actix_outbox::testing::mark_dead(&mut conn, &buried).await.unwrap();
    dead.sort();
    assert_eq!(dead, ids[..3]);

    let day = Duration::from_secs(86_400);
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let reschedule = |i: usize, delay: u64, refund_attempt: bool, dead_if_older_than: Option<Duration>| {
        actix_outbox::testing::Reschedule {
            fence: if i == 7 { stale(i) } else { fence(i) },
            delay: minutes(delay),
            error: format!("retryable: {i}"),
            refund_attempt,
            dead_if_older_than,
        }
    };
    let rows = [
        reschedule(7, 40, true, None),
        reschedule(6, 30, true, None),
        reschedule(5, 20, false, Some(day)),
        reschedule(4, 10, true, None),
        reschedule(3, 50, false, Some(day)),
    ];
    let before = chrono::Utc::now();
    let mut back = actix_outbox::testing::reschedule(&mut conn, &rows).await.unwrap();
    back.sort_by_key(|r| r.id);
    let statuses: Vec<(i64, Status)> = back.iter().map(|r| (r.id, r.status)).collect();
    assert_eq!(
        statuses,
        [(ids[3], Status::Dead), (ids[4], Status::Pending), (ids[5], Status::Pending), (ids[6], Status::Pending)]
    );

    let rows = db.rows().await;
    for (i, row) in rows[..3].iter().enumerate() {
        assert_eq!((row.status, row.last_error.clone()), (Status::Dead, Some(format!("permanent: {i}"))));
    }
    assert_eq!(rows[3].status, Status::Dead);
    assert_eq!(rows[3].last_error.as_deref(), Some("deferred past the maximum deferral age; last: retryable: 3"));
    for (i, delay, attempts) in [(4, 10, 0), (5, 20, 1), (6, 30, 0)] {
        let row = &rows[i];
        assert_eq!((row.status, row.attempts), (Status::Pending, attempts), "row {i}");
        assert_eq!(row.last_error, Some(format!("retryable: {i}")), "row {i}");
        let wait = row.available_at - before;
        let expected = chrono::Duration::minutes(delay);
        assert!(
            wait > expected - chrono::Duration::seconds(5) && wait < expected + chrono::Duration::seconds(5),
            "row {i}: {wait}"
        );
    }
    assert_eq!(
        (rows[7].status, rows[7].last_error.clone()),
        (Status::Processing, None),
        "a stale claim writes nothing"
    );
}

/// Claims and finalizes are HOT updates: no index of the table names a column either of them
/// changes, so each new row version is written beside the old one on its page and no index gets
/// an entry. Counted by `pg_stat_user_tables`, flushed on demand. Ten small rows fill a fifth of
/// a page, so both new versions of each fit beside it whether or not the page is pruned between
/// the two updates.
#[tokio::test]
async fn claims_and_finalizes_write_no_index_entry() {
    let db = TestDb::new().await;
    db.seed(10, "a").await;
    let mut conn = db.conn().await;
    #[derive(QueryableByName, Debug, Clone, Copy, PartialEq)]
    struct Updates {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        updated: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        hot: i64,
    }
    async fn updates(conn: &mut AsyncPgConnection) -> Updates {
        // This session's counters reach the shared statistics when it next goes idle.
        conn.batch_execute("SELECT pg_stat_force_next_flush()").await.unwrap();
        diesel::sql_query(
            "SELECT n_tup_upd AS updated, n_tup_hot_upd AS hot FROM pg_stat_user_tables WHERE relname = 'outbox'",
        )
        .get_result(conn)
        .await
        .unwrap()
    }
    let before = updates(&mut conn).await;
    let claimed = claim(&mut conn, "A", 10, LONG, 12).await.messages;
    let fences: Vec<_> = claimed.iter().map(|m| m.fence()).collect();
    assert_eq!(actix_outbox::testing::mark_done(&mut conn, &fences).await.unwrap().len(), 10);
    let after = updates(&mut conn).await;
    assert_eq!(
        (after.updated - before.updated, after.hot - before.hot),
        (20, 20),
        "10 claims and 10 finalizes, every one HOT: {before:?} -> {after:?}"
    );
}

/// The claim and every fenced write stay prepared on the pool's connections (one round trip per
/// run instead of two), one statement each whatever the batch size (a batch is one array bind
/// per column, never one placeholder per row). The fenced writes never run on a generic plan
/// there: a plan made once, while the table was small, would read it whole for the connection's
/// life (a batched finalize measured at 35 ms a run instead of 0.1 ms after minutes of traffic
/// on a new table); the pool sets `plan_cache_mode = force_custom_plan`. The claim always does,
/// made under `enable_seqscan = off` (its planning cost more than its run). Seven runs of each,
/// with batches of 1 to 7 rows: the generic plan is tried from the sixth.
#[tokio::test]
async fn claim_and_finalize_stay_prepared_and_only_the_claim_runs_on_a_generic_plan() {
    const RUNS: usize = 7;
    let db = TestDb::new().await;
    // Three batches of 1, 2, ... 7 rows per run.
    db.seed(3 * RUNS * (RUNS + 1) / 2, "a").await;
    let mut pooled = db.pool.get().await.unwrap();
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        plan_cache_mode: String,
    }
    let mode: Setting = diesel::sql_query("SHOW plan_cache_mode").get_result(&mut *pooled).await.unwrap();
    assert_eq!(mode.plan_cache_mode, "force_custom_plan", "the pool sets up its connections");

    for size in 1..=RUNS {
        let claimed = claim(&mut pooled, "A", 3 * size, LONG, 12).await.messages;
        assert_eq!(claimed.len(), 3 * size);
        let fences: Vec<_> = claimed.iter().map(|m| m.fence()).collect();
        let (done, rest) = fences.split_at(size);
        let (dead, deferred) = rest.split_at(size);

        assert_eq!(actix_outbox::testing::extend_leases(&mut pooled, done, LONG).await.unwrap().len(), size);
        assert_eq!(actix_outbox::testing::mark_done(&mut pooled, done).await.unwrap().len(), size);
        let settled = actix_outbox::testing::settled(&mut pooled, done).await.unwrap();
        assert_eq!(settled.len(), size);
        assert!(settled.iter().all(|(_, status)| *status == Some(Status::Done)));

        let buried: Vec<actix_outbox::testing::Bury> = dead
            .iter()
            .map(|&fence| actix_outbox::testing::Bury { fence, error: format!("permanent: {}", fence.id) })
            .collect();
        assert_eq!(actix_outbox::testing::mark_dead(&mut pooled, &buried).await.unwrap().len(), size);

        let rescheduled: Vec<actix_outbox::testing::Reschedule> = deferred
            .iter()
            .enumerate()
            .map(|(i, &fence)| actix_outbox::testing::Reschedule {
                fence,
                delay: Duration::from_secs(3600 + i as u64),
                error: format!("retryable: {}", fence.id),
                refund_attempt: i % 2 == 0,
                dead_if_older_than: (i % 2 == 1).then_some(Duration::from_secs(3600)),
            })
            .collect();
        let back = actix_outbox::testing::reschedule(&mut pooled, &rescheduled).await.unwrap();
        assert_eq!(back.len(), size);
        assert!(back.iter().all(|r| r.status == Status::Pending), "{back:?}");
    }
    #[derive(QueryableByName, Debug)]
    struct Cached {
        #[diesel(sql_type = diesel::sql_types::Text)]
        statement: String,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        generic_plans: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        custom_plans: i64,
    }
    let cached: Vec<Cached> = diesel::sql_query(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
         WHERE statement NOT LIKE '%pg_prepared_statements%'",
    )
    .load(&mut *pooled)
    .await
    .unwrap();
    // Each statement by what it writes first: the SET clauses' order is the store's own.
    type Matches = fn(&str) -> bool;
    let statements: [(&str, Matches); 6] = [
        ("claim", |s| s.contains("WITH later AS")),
        ("mark_done", |s| s.starts_with(r#"UPDATE "outbox" SET "status" = $1, "done_at""#)),
        ("mark_dead", |s| s.starts_with(r#"UPDATE "outbox" SET "status" = $1, "last_error""#)),
        ("reschedule", |s| s.starts_with(r#"UPDATE "outbox" SET "status" = CASE"#)),
        ("extend_leases", |s| s.starts_with(r#"UPDATE "outbox" SET "lease_until""#)),
        ("settled", |s| s.starts_with(r#"SELECT "outbox"."id", "outbox"."status", "outbox"."lease_version" FROM"#)),
    ];
    for (name, matches) in statements {
        let found: Vec<&Cached> = cached.iter().filter(|c| matches(&c.statement)).collect();
        assert_eq!(found.len(), 1, "one prepared statement for {name}, whatever the batch size: {cached:#?}");
        // The claim is planned once, for any values (see `the_claims_plan_reads_both_indexes_...`).
        let expected = if name == "claim" { (RUNS as i64, 0) } else { (0, RUNS as i64) };
        assert_eq!((found[0].generic_plans, found[0].custom_plans), expected, "{name}: {}", found[0].statement);
    }
    assert_eq!(cached.len(), statements.len(), "no other statement prepared: {cached:#?}");
    assert_eq!(db.count_status("done").await, (RUNS * (RUNS + 1) / 2) as i64);
}

/// The claim's plan, made once per connection for any values, reads the new rows through
/// `outbox_txid` and the waiting rows through `outbox_later`, each as an ordered index scan that
/// stops at the batch, whatever the statistics say: taken while every row was pending (as after a
/// bulk load) and while every row was done, with the FIFO gate's index there (every status test
/// of the claim would let the planner read that index instead, were it not written so that it
/// cannot). A bitmap scan and a sort would read every row after the cursor on every claim.
#[tokio::test]
async fn the_claims_plan_reads_both_indexes_in_order_whatever_the_statistics() {
    let db = TestDb::new().await;
    db.seed(20_000, "a").await;
    let mut conn = db.conn().await;
    actix_outbox::admin::ensure_fifo_index(&mut conn).await.unwrap();
    for fifo in [actix_outbox::Fifo::Off, actix_outbox::Fifo::All, actix_outbox::Fifo::event_types(["e"])] {
        for state in ["pending", "done"] {
            conn.batch_execute(&format!("UPDATE outbox SET status = '{state}'; ANALYZE outbox")).await.unwrap();
            let plan = actix_outbox::testing::claim_plan(&mut conn, &fifo).await.unwrap().join("\n");
            assert!(plan.contains("Index Scan using outbox_later on outbox"), "{fifo}, {state}: {plan}");
            assert!(plan.contains("Index Scan using outbox_txid on outbox"), "{fifo}, {state}: {plan}");
            assert!(!plan.contains("Bitmap Heap Scan on outbox"), "{fifo}, {state}: {plan}");
            assert!(!plan.contains("Seq Scan on outbox"), "{fifo}, {state}: {plan}");
        }
    }
}

/// The heartbeat extends a live claim's lease and is fenced like every other write.
#[tokio::test]
async fn heartbeat_extends_only_current_leases() {
    let db = TestDb::new().await;
    let ids = db.seed(2, "a").await;
    let mut conn = db.conn().await;
    let m = claim(&mut conn, "A", 10, Duration::from_secs(1), 12).await.messages;
    let before = db.row(ids[0]).await.lease_until.unwrap();
    let stale = actix_outbox::dispatcher::Fence { id: ids[1], lease_version: 99 };
    let won = actix_outbox::testing::extend_leases(&mut conn, &[m[0].fence(), stale], Duration::from_secs(600))
        .await
        .unwrap();
    assert_eq!(won, vec![ids[0]]);
    let after = db.row(ids[0]).await.lease_until.unwrap();
    assert!(after - before > chrono::Duration::seconds(590), "extended from {before} to {after}");
    assert_eq!(db.row(ids[1]).await.lease_until, m[1].lease_until, "stale fence changed nothing");
}

/// Rows not yet available (backoff) are skipped; the claim returns rows in id order and
/// writes owner, lease and version.
#[tokio::test]
async fn claim_respects_available_at_and_orders_by_id() {
    let db = TestDb::new().await;
    let ids = db.seed(5, "a").await;
    let mut conn = db.conn().await;
    diesel::sql_query("UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = $1")
        .bind::<diesel::sql_types::BigInt, _>(ids[2])
        .execute(&mut conn)
        .await
        .unwrap();
    let m = claim(&mut conn, "owner-x", 10, LONG, 12).await.messages;
    assert_eq!(m.iter().map(|m| m.id).collect::<Vec<_>>(), vec![ids[0], ids[1], ids[3], ids[4]]);
    let row = db.row(ids[0]).await;
    assert_eq!(row.lease_owner.as_deref(), Some("owner-x"));
    let lease = row.lease_until.unwrap() - chrono::Utc::now();
    assert!(lease > chrono::Duration::seconds(25) && lease <= chrono::Duration::seconds(31), "lease {lease}");
    assert_eq!(m[0].payload_value().unwrap(), serde_json::json!({"n": 0}));
}

/// Claims with a cursor, as a dispatcher's, until one comes back short; returns the ids taken.
async fn claim_with(
    conn: &mut AsyncPgConnection,
    cursor: &mut actix_outbox::testing::Cursor,
    batch: usize,
) -> Vec<i64> {
    let mut ids = Vec::new();
    loop {
        let params = ClaimParams {
            owner: "A",
            batch,
            max_bytes: usize::MAX,
            lease: LONG,
            max_attempts: 12,
            fifo: &actix_outbox::Fifo::Off,
            cursor: Some(cursor),
            heads_after: None,
        };
        let claim = actix_outbox::testing::claim(conn, &params).await.unwrap();
        let (snapshot, taken) = claim.cursor.expect("a claim with a cursor returns what it did with it");
        cursor.advance(&snapshot, &taken);
        ids.extend(claim.messages.iter().map(|m| m.id));
        if claim.messages.len() < batch {
            return ids;
        }
    }
}

/// A row whose transaction began before a thousand later rows were inserted and committed, and
/// which commits after a cursor took all of them: the cursor's next claim takes it, because the
/// transaction was in progress in the snapshot of the claims that passed its id. An id cursor
/// (Watermill's) would pass it for good.
#[tokio::test]
async fn a_row_committed_after_a_thousand_later_rows_were_taken_is_taken_next() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = actix_outbox::testing::Cursor::at(actix_outbox::testing::horizon(&mut conn).await.unwrap());

    let mut late_tx = db.conn().await;
    late_tx.batch_execute("BEGIN").await.unwrap();
    let late =
        actix_outbox::enqueue(&mut late_tx, &NewEvent::new("t", "late", "e", serde_json::json!({}))).await.unwrap();
    // A thousand rows after it, in ten transactions, each committed.
    let mut later = Vec::new();
    for _ in 0..10 {
        later.extend(db.seed(100, "a").await);
    }
    assert!(later.iter().all(|&id| id > late));
    let first = claim_with(&mut conn, &mut cursor, 64).await;
    assert_eq!(first, later, "every committed row, in commit order, and not the one still in progress");

    late_tx.batch_execute("COMMIT").await.unwrap();
    assert_eq!(claim_with(&mut conn, &mut cursor, 64).await, vec![late]);
    assert_eq!(claim_with(&mut conn, &mut cursor, 64).await, Vec::<i64>::new(), "nothing twice");
    let row = db.row(late).await;
    assert_eq!((row.status, row.lease_version, row.attempts), (Status::Processing, 1, 1));
}

/// The same when the late transaction began after the cursor's snapshot (its id lies after the
/// cursor's `xmax`) and rows of transactions after it were taken first: the claim that moved
/// the cursor past its id saw it in progress.
#[tokio::test]
async fn a_late_transaction_that_began_after_the_cursor_is_taken_when_it_commits() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = actix_outbox::testing::Cursor::at(actix_outbox::testing::horizon(&mut conn).await.unwrap());
    assert_eq!(claim_with(&mut conn, &mut cursor, 10).await, Vec::<i64>::new());

    let mut late_tx = db.conn().await;
    late_tx.batch_execute("BEGIN").await.unwrap();
    let late =
        actix_outbox::enqueue(&mut late_tx, &NewEvent::new("t", "late", "e", serde_json::json!({}))).await.unwrap();
    let after = db.seed(25, "a").await;
    // Batches of 10: the claims that take the 25 rows come back full twice, then short.
    assert_eq!(claim_with(&mut conn, &mut cursor, 10).await, after);
    late_tx.batch_execute("COMMIT").await.unwrap();
    assert_eq!(claim_with(&mut conn, &mut cursor, 10).await, vec![late]);
}

/// A claim's cursor moves past what it took in `(txid, id)` order; rows of one transaction
/// larger than the batch are taken a batch at a time, each row once.
#[tokio::test]
async fn a_cursor_takes_a_large_transaction_a_batch_at_a_time() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = actix_outbox::testing::Cursor::at(actix_outbox::testing::horizon(&mut conn).await.unwrap());
    let ids = db.seed(250, "a").await;
    let mut taken = Vec::new();
    let mut claims = 0;
    loop {
        let batch = claim_with_one(&mut conn, &mut cursor, 100).await;
        claims += 1;
        let n = batch.len();
        taken.extend(batch);
        if n < 100 {
            break;
        }
    }
    assert_eq!(taken, ids);
    assert_eq!(claims, 3);
}

/// One claim with a cursor; returns the ids taken.
async fn claim_with_one(
    conn: &mut AsyncPgConnection,
    cursor: &mut actix_outbox::testing::Cursor,
    batch: usize,
) -> Vec<i64> {
    let params = ClaimParams {
        owner: "A",
        batch,
        max_bytes: usize::MAX,
        lease: LONG,
        max_attempts: 12,
        fifo: &actix_outbox::Fifo::Off,
        cursor: Some(cursor),
        heads_after: None,
    };
    let claim = actix_outbox::testing::claim(conn, &params).await.unwrap();
    let (snapshot, taken) = claim.cursor.expect("a claim with a cursor returns what it did with it");
    cursor.advance(&snapshot, &taken);
    claim.messages.iter().map(|m| m.id).collect()
}

/// The producer's event commits with the business change, and vanishes when it rolls back.
#[tokio::test]
async fn enqueue_is_part_of_the_callers_transaction() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute("CREATE TABLE orders (id text PRIMARY KEY, total int NOT NULL)").await.unwrap();
    let event = |id: &str| NewEvent::new("order", id, "order.created", serde_json::json!({"id": id}));

    let rolled_back: Result<i64, actix_outbox::StoreError> = conn
        .transaction(async |tx| {
            tx.batch_execute("INSERT INTO orders VALUES ('o-1', 10)").await?;
            let id = actix_outbox::enqueue(tx, &event("o-1")).await?;
            assert!(id > 0);
            Err(actix_outbox::StoreError::Migration("business rule failed".into()))
        })
        .await;
    assert!(rolled_back.is_err());
    assert!(db.rows().await.is_empty(), "the event rolled back with the business write");

    let id = conn
        .transaction(async |tx| {
            tx.batch_execute("INSERT INTO orders VALUES ('o-2', 20)").await?;
            actix_outbox::enqueue(tx, &event("o-2")).await
        })
        .await
        .unwrap();
    let rows = db.rows().await;
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].id, rows[0].aggregate_id.as_str(), rows[0].status), (id, "o-2", Status::Pending));
    assert_eq!((rows[0].attempts, rows[0].lease_version), (0, 0));
}

/// Any producer, in any language, can insert with the four business columns alone.
#[tokio::test]
async fn plain_sql_insert_gets_every_default() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', '1', 'e', '{}')",
    )
    .await
    .unwrap();
    let row = &db.rows().await[0];
    assert_eq!((row.status, row.attempts, row.lease_version), (Status::Pending, 0, 0));
    assert!(row.lease_owner.is_none() && row.last_error.is_none() && row.done_at.is_none());
}

/// `src/schema.rs` and the migrations agree: same columns, types and nullability.
#[tokio::test]
async fn schema_rs_matches_the_migrated_table() {
    use actix_outbox::schema::outbox::dsl as o;
    use diesel::Column;
    #[derive(QueryableByName, Debug, PartialEq)]
    struct Col {
        #[diesel(sql_type = diesel::sql_types::Text)]
        column_name: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        udt_name: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        is_nullable: String,
    }
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let cols: Vec<Col> = diesel::sql_query(
        "SELECT column_name::text, udt_name::text, is_nullable::text FROM information_schema.columns
         WHERE table_name = 'outbox' AND table_schema = 'public' ORDER BY ordinal_position",
    )
    .load(&mut conn)
    .await
    .unwrap();
    // (name from schema.rs, PostgreSQL type that schema.rs's type maps to, nullable)
    let expected = [
        (o::id::NAME, "int8", "NO"),
        (o::aggregate_type::NAME, "text", "NO"),
        (o::aggregate_id::NAME, "text", "NO"),
        (o::event_type::NAME, "text", "NO"),
        (o::payload::NAME, "jsonb", "NO"),
        (o::created_at::NAME, "timestamptz", "NO"),
        (o::status::NAME, "text", "NO"),
        (o::available_at::NAME, "timestamptz", "NO"),
        (o::attempts::NAME, "int4", "NO"),
        (o::lease_owner::NAME, "text", "YES"),
        (o::lease_until::NAME, "timestamptz", "YES"),
        (o::lease_version::NAME, "int8", "NO"),
        (o::last_error::NAME, "text", "YES"),
        (o::done_at::NAME, "timestamptz", "YES"),
        (o::headers::NAME, "jsonb", "YES"),
        (o::txid::NAME, "xid8", "YES"),
    ];
    let actual: Vec<_> =
        cols.iter().map(|c| (c.column_name.as_str(), c.udt_name.as_str(), c.is_nullable.as_str())).collect();
    assert_eq!(actual, expected);
    // And diesel can read every column through schema.rs.
    db.seed(1, "a").await;
    assert_eq!(db.rows().await.len(), 1);
}

/// The down migration removes the table; migrating again restores it.
#[tokio::test]
async fn migrations_run_down_and_up_again() {
    use diesel_migrations::MigrationHarness;
    let db = TestDb::new().await;
    let url = db.url.clone();
    tokio::task::spawn_blocking(move || {
        let mut conn: diesel_async::async_connection_wrapper::AsyncConnectionWrapper<AsyncPgConnection> =
            diesel::Connection::establish(&url).unwrap();
        conn.revert_all_migrations(actix_outbox::admin::MIGRATIONS).unwrap();
        assert!(conn.has_pending_migration(actix_outbox::admin::MIGRATIONS).unwrap());
    })
    .await
    .unwrap();
    let mut conn = db.conn().await;
    assert!(conn.batch_execute("SELECT 1 FROM outbox").await.is_err(), "down removed the table");
    let applied = actix_outbox::migrate(&db.url).await.unwrap();
    assert!(!applied.is_empty());
    assert!(actix_outbox::migrate(&db.url).await.unwrap().is_empty(), "idempotent");
    db.seed(1, "a").await;
}

/// The outbox is vacuumed after a fixed number of changed rows, not 20 % of the table: claims
/// otherwise step over an ever longer run of dead index entries.
#[tokio::test]
async fn outbox_has_queue_grade_autovacuum_settings() {
    #[derive(QueryableByName)]
    struct Options {
        #[diesel(sql_type = diesel::sql_types::Array<diesel::sql_types::Text>)]
        reloptions: Vec<String>,
    }
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let options: Options = diesel::sql_query("SELECT reloptions FROM pg_class WHERE oid = 'outbox'::regclass")
        .get_result(&mut conn)
        .await
        .unwrap();
    for expected in ["autovacuum_vacuum_scale_factor=0.0", "autovacuum_vacuum_threshold=5000"] {
        assert!(options.reloptions.iter().any(|o| o == expected), "{expected} missing from {:?}", options.reloptions);
    }
}

/// The byte budget: a claim takes rows in order while their payloads fit, the first whatever
/// its size, and says how many it left for later.
#[tokio::test]
async fn a_claim_takes_rows_while_their_payloads_fit_the_byte_budget() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Payloads of 1,000 bytes of JSON text each: {"pad": "xxx..."}.
    let pad = "x".repeat(1000 - r#"{"pad": ""}"#.len());
    let events: Vec<_> = (0..10).map(|_| NewEvent::new("t", "a", "t.e", serde_json::json!({ "pad": pad }))).collect();
    let ids = actix_outbox::enqueue_many(&mut conn, &events).await.unwrap();
    let params = |max_bytes| ClaimParams {
        owner: "A",
        batch: 10,
        max_bytes,
        lease: LONG,
        max_attempts: 12,
        fifo: &actix_outbox::Fifo::Off,
        cursor: None,
        heads_after: None,
    };
    let c = actix_outbox::testing::claim(&mut conn, &params(3_500)).await.unwrap();
    assert_eq!(c.messages.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..3], "3 × 1,000 bytes fit in 3,500");
    assert!(c.messages.iter().all(|m| m.payload_bytes() == 1000), "{:?}", c.messages[0].payload.get());
    assert_eq!(c.cut_by_budget, 7, "the other 7 wait for a later claim");
    let c = actix_outbox::testing::claim(&mut conn, &params(10)).await.unwrap();
    assert_eq!(
        c.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        ids[3..4],
        "a row larger than the budget goes alone"
    );
    assert_eq!(c.cut_by_budget, 6);
    let c = actix_outbox::testing::claim(&mut conn, &params(usize::MAX)).await.unwrap();
    assert_eq!(c.messages.len(), 6);
    assert_eq!(c.cut_by_budget, 0);
}

/// The delete of `Retention::Delete` is fenced like every finalize: after a takeover the old
/// claim deletes nothing, the new one deletes the row; a row that is not `processing` (here
/// `done` already, or pending) is never deleted; and the read-back (`settled`) reports the deleted row as gone.
#[tokio::test]
async fn the_delete_of_a_confirmed_row_is_fenced_and_read_back_by_absence() {
    let db = TestDb::new().await;
    let ids = db.seed(3, "a").await;
    let (taken, done, pending) = (ids[0], ids[1], ids[2]);
    let (mut ca, mut cb) = (db.conn().await, db.conn().await);
    let a = claim(&mut ca, "A", 2, Duration::from_millis(200), 12).await.messages;
    assert_eq!(a.iter().map(|m| m.id).collect::<Vec<_>>(), vec![taken, done]);
    assert_eq!(actix_outbox::testing::mark_done(&mut ca, &[a[1].fence()]).await.unwrap(), vec![done]);

    until_leases_expired(&db).await;
    let b = claim(&mut cb, "B", 1, LONG, 12).await.messages;
    assert_eq!((b[0].id, b[0].lease_version), (taken, 2));
    let stale = [a[0].fence(), a[1].fence()];
    assert!(actix_outbox::testing::delete_done(&mut ca, &stale).await.unwrap().is_empty(), "A is fenced off");
    assert_eq!(db.rows().await.len(), 3, "nothing deleted");
    assert_eq!(actix_outbox::testing::delete_done(&mut cb, &[b[0].fence()]).await.unwrap(), vec![taken]);

    let rows: Vec<(i64, Status)> = db.rows().await.iter().map(|r| (r.id, r.status)).collect();
    assert_eq!(rows, vec![(done, Status::Done), (pending, Status::Pending)]);
    // The read-back after a retried write: B's deleted row is gone, A's done row settled at
    // A's version, the never-claimed row is pending at version 0; a fence of another version
    // is left out.
    let fence = |id, lease_version| actix_outbox::dispatcher::Fence { id, lease_version };
    let asked = [b[0].fence(), a[1].fence(), fence(done, 7), fence(pending, 0)];
    let settled = actix_outbox::testing::settled(&mut ca, &asked).await.unwrap();
    assert_eq!(settled, vec![(taken, None), (done, Some(Status::Done)), (pending, Some(Status::Pending))]);
}

/// A claim whose answer was lost: its worker's other `processing` rows go back to `pending`,
/// attempt refunded and version moved on; the rows it is publishing, and another worker's,
/// stay; a late write under the lost claim's fence wins nothing.
#[actix_rt::test]
async fn release_unanswered_hands_back_only_the_workers_rows_it_is_not_publishing() {
    let db = TestDb::new().await;
    let ids = db.seed(8, "lost").await;
    let mut conn = db.conn().await;
    let mine = claim(&mut conn, "host:1:worker-0", 6, LONG, 12).await.messages;
    let theirs = claim(&mut conn, "host:1:worker-1", 2, LONG, 12).await.messages;
    assert_eq!(mine.iter().map(|m| m.id).collect::<Vec<_>>(), ids[..6]);
    assert_eq!(theirs.iter().map(|m| m.id).collect::<Vec<_>>(), ids[6..]);

    let publishing = [ids[0], ids[1]];
    let mut released =
        actix_outbox::testing::release_unanswered(&mut conn, "host:1:worker-0", &publishing).await.unwrap();
    released.sort_unstable();
    assert_eq!(released, ids[2..6]);

    for id in &ids[2..6] {
        let row = db.row(*id).await;
        assert_eq!((row.status, row.attempts, row.lease_version), (Status::Pending, 0, 2), "row {id}");
    }
    for id in publishing.iter().chain(&ids[6..]) {
        let row = db.row(*id).await;
        assert_eq!((row.status, row.attempts, row.lease_version), (Status::Processing, 1, 1), "row {id}");
    }
    let late = actix_outbox::dispatcher::Fence { id: ids[2], lease_version: 1 };
    assert!(actix_outbox::testing::mark_done(&mut conn, &[late]).await.unwrap().is_empty(), "the lost claim is fenced");
    // Nothing is left to hand back, and the released rows are claimable again.
    assert!(
        actix_outbox::testing::release_unanswered(&mut conn, "host:1:worker-0", &publishing).await.unwrap().is_empty()
    );
    let again = claim(&mut conn, "host:1:worker-0", 10, LONG, 12).await.messages;
    assert_eq!(
        again.iter().map(|m| (m.id, m.attempts, m.lease_version)).collect::<Vec<_>>(),
        ids[2..6].iter().map(|id| (*id, 1, 3)).collect::<Vec<_>>()
    );
}
