//! The producer side: insert events inside the caller's own transaction.

use diesel::sql_types::Text;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

use super::sql::LOCK_AGGREGATE_SQL;
use crate::error::StoreError;
use crate::model::NewEvent;
use crate::schema::outbox;

/// Inserts `event` into the outbox on `conn` and returns its id.
///
/// Call it inside the transaction that makes the business change, so that both commit or
/// neither does: the event then exists exactly when the change does.
///
/// ```no_run
/// use actix_outbox::{NewEvent, enqueue};
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
///
/// # async fn f(conn: &mut AsyncPgConnection) -> Result<(), actix_outbox::StoreError> {
/// let id = conn
///     .transaction(async |tx| {
///         // ... the business write on `tx` ...
///         enqueue(tx, &NewEvent::new("order", "42", "order.created", serde_json::json!({"total": 10})))
///             .await
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub async fn enqueue(conn: &mut AsyncPgConnection, event: &NewEvent) -> Result<i64, StoreError> {
    event.check().map_err(StoreError::InvalidEvent)?;
    Ok(diesel::insert_into(outbox::table).values(event).returning(outbox::id).get_result(conn).await?)
}

/// Inserts several events in one statement; returns their ids in the order given.
pub async fn enqueue_many(conn: &mut AsyncPgConnection, events: &[NewEvent]) -> Result<Vec<i64>, StoreError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    for event in events {
        event.check().map_err(StoreError::InvalidEvent)?;
    }
    // A multi-row INSERT assigns identity values in VALUES order.
    let mut ids: Vec<i64> =
        diesel::insert_into(outbox::table).values(events).returning(outbox::id).get_results(conn).await?;
    ids.sort_unstable();
    Ok(ids)
}

/// Inserts `event` like [`enqueue`], after taking the per-aggregate producer lock
/// ([`lock_aggregate`]): the insert an application needs when dispatchers run with the
/// [FIFO gate](crate::Fifo) on.
///
/// **Call it inside the transaction that makes the business change** (it fails with
/// [`StoreError::OutsideTransaction`] otherwise, writing nothing). The lock is held until that
/// transaction ends, so the writes of one aggregate commit one transaction after the other,
/// in the order of their ids.
///
/// Why it matters: ids are drawn when a row is inserted, not when it commits. Two transactions
/// writing the same aggregate concurrently can draw ids 10 and 11 and commit 11 first; until 10
/// commits, the gate cannot see it, finds no unfinished row before 11, and hands 11 out as the
/// aggregate's head — out of order, with nothing left to detect it. Serialising the writers per
/// aggregate closes that window. Locking the aggregate's own row (`SELECT ... FOR UPDATE`)
/// before inserting does the same, and is what an application that already loads the aggregate
/// for update gets for free.
///
/// ```no_run
/// use actix_outbox::{NewEvent, enqueue_ordered};
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
///
/// # async fn f(conn: &mut AsyncPgConnection) -> Result<(), actix_outbox::StoreError> {
/// conn.transaction(async |tx| {
///     // ... the business write on `tx` ...
///     enqueue_ordered(tx, &NewEvent::new("order", "42", "order.paid", serde_json::json!({"amount": 10}))).await
/// })
/// .await?;
/// # Ok(()) }
/// ```
pub async fn enqueue_ordered(conn: &mut AsyncPgConnection, event: &NewEvent) -> Result<i64, StoreError> {
    lock_aggregate(conn, &event.aggregate_type, &event.aggregate_id).await?;
    enqueue(conn, event).await
}

/// Takes the transaction-scoped producer lock of one aggregate, waiting while another
/// transaction holds it: `pg_advisory_xact_lock(hashtextextended(aggregate_type || ':' ||
/// aggregate_id, 0))`. [`enqueue_ordered`] calls it; call it yourself to insert several
/// events, or events through your own SQL, under one lock.
///
/// Must run inside a transaction (see [`enqueue_ordered`] for why); taking it again in the
/// same transaction is free. A transaction that writes several aggregates should lock them in
/// a consistent order (sorted, say), or two such transactions can deadlock; PostgreSQL then
/// aborts one of them. The key shares the 64-bit advisory-lock space of the database: a
/// collision with another key only serialises more than needed, never less.
pub async fn lock_aggregate(
    conn: &mut AsyncPgConnection,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<(), StoreError> {
    let depth = <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
        .transaction_depth()?;
    if depth.is_none() {
        return Err(StoreError::OutsideTransaction("lock_aggregate / enqueue_ordered"));
    }
    diesel::sql_query(LOCK_AGGREGATE_SQL)
        .bind::<Text, _>(aggregate_type)
        .bind::<Text, _>(aggregate_id)
        .execute(conn)
        .await?;
    Ok(())
}
