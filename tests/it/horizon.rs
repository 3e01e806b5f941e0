//! The sweep and the outbox's horizon: expired leases of new rows handed to the claims, rows the
//! claims passed while something else held them, and the horizon that starting cursors begin at.

use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::testing::{Claim, ClaimParams, Cursor, Snapshot, SweepParams, Swept};
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};

use actix_outbox_test_support::{TestDb, eventually};

const LONG: Duration = Duration::from_secs(60);

fn params<'a>(cursor: Option<&'a Cursor>, lease: Duration) -> ClaimParams<'a> {
    ClaimParams {
        owner: "A",
        batch: 100,
        max_bytes: usize::MAX,
        lease,
        max_attempts: 12,
        fifo: &actix_outbox::Fifo::Off,
        cursor,
        heads_after: None,
    }
}

/// One claim with `cursor`, which it moves on as a dispatcher's claim would.
async fn claim_with(conn: &mut AsyncPgConnection, cursor: &mut Cursor) -> Vec<i64> {
    let claim = actix_outbox::testing::claim(conn, &params(Some(cursor), LONG)).await.unwrap();
    let (snapshot, taken) = claim.cursor.clone().unwrap();
    cursor.advance(&snapshot, &taken);
    ids(&claim)
}

/// [`claim_with`], taking at most `batch` rows.
async fn claim_batch(conn: &mut AsyncPgConnection, cursor: &mut Cursor, batch: usize) -> Vec<i64> {
    let claim = actix_outbox::testing::claim(conn, &ClaimParams { batch, ..params(Some(cursor), LONG) }).await.unwrap();
    let (snapshot, taken) = claim.cursor.clone().unwrap();
    cursor.advance(&snapshot, &taken);
    ids(&claim)
}

/// One claim of at most `batch` rows from `cursor` (left where it is), its rows then done.
async fn claim_done(conn: &mut AsyncPgConnection, cursor: &Cursor, batch: usize) -> Vec<i64> {
    let claim = actix_outbox::testing::claim(conn, &ClaimParams { batch, ..params(Some(cursor), LONG) }).await.unwrap();
    let fences: Vec<_> = claim.messages.iter().map(|m| m.fence()).collect();
    actix_outbox::testing::mark_done(conn, &fences).await.unwrap();
    ids(&claim)
}

fn ids(claim: &Claim) -> Vec<i64> {
    claim.messages.iter().map(|m| m.id).collect()
}

async fn sweep(conn: &mut AsyncPgConnection, stray_after: Duration) -> Swept {
    let params = SweepParams { max_attempts: 12, chunk: 10_000, stray_after, claimed_to: None };
    actix_outbox::testing::sweep(conn, params).await.unwrap().expect("no other sweep runs")
}

async fn horizon(conn: &mut AsyncPgConnection) -> Snapshot {
    actix_outbox::testing::horizon(conn).await.unwrap()
}

/// The transaction that inserted row `id`.
async fn txid(db: &TestDb, id: i64) -> u64 {
    db.scalar(&format!("SELECT txid::text::bigint AS n FROM outbox WHERE id = {id}")).await as u64
}

/// The horizon moves past rows only once they are finished: the first sweep takes the snapshot
/// of now as its candidate, the next finds every row visible in it done and makes it the
/// horizon. A pending row keeps it before its transaction. A cursor that starts at the horizon
/// finds nothing it would have to pass again, and takes the next row.
#[tokio::test]
async fn the_horizon_moves_past_finished_rows_only_and_a_cursor_starts_there() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    assert_eq!(horizon(&mut conn).await, Snapshot::origin());
    let ids10 = db.seed(10, "a").await;
    let held = db.seed(1, "b").await[0];
    let everything = Cursor::at(Snapshot::origin());
    // Take the ten, leave the eleventh pending.
    assert_eq!(claim_done(&mut conn, &everything, 10).await, ids10);

    for _ in 0..3 {
        let swept = sweep(&mut conn, LONG).await;
        assert_eq!((swept.expired, swept.strays, swept.reaped.len()), (0, 0, 0));
    }
    let (done_tx, held_tx) = (txid(&db, ids10[0]).await, txid(&db, held).await);
    let h = horizon(&mut conn).await;
    assert!(h.visible(done_tx) && !h.visible(held_tx), "past the done rows, before the pending one: {h}");

    let rest = actix_outbox::testing::claim(&mut conn, &params(Some(&everything), LONG)).await.unwrap();
    assert_eq!(ids(&rest), vec![held]);
    actix_outbox::testing::mark_done(&mut conn, &[rest.messages[0].fence()]).await.unwrap();
    let first = sweep(&mut conn, LONG).await;
    let second = sweep(&mut conn, LONG).await;
    assert!(first.moved || second.moved, "{first:?} {second:?}");
    let h = horizon(&mut conn).await;
    assert_ne!(h, Snapshot::origin());

    let mut fresh = Cursor::at(h.clone());
    assert_eq!(fresh.from(), (h.xmax(), 0), "it starts after everything the horizon shows");
    assert_eq!(claim_with(&mut conn, &mut fresh).await, Vec::<i64>::new());
    let next = db.seed(1, "c").await;
    assert_eq!(claim_with(&mut conn, &mut fresh).await, next);
}

/// A new row whose worker died mid-publish: once its lease runs out, the sweep moves it to wait
/// in `outbox_later`, due at once, and the next claim takes it over with the next fence and
/// attempt. With no attempt left the sweep reaps it instead.
#[tokio::test]
async fn an_expired_lease_is_handed_to_the_next_claim_or_reaped() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let [first, second] = db.seed(2, "a").await[..] else { unreachable!() };
    let crashed = actix_outbox::testing::claim(&mut conn, &params(None, Duration::from_millis(100))).await.unwrap();
    assert_eq!(ids(&crashed), vec![first, second]);
    // The second row is on its last attempt.
    conn.batch_execute(&format!("UPDATE outbox SET attempts = 12 WHERE id = {second}")).await.unwrap();
    eventually(Duration::from_secs(10), "both leases run out", || async {
        db.scalar("SELECT count(*) AS n FROM outbox WHERE status = 'processing' AND lease_until < now()").await == 2
    })
    .await;
    assert!(ids(&actix_outbox::testing::claim(&mut conn, &params(None, LONG)).await.unwrap()).is_empty());

    let swept = sweep(&mut conn, LONG).await;
    assert_eq!(swept.expired, 1);
    assert_eq!(swept.reaped.iter().map(|f| (f.id, f.lease_version)).collect::<Vec<_>>(), vec![(second, 1)]);
    let reaped = db.row(second).await;
    assert_eq!((reaped.status, reaped.lease_version), (Status::Dead, 2));
    let waiting = db.row(first).await;
    assert_eq!(waiting.status, Status::Processing, "still its crashed worker's until taken over");
    assert!(waiting.available_at > waiting.created_at, "it waits in outbox_later: {waiting:?}");

    let taken = actix_outbox::testing::claim(&mut conn, &params(None, LONG)).await.unwrap();
    assert_eq!(ids(&taken), vec![first]);
    assert_eq!((taken.messages[0].lease_version, taken.messages[0].attempts), (2, 2));
    // The crashed worker's late write is fenced off.
    let won = actix_outbox::testing::mark_done(&mut conn, &[crashed.messages[0].fence()]).await.unwrap();
    assert!(won.is_empty());
    assert_eq!(
        actix_outbox::admin::dead_list(&mut conn, 10).await.unwrap().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![second]
    );
}

/// A row that a claim found locked by another statement (here an operator's `SELECT ... FOR
/// UPDATE` that then rolls back) is passed by the cursor. The sweep finds it pending behind
/// claimed rows and, once it is older than the stray age, moves it to `outbox_later`, where the
/// next claim takes it.
#[tokio::test]
async fn a_row_the_claims_passed_while_it_was_locked_is_moved_by_the_sweep() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = Cursor::at(horizon(&mut conn).await);
    let [a, b, c] = db.seed(3, "a").await[..] else { unreachable!() };
    let mut locker = db.conn().await;
    locker.batch_execute(&format!("BEGIN; SELECT 1 FROM outbox WHERE id = {b} FOR UPDATE")).await.unwrap();
    assert_eq!(claim_with(&mut conn, &mut cursor).await, vec![a, c]);
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(claim_with(&mut conn, &mut cursor).await, Vec::<i64>::new(), "the cursor passed it");

    // Younger than the stray age: left alone (a claim may still hold it).
    assert_eq!(sweep(&mut conn, LONG).await.strays, 0);
    assert_eq!(db.row(b).await.status, Status::Pending);
    let swept = sweep(&mut conn, Duration::ZERO).await;
    assert_eq!((swept.strays, swept.expired), (1, 0));
    assert_eq!(claim_with(&mut conn, &mut cursor).await, vec![b], "the next claim takes it from outbox_later");
    let row = db.row(b).await;
    assert_eq!((row.status, row.lease_version, row.attempts), (Status::Processing, 1, 1));
}

/// Rows the claims passed that end exactly where one of the sweep's stretches ends: the claimed
/// rows that show they were passed lie in the next stretch. The sweep still finds them (it looks
/// one row past its stretch), instead of missing them in every pass, whose stretches end at the
/// same rows while they stay pending.
#[tokio::test]
async fn rows_passed_at_the_end_of_a_sweep_stretch_are_found() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = Cursor::at(horizon(&mut conn).await);
    let [a, b, c, d] = db.seed(4, "a").await[..] else { unreachable!() };
    let mut locker = db.conn().await;
    locker.batch_execute(&format!("BEGIN; SELECT 1 FROM outbox WHERE id IN ({a}, {b}) FOR UPDATE")).await.unwrap();
    assert_eq!(claim_with(&mut conn, &mut cursor).await, vec![c, d]);
    locker.batch_execute("ROLLBACK").await.unwrap();

    // Stretches of two rows: [a, b], then [c, d].
    let params = SweepParams { max_attempts: 12, chunk: 2, stray_after: Duration::ZERO, claimed_to: None };
    let mut strays = 0;
    for _ in 0..4 {
        strays += actix_outbox::testing::sweep(&mut conn, params).await.unwrap().expect("no other sweep runs").strays;
    }
    assert_eq!(strays, 2, "both passed rows are moved");
    assert_eq!(claim_with(&mut conn, &mut cursor).await, vec![a, b], "the next claim takes them from outbox_later");
}

/// A backlog being drained: the horizon follows the finished rows at the end of each pass, up
/// to the first transaction with a row still unfinished, and never past a transaction still in
/// progress: a row it commits later, behind rows already finished, is taken by a cursor that
/// starts at the horizon.
#[tokio::test]
async fn the_horizon_follows_a_drain_and_keeps_a_late_commit_ahead_of_it() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Begun first, committed last.
    let mut late = db.conn().await;
    late.batch_execute(
        "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', 'late', 'e', '{}')",
    )
    .await
    .unwrap();
    let first = db.seed(3, "a").await;
    let second = db.seed(3, "b").await;
    let cursor = Cursor::at(horizon(&mut conn).await);
    assert_eq!(claim_done(&mut conn, &cursor, 3).await, first);

    for _ in 0..3 {
        sweep(&mut conn, LONG).await;
    }
    let (first_tx, second_tx) = (txid(&db, first[0]).await, txid(&db, second[0]).await);
    let h = horizon(&mut conn).await;
    assert!(h.visible(first_tx), "the finished transaction is behind the horizon: {h}");
    assert!(!h.visible(second_tx), "the pending one is ahead of it: {h}");

    late.batch_execute("COMMIT").await.unwrap();
    let late_id = db.scalar("SELECT id AS n FROM outbox WHERE aggregate_id = 'late'").await;
    let late_tx = txid(&db, late_id).await;
    assert!(late_tx < first_tx, "the late row's transaction began first");
    assert!(!h.visible(late_tx), "a transaction in progress is never behind the horizon: {h}");
    let mut fresh = Cursor::at(h);
    let mut got = claim_with(&mut conn, &mut fresh).await;
    got.sort_unstable();
    let mut want = vec![late_id];
    want.extend(&second);
    want.sort_unstable();
    assert_eq!(got, want, "a cursor from the horizon takes the late row and the pending ones");
}

async fn sweep_to(
    conn: &mut AsyncPgConnection,
    chunk: usize,
    stray_after: Duration,
    claimed_to: Option<(u64, i64)>,
) -> Swept {
    let params = SweepParams { max_attempts: 12, chunk, stray_after, claimed_to };
    actix_outbox::testing::sweep(conn, params).await.unwrap().expect("no other sweep runs")
}

/// A backlog the claims have not reached: a pass ends at the first full stretch of rows that no
/// claim took, after where this process's claims have passed, instead of walking the rest of the
/// backlog; without that position it walks on.
#[tokio::test]
async fn a_sweep_pass_ends_where_the_claims_are() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = Cursor::at(horizon(&mut conn).await);
    let backlog = db.seed(10, "a").await;
    let taken = claim_batch(&mut conn, &mut cursor, 2).await;
    assert_eq!(taken, backlog[..2]);

    // Stretches of 2: the claimed pair, then a stretch of untouched rows after the cursor.
    let first = sweep_to(&mut conn, 2, LONG, Some(cursor.from())).await;
    assert!(first.more, "the claimed stretch: {first:?}");
    let second = sweep_to(&mut conn, 2, LONG, Some(cursor.from())).await;
    assert!(!second.more, "the untouched stretch ends the pass: {second:?}");
    let again = sweep_to(&mut conn, 2, LONG, Some(cursor.from())).await;
    assert!(again.more, "the next pass starts again from the horizon: {again:?}");

    // Without the claims' position the pass walks the backlog to its end.
    let mut runs = 0;
    while sweep_to(&mut conn, 2, LONG, None).await.more {
        runs += 1;
    }
    assert_eq!(runs, 3, "10 rows in stretches of 2, after the one the pass begun above read");
    let h = horizon(&mut conn).await;
    assert!(!h.visible(txid(&db, backlog[0]).await), "the backlog's transaction stays ahead of the horizon: {h}");
}

/// A run of rows the claims passed, longer than a stretch, then claimed rows: the frontier does
/// not cut the pass short there (the rows lie before where the claims have passed), and the
/// sweep moves every one of them.
#[tokio::test]
async fn a_long_run_of_passed_rows_is_still_found_with_the_frontier() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = Cursor::at(horizon(&mut conn).await);
    let rows = db.seed(8, "a").await;
    let (held, claimed) = rows.split_at(5);
    let mut locker = db.conn().await;
    let list = held.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    locker.batch_execute(&format!("BEGIN; SELECT 1 FROM outbox WHERE id IN ({list}) FOR UPDATE")).await.unwrap();
    assert_eq!(claim_with(&mut conn, &mut cursor).await, claimed);
    locker.batch_execute("ROLLBACK").await.unwrap();

    let mut strays = 0;
    for _ in 0..12 {
        strays += sweep_to(&mut conn, 2, Duration::ZERO, Some(cursor.from())).await.strays;
    }
    assert_eq!(strays, 5, "every passed row is moved");
    let mut got = claim_with(&mut conn, &mut cursor).await;
    got.sort_unstable();
    assert_eq!(got, held, "the next claim takes them from outbox_later");
}

/// Rows another process claimed, and whose lease then ran out, beyond rows nobody took (the
/// other process passed them while an operator's statement held them locked) and beyond this
/// process's claims: the pass ends at the untouched rows, and this process's claims, which take
/// those next, bring the frontier past the expired rows, which the sweep then hands over.
#[tokio::test]
async fn expired_leases_beyond_untouched_rows_are_handed_over_once_the_claims_reach_them() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut cursor = Cursor::at(horizon(&mut conn).await);
    let rows = db.seed(6, "a").await;
    // Another process took the last two, with a short lease, and died.
    db.scalar(&format!(
        "WITH t AS (UPDATE outbox SET status = 'processing', lease_owner = 'B', lease_version = 1, attempts = 1, \
         lease_until = now() + interval '100 milliseconds' WHERE id IN ({}, {}) RETURNING 1) SELECT count(*) AS n FROM t",
        rows[4], rows[5]
    ))
    .await;
    eventually(Duration::from_secs(10), "the leases run out", || async {
        db.scalar("SELECT count(*) AS n FROM outbox WHERE status = 'processing' AND lease_until < now()").await == 2
    })
    .await;
    let mut expired = 0;
    for _ in 0..6 {
        expired += sweep_to(&mut conn, 2, LONG, Some(cursor.from())).await.expired;
    }
    assert_eq!(expired, 0, "behind untouched rows after this process's claims");
    let taken = claim_batch(&mut conn, &mut cursor, 4).await;
    assert_eq!(taken, rows[..4]);
    for _ in 0..6 {
        expired += sweep_to(&mut conn, 2, LONG, Some(cursor.from())).await.expired;
    }
    assert_eq!(expired, 2, "handed over once the claims passed the rows before them");
}
