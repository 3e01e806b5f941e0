//! The producer side: insert events inside the caller's own transaction.

use diesel_async::{AsyncPgConnection, RunQueryDsl};

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
    Ok(diesel::insert_into(outbox::table).values(event).returning(outbox::id).get_result(conn).await?)
}

/// Inserts several events in one statement; returns their ids in the order given.
pub async fn enqueue_many(conn: &mut AsyncPgConnection, events: &[NewEvent]) -> Result<Vec<i64>, StoreError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    // A multi-row INSERT assigns identity values in VALUES order.
    let mut ids: Vec<i64> =
        diesel::insert_into(outbox::table).values(events).returning(outbox::id).get_results(conn).await?;
    ids.sort_unstable();
    Ok(ids)
}
