//! The operating cost of the FIFO gate made visible: which aggregates a dead row holds back.
//!
//! Under the [gate](crate::Fifo), a dead row blocks every later gated row of its aggregate until
//! an operator takes one of the two ways out:
//! - [`dead_retry`](super::dead_retry): the row goes back to `pending` with its attempts reset;
//!   it is claimed again as the head, and the rows behind it follow once it is done;
//! - [`dead_skip`](super::dead_skip): the row is marked `done` without being published, with
//!   `last_error = 'skipped by operator: <reason> (was: <its error>)'`; the next row becomes the
//!   head. Consumers never see the skipped event: a gap the operator accepts on purpose.

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Int4, Int8, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;

use super::sql::{BLOCKED_COUNT_SQL, BLOCKED_SQL};
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
    Ok(diesel::sql_query(BLOCKED_SQL)
        .bind::<Nullable<Array<Text>>, _>(types)
        .bind::<BigInt, _>(limit.max(0))
        .load(conn)
        .await?)
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
    let count: Count =
        diesel::sql_query(BLOCKED_COUNT_SQL).bind::<Nullable<Array<Text>>, _>(types).get_result(conn).await?;
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
