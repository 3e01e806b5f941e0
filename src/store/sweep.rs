//! The sweep: what keeps the new rows' part of the table small and nothing in it stranded. One
//! process of a fleet at a time runs it (the first to lock `outbox_horizon`'s row; the others
//! skip their turn), every second or so.
//!
//! The rows after the outbox's horizon are the ones a claim can still meet as new (see
//! `cursor.rs`). The sweep walks them in `(txid, id)` order, a stretch per run, and:
//!
//! - moves a row whose lease expired to `outbox_later` (due at once), where the next claim
//!   takes it over with the next `lease_version`; or, with no attempt left, sends it `dead`
//!   (reaped: a message that keeps killing its worker);
//! - moves a stray to `outbox_later`: a pending row that every cursor passed, which is known by
//!   rows after it that were claimed while it was not, and by its age (a claim that held it
//!   locked and then failed, a row an operator's statement held locked, a process killed
//!   mid-claim);
//! - moves the horizon forward: once a whole pass found every row visible in its *candidate*
//!   snapshot finished (or moved), the candidate becomes the horizon; a pass that met unfinished
//!   rows visible in it moves the horizon to the candidate without their transactions and every
//!   later one ([`Snapshot::before`]), when that is ahead. Either way the snapshot of now is the
//!   next candidate. Starting cursors begin at the horizon, and the rows before it are read by
//!   nobody again.
//!
//! It also reaps the rows waiting in `outbox_later` whose lease expired with no attempt left
//! (claims take over those with attempts left directly), and parks where dead rows are kept the
//! new rows made dead by something else (an operator's statement), so that listings see them.
//!
//! Its cost per run is bounded by the stretch (`chunk` rows), whatever the backlog; a run that
//! filled its stretch asks to be run again soon. A pass also ends at the claims' frontier: a
//! full stretch of rows no claim ever took, all after where the sweeping process's own claims
//! have passed ([`SweepParams::claimed_to`]). Nothing there is anybody's to take over or to
//! move, so a backlog the workers are draining costs a pass the rows from the horizon to where
//! the claims are, not the rest of the backlog, and the horizon (moved at each pass's end to
//! just before the first unfinished transaction) keeps up with the drain. Rows past such a
//! stretch that another process claimed and then lost (a run of rows it passed while an
//! operator's statement held them locked, then died) are walked once this process's claims
//! have taken the run: within the time its claims take to get there.

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, Bool, Int4, Int8, Interval, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::claim::interval;
use super::cursor::{Position, Snapshot};
use super::pool::through_indexes;
use super::sql::{
    HORIZON_SQL, SWEEP_EVICT_SQL, SWEEP_LOCK_SQL, SWEEP_PARK_SQL, SWEEP_REAP_LATER_SQL, SWEEP_REAP_SQL, SWEEP_SAVE_SQL,
    SWEEP_STRETCH_SQL,
};
use crate::error::StoreError;
use crate::model::Fence;

/// What one sweep may do.
#[derive(Debug, Clone, Copy)]
pub struct SweepParams {
    /// Rows whose lease expired at this many attempts are reaped.
    pub max_attempts: i32,
    /// Rows walked per run at most (one more is read, to tell whether the last were passed).
    pub chunk: usize,
    /// A pending row passed by the claims is moved only once it is this old.
    pub stray_after: Duration,
    /// Where the claims of the process that sweeps have passed to (its cursor's
    /// [`from`](super::Cursor::from)), if it knows: a full stretch of rows that no claim has
    /// taken, all after it, ends the pass (see the module docs). `None`: every pass walks to
    /// the end.
    pub claimed_to: Option<Position>,
}

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Rows whose lease expired, moved to `outbox_later` for a claim to take over.
    pub expired: usize,
    /// Pending rows the cursors had passed, moved to `outbox_later`.
    pub strays: usize,
    /// Rows reaped (lease expired, no attempt left), as (id, fence at the time).
    pub reaped: Vec<Fence>,
    /// The stretch was full: run again soon.
    pub more: bool,
    /// The horizon after the run.
    pub horizon: Option<Snapshot>,
    /// Whether this run moved it.
    pub moved: bool,
}

#[derive(QueryableByName)]
struct State {
    #[diesel(sql_type = Text)]
    horizon: String,
    #[diesel(sql_type = Text)]
    candidate: String,
    #[diesel(sql_type = Nullable<Text>)]
    pass_txid: Option<String>,
    #[diesel(sql_type = Nullable<Int8>)]
    pass_id: Option<i64>,
    #[diesel(sql_type = Bool)]
    pass_clean: bool,
    #[diesel(sql_type = Text)]
    now: String,
}

#[derive(QueryableByName, Debug)]
struct Row {
    #[diesel(sql_type = Int8)]
    id: i64,
    #[diesel(sql_type = Text)]
    txid: String,
    /// [`PENDING`], 1 (processing, its lease running), [`EXPIRED`], [`FINISHED`] or
    /// [`DEAD_UNPARKED`].
    #[diesel(sql_type = Int4)]
    state: i32,
    #[diesel(sql_type = Int4)]
    attempts: i32,
    /// Older than the stray age.
    #[diesel(sql_type = Bool)]
    old: bool,
    /// Never claimed (`lease_version` 0).
    #[diesel(sql_type = Bool)]
    untouched: bool,
}

impl Row {
    /// Its place in the walk, `(txid, id)`; `None` for a `txid` that is not a number.
    fn position(&self) -> Option<Position> {
        self.txid.parse::<u64>().ok().map(|t| (t, self.id))
    }
}

/// A stretch row that is pending.
const PENDING: i32 = 0;
/// Processing, its lease expired.
const EXPIRED: i32 = 2;
/// Done, or dead where dead rows are kept.
const FINISHED: i32 = 3;
/// Dead, but not where dead rows are kept (made dead by hand).
const DEAD_UNPARKED: i32 = 4;

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = Int8)]
    id: i64,
}

#[derive(QueryableByName)]
struct Reaped {
    #[diesel(sql_type = Int8)]
    id: i64,
    #[diesel(sql_type = Int8)]
    lease_version: i64,
}

/// The outbox's horizon: every row whose transaction is visible in it is finished or waits in
/// `outbox_later`. Where a starting dispatcher's cursor begins.
pub async fn horizon(conn: &mut AsyncPgConnection) -> Result<Snapshot, StoreError> {
    #[derive(QueryableByName)]
    struct Horizon {
        #[diesel(sql_type = Text)]
        horizon: String,
    }
    let row: Horizon = diesel::sql_query(HORIZON_SQL).get_result(conn).await?;
    Snapshot::parse(&row.horizon).map_err(|e| StoreError::Query(diesel::result::Error::DeserializationError(e.into())))
}

/// Runs one sweep (see the module docs) in a transaction of its own that reads through indexes
/// only; `None` when another process is sweeping.
pub async fn sweep(conn: &mut AsyncPgConnection, params: SweepParams) -> Result<Option<Swept>, StoreError> {
    through_indexes(conn, async |conn| sweep_in(conn, params).await).await
}

async fn sweep_in(conn: &mut AsyncPgConnection, params: SweepParams) -> Result<Option<Swept>, StoreError> {
    let bad = |e: super::cursor::BadSnapshot| StoreError::Query(diesel::result::Error::DeserializationError(e.into()));
    let Some(state) = diesel::sql_query(SWEEP_LOCK_SQL).get_results::<State>(conn).await?.pop() else {
        return Ok(None);
    };
    let now = Snapshot::parse(&state.now).map_err(bad)?;
    let (mut horizon, mut candidate) =
        (Snapshot::parse(&state.horizon).map_err(bad)?, Snapshot::parse(&state.candidate).map_err(bad)?);
    let mut pass =
        state.pass_txid.as_deref().zip(state.pass_id).and_then(|(t, id)| t.parse::<u64>().ok().map(|t| (t, id)));
    let mut clean = state.pass_clean;
    if horizon.xmax() > now.xmax() || candidate.xmax() > now.xmax() {
        // Transaction ids from another cluster (the table was restored from a dump): start over.
        (horizon, candidate, pass, clean) = (Snapshot::origin(), Snapshot::origin(), None, true);
    }
    // A pass begins with the rows of the transactions in progress at the horizon, then walks
    // those after it, a stretch per run.
    let at_start = pass.is_none();
    let from: Position = pass.unwrap_or((horizon.xmax(), 0));
    let late: Vec<String> =
        if at_start { horizon.in_progress().iter().map(u64::to_string).collect() } else { Vec::new() };
    let chunk = i64::try_from(params.chunk).unwrap_or(i64::MAX).clamp(1, i64::MAX - 1);
    // One row past the stretch, read only to tell whether the stretch's last rows were passed.
    let mut rows: Vec<Row> = diesel::sql_query(SWEEP_STRETCH_SQL)
        .bind::<Array<Text>, _>(&late)
        .bind::<Text, _>(from.0.to_string())
        .bind::<Int8, _>(from.1)
        .bind::<Int8, _>(chunk + 1)
        .bind::<Interval, _>(interval(params.stray_after))
        .load(conn)
        .await?;
    // The rows after the horizon, as against those of its transactions in progress probed at a
    // pass's start.
    let after_horizon = |r: &&Row| r.position().is_some_and(|(t, _)| t >= horizon.xmax());
    let walked = rows.iter().filter(after_horizon).count();
    let full = walked as i64 > chunk;
    let next = if full { rows.pop() } else { None };
    // The claims' frontier: a full stretch of rows never claimed, all after where this
    // process's claims have passed. Nothing there or after it is anybody's to take over or to
    // move (rows another process passed are walked when that process sweeps), so the pass ends
    // here instead of walking the rest of a backlog the claims have not reached, run after run.
    let at_frontier = full
        && params.claimed_to.is_some_and(|passed| {
            rows.iter()
                .filter(after_horizon)
                .all(|r| r.state == PENDING && r.untouched && r.position().is_some_and(|p| p > passed))
        });
    let more = full && !at_frontier;

    // A pending row that is followed by a claimed one was passed by the claims.
    let mut expired = Vec::new();
    let mut strays = Vec::new();
    let mut reap = Vec::new();
    let mut claimed_after = next.is_some_and(|r| r.state != PENDING);
    for row in rows.iter().rev() {
        match row.state {
            EXPIRED if row.attempts >= params.max_attempts => reap.push(row.id),
            EXPIRED => expired.push(row.id),
            PENDING if claimed_after && row.old => strays.push(row.id),
            _ => {}
        }
        if row.state != PENDING {
            claimed_after = true;
        }
    }
    let evict: Vec<i64> = expired.iter().chain(&strays).copied().collect();
    let unparked: Vec<i64> = rows.iter().filter(|r| r.state == DEAD_UNPARKED).map(|r| r.id).collect();
    if !unparked.is_empty() {
        diesel::sql_query(SWEEP_PARK_SQL).bind::<Array<Int8>, _>(&unparked).execute(conn).await?;
    }
    let moved: Vec<i64> = if evict.is_empty() {
        Vec::new()
    } else {
        diesel::sql_query(SWEEP_EVICT_SQL)
            .bind::<Array<Int8>, _>(&evict)
            .load::<Id>(conn)
            .await?
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    let mut reaped: Vec<Fence> = if reap.is_empty() {
        Vec::new()
    } else {
        diesel::sql_query(SWEEP_REAP_SQL)
            .bind::<Array<Int8>, _>(&reap)
            .bind::<Int4, _>(params.max_attempts)
            .load::<Reaped>(conn)
            .await?
            .into_iter()
            .map(|r| Fence { id: r.id, lease_version: r.lease_version })
            .collect()
    };
    reaped.extend(
        diesel::sql_query(SWEEP_REAP_LATER_SQL)
            .bind::<Array<Int8>, _>(Vec::<i64>::new())
            .bind::<Int4, _>(params.max_attempts)
            .load::<Reaped>(conn)
            .await?
            .into_iter()
            .map(|r| Fence { id: r.id, lease_version: r.lease_version }),
    );
    // Rows visible in the candidate that are still new and unfinished keep the horizon behind
    // their transaction: the candidate loses every transaction from the first of them on, and
    // what is left of it, every row of which this pass found finished, is where the horizon
    // can go.
    let gone = |id: i64| moved.contains(&id) || reaped.iter().any(|f| f.id == id);
    let first_dirty = rows
        .iter()
        .filter(|r| r.state != FINISHED && r.state != DEAD_UNPARKED && !gone(r.id))
        .filter_map(|r| r.position().map(|(t, _)| t))
        .filter(|&t| candidate.visible(t))
        .min();
    if let Some(t) = first_dirty {
        candidate = candidate.before(t);
        clean = false;
    }
    let mut advanced = false;
    if at_frontier {
        // The rows after the frontier are unseen: the horizon takes none of their transactions.
        if let Some(last) = rows.iter().filter_map(Row::position).max() {
            candidate = candidate.before(last.0);
        }
    }
    if more {
        pass = rows.iter().filter_map(Row::position).max();
    } else {
        // A clean pass moves the horizon to the whole candidate; one that met unfinished rows,
        // to the part of it before them, when that is ahead of the horizon (a backlog being
        // drained: the next passes start after the rows finished so far).
        if clean || (candidate.covers(&horizon) && candidate != horizon) {
            horizon = candidate;
            advanced = true;
        }
        candidate = now;
        pass = None;
        clean = true;
    }
    diesel::sql_query(SWEEP_SAVE_SQL)
        .bind::<Text, _>(horizon.to_string())
        .bind::<Text, _>(candidate.to_string())
        .bind::<Nullable<Text>, _>(pass.map(|(t, _)| t.to_string()))
        .bind::<Nullable<Int8>, _>(pass.map(|(_, id)| id))
        .bind::<Bool, _>(clean)
        .execute(conn)
        .await?;
    reaped.sort_by_key(|f| f.id);
    Ok(Some(Swept {
        expired: moved.iter().filter(|id| expired.contains(id)).count(),
        strays: moved.iter().filter(|id| strays.contains(id)).count(),
        reaped,
        more,
        horizon: Some(horizon),
        moved: advanced,
    }))
}
