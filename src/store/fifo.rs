//! The operating cost of the FIFO gate made visible: which aggregates a dead row holds back.
//!
//! Under the [gate](crate::Fifo), a dead row blocks every later gated row of its aggregate until
//! an operator takes one of the two ways out:
//! - [`dead_retry`](super::dead_retry): the row goes back to `pending` with its attempts reset;
//!   it is claimed again as the head, and the rows behind it follow once it is done;
//! - [`dead_skip`](super::dead_skip): the row is marked `done` without being published, with
//!   `last_error = 'skipped by operator: <reason> (was: <its error>)'`; the next row becomes the
//!   head. Consumers never see the skipped event: a gap the operator accepts on purpose.
//!
//! The gate also has an index of its own, built only where the gate is used
//! ([`ensure_fifo_index`]).

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::Bool;
use diesel::sql_types::{Array, BigInt, Int4, Int8, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::Serialize;
use tracing::info;

use super::pool::in_transaction;
use super::sql::{
    BLOCKED_COUNT_SQL, BLOCKED_SQL, FIFO_INDEX_CREATE_SQL, FIFO_INDEX_DROP_SQL, FIFO_INDEX_STATE_SQL,
    FIFO_INDEX_TRY_LOCK_SQL, FIFO_INDEX_UNLOCK_SQL,
};
use crate::config::Fifo;
use crate::error::StoreError;

/// An aggregate whose first unfinished gated row is dead: nothing more of it is claimed until
/// that row is retried or skipped.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName, Serialize)]
#[non_exhaustive]
pub struct BlockedAggregate {
    /// The aggregate's type.
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    /// The aggregate's id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// The dead row at the head of the aggregate: the one to retry or skip.
    #[diesel(sql_type = Int8)]
    pub dead_id: i64,
    /// Its event type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// Why it went dead.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// Claims it had.
    #[diesel(sql_type = Int4)]
    pub attempts: i32,
    /// When it was inserted.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// Unfinished gated rows of the aggregate after it: the rows it holds back. Zero when
    /// nothing waits yet; the aggregate's next gated event will.
    #[diesel(sql_type = Int8)]
    pub waiting: i64,
}

/// The aggregates blocked by a dead row under `fifo`, oldest dead row first, at most `limit`.
///
/// Pass the gate the dispatchers run with: with [`Fifo::EventTypes`] only rows of the listed
/// types block or wait (a dead row of another type blocks nothing and is not listed here,
/// though [`dead_list`](super::dead_list) shows it); with [`Fifo::Off`] nothing is ever
/// blocked and the list is empty. An aggregate whose head is still pending or processing is
/// moving, and is not listed even if a later row is dead; it is listed once that row becomes
/// the head. [`blocked_aggregates_count`] counts them all.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::Fifo;
/// use actix_outbox::admin::{blocked_aggregates, dead_retry};
///
/// for blocked in blocked_aggregates(conn, &Fifo::All, 100).await? {
///     println!("{}/{} held by #{} ({}): {} waiting; {:?}", blocked.aggregate_type, blocked.aggregate_id,
///         blocked.dead_id, blocked.event_type, blocked.waiting, blocked.last_error);
/// }
/// dead_retry(conn, &[17]).await?;
/// # Ok(()) }
/// ```
pub async fn blocked_aggregates(
    conn: &mut AsyncPgConnection,
    fifo: &Fifo,
    limit: i64,
) -> Result<Vec<BlockedAggregate>, StoreError> {
    let Some(types) = gated_types(fifo) else { return Ok(Vec::new()) };
    let query = diesel::sql_query(BLOCKED_SQL).bind::<Nullable<Array<Text>>, _>(types).bind::<BigInt, _>(limit.max(0));
    in_transaction(conn, async |conn| Ok(query.load(conn).await?)).await
}

/// How many aggregates are blocked by a dead row under `fifo`: the length
/// [`blocked_aggregates`] would have without a limit, counted by the database (the same rule,
/// from the same SQL text), without loading the rows.
///
/// Zero with [`Fifo::Off`]. It is a separate statement: read it in the same `REPEATABLE READ`
/// transaction as [`blocked_aggregates`] when the two must agree.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::Fifo;
/// use actix_outbox::admin::blocked_aggregates_count;
///
/// let n = blocked_aggregates_count(conn, &Fifo::event_types(["order.created", "order.paid"])).await?;
/// println!("{n} aggregates wait for an operator");
/// # Ok(()) }
/// ```
pub async fn blocked_aggregates_count(conn: &mut AsyncPgConnection, fifo: &Fifo) -> Result<i64, StoreError> {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let Some(types) = gated_types(fifo) else { return Ok(0) };
    let query = diesel::sql_query(BLOCKED_COUNT_SQL).bind::<Nullable<Array<Text>>, _>(types);
    let count: Count = in_transaction(conn, async |conn| Ok::<_, StoreError>(query.get_result(conn).await?)).await?;
    Ok(count.n)
}

/// The `$1` of [`BLOCKED_SQL`] and [`BLOCKED_COUNT_SQL`]: `None` when the gate is off (nothing can be blocked, no query
/// is needed), otherwise the gated event types, `Some(None)` (SQL `NULL`) meaning every type.
fn gated_types(fifo: &Fifo) -> Option<Option<&[String]>> {
    match fifo {
        Fifo::Off => None,
        Fifo::All => Some(None),
        Fifo::EventTypes(types) => Some(Some(types)),
    }
}

#[derive(QueryableByName)]
struct State {
    #[diesel(sql_type = Nullable<Bool>)]
    valid: Option<bool>,
}

/// Whether the FIFO gate's index is there and valid, read in a transaction of its own (or the
/// caller's): what a dispatcher behind a transaction pooler without a session checks, since it
/// cannot build the index itself.
pub(crate) async fn fifo_index_valid(conn: &mut AsyncPgConnection) -> Result<bool, StoreError> {
    let state: State = in_transaction(conn, async |conn| {
        Ok::<_, StoreError>(diesel::sql_query(FIFO_INDEX_STATE_SQL).get_result(conn).await?)
    })
    .await?;
    Ok(state.valid == Some(true))
}

/// How often a dispatcher waiting for another's build of the FIFO index looks again.
const FIFO_INDEX_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Builds the FIFO gate's index, `outbox_fifo_gate`, unless it is there and valid; returns
/// whether this call built it.
///
/// Only the [gate](crate::Fifo) reads that index, and every insert and claim would pay for it,
/// so the migrations do not create it: a dispatcher whose `fifo` is on calls this before its
/// first claim, and `actix-outbox migrate --fifo` calls it ahead of time (a good idea on a big
/// table: the build reads the whole table once). The build is `CREATE INDEX CONCURRENTLY`:
/// producers and other dispatchers go on writing, and it waits for transactions already open on
/// the table to end. One caller at a time builds (a session advisory lock, tried every 50 ms,
/// so no statement waits on it); the others return once the index is valid. An invalid index a
/// failed build left behind is dropped and built again. Takes a session of its own, outside any
/// transaction (a `CONCURRENTLY` statement cannot run inside one): a direct connection, not
/// one through a transaction pooler.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), actix_outbox::StoreError> {
/// if actix_outbox::admin::ensure_fifo_index(conn).await? {
///     println!("built the FIFO gate's index");
/// }
/// # Ok(()) }
/// ```
pub async fn ensure_fifo_index(conn: &mut AsyncPgConnection) -> Result<bool, StoreError> {
    #[derive(QueryableByName)]
    struct Locked {
        #[diesel(sql_type = Bool)]
        locked: bool,
    }
    loop {
        let state: State = diesel::sql_query(FIFO_INDEX_STATE_SQL).get_result(conn).await?;
        if state.valid == Some(true) {
            return Ok(false);
        }
        let lock: Locked = diesel::sql_query(FIFO_INDEX_TRY_LOCK_SQL).get_result(conn).await?;
        if !lock.locked {
            tokio::time::sleep(FIFO_INDEX_POLL).await;
            continue;
        }
        let built = async {
            // Looked at again under the lock: another builder may have finished meanwhile.
            let state: State = diesel::sql_query(FIFO_INDEX_STATE_SQL).get_result(conn).await?;
            match state.valid {
                Some(true) => return Ok(false),
                Some(false) => {
                    info!("dropping the invalid index outbox_fifo_gate an earlier build left behind");
                    conn.batch_execute(FIFO_INDEX_DROP_SQL).await?;
                }
                None => {}
            }
            info!("building the FIFO gate's index outbox_fifo_gate (once per table; producers keep writing)");
            let started = std::time::Instant::now();
            conn.batch_execute(FIFO_INDEX_CREATE_SQL).await?;
            info!(took = ?started.elapsed(), "built the FIFO gate's index outbox_fifo_gate");
            Ok::<_, StoreError>(true)
        }
        .await;
        let unlocked = diesel::sql_query(FIFO_INDEX_UNLOCK_SQL).get_result::<Locked>(conn).await;
        let built = built?;
        unlocked?;
        return Ok(built);
    }
}
