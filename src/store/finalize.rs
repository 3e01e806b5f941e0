//! Fenced writes after a claim. Each takes a whole batch and costs one round trip; each returns
//! the rows it won. A row absent from the result was not written: its `lease_version` moved on
//! (another worker reclaimed it) or it is no longer `processing` (reaped, or finalized already).

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Int4, Int8, Interval, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::claim::interval;
use super::prepared::prepared;
use crate::error::StoreError;
use crate::model::{Fence, Status};

/// `last_error` is cut to this many characters, so that a sink's huge error cannot bloat rows.
const MAX_ERROR_CHARS: usize = 2000;

fn clip(error: &str) -> String {
    error.chars().take(MAX_ERROR_CHARS).collect()
}

fn split(fences: impl Iterator<Item = Fence>) -> (Vec<i64>, Vec<i64>) {
    fences.map(|f| (f.id, f.lease_version)).unzip()
}

#[derive(QueryableByName)]
struct Won {
    #[diesel(sql_type = Int8)]
    id: i64,
}

/// Marks each row `done` (clearing the lease and `last_error`), fenced; returns the ids won.
pub async fn mark_done(conn: &mut AsyncPgConnection, fences: &[Fence]) -> Result<Vec<i64>, StoreError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, versions) = split(fences.iter().copied());
    let won: Vec<Won> = prepared(
        "UPDATE outbox AS o
         SET status = 'done', done_at = now(), last_error = NULL, lease_owner = NULL, lease_until = NULL
         FROM unnest($1::bigint[], $2::bigint[]) AS v(id, ver)
         WHERE o.id = v.id AND o.lease_version = v.ver AND o.status = 'processing'
         RETURNING o.id",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Array<BigInt>, _>(versions)
    .load(conn)
    .await?;
    Ok(won.into_iter().map(|w| w.id).collect())
}

/// A row to send dead.
#[derive(Debug, Clone, PartialEq)]
pub struct Bury {
    /// The claim.
    pub fence: Fence,
    /// Why, for `last_error`.
    pub error: String,
}

/// Marks each row `dead` with its error, fenced; returns the ids won.
pub async fn mark_dead(conn: &mut AsyncPgConnection, rows: &[Bury]) -> Result<Vec<i64>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, versions) = split(rows.iter().map(|r| r.fence));
    let errors: Vec<String> = rows.iter().map(|r| clip(&r.error)).collect();
    let won: Vec<Won> = prepared(
        "UPDATE outbox AS o
         SET status = 'dead', last_error = v.err, lease_owner = NULL, lease_until = NULL
         FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS v(id, ver, err)
         WHERE o.id = v.id AND o.lease_version = v.ver AND o.status = 'processing'
         RETURNING o.id",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Array<BigInt>, _>(versions)
    .bind::<Array<Text>, _>(errors)
    .load(conn)
    .await?;
    Ok(won.into_iter().map(|w| w.id).collect())
}

/// A row to put back to `pending`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reschedule {
    /// The claim.
    pub fence: Fence,
    /// Not claimable before `now() + delay`.
    pub delay: Duration,
    /// Recorded in `last_error`.
    pub error: String,
    /// Give the claim's attempt back (a deferral, or a release at shutdown).
    pub refund_attempt: bool,
    /// When set, a row created longer ago than this goes `dead` instead (a deferral that
    /// would never end).
    pub dead_if_older_than: Option<Duration>,
}

/// How one rescheduled row ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rescheduled {
    /// The outbox id.
    pub id: i64,
    /// `Pending`, or `Dead` when `dead_if_older_than` applied.
    pub status: Status,
}

/// Puts each row back to `pending` after its delay (or `dead`, see
/// [`Reschedule::dead_if_older_than`]), fenced; returns the rows won with their new status.
pub async fn reschedule(conn: &mut AsyncPgConnection, rows: &[Reschedule]) -> Result<Vec<Rescheduled>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, versions) = split(rows.iter().map(|r| r.fence));
    let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
    let delays: Vec<i64> = rows.iter().map(|r| micros(r.delay)).collect();
    let errors: Vec<String> = rows.iter().map(|r| clip(&r.error)).collect();
    let refunds: Vec<i32> = rows.iter().map(|r| i32::from(r.refund_attempt)).collect();
    let max_ages: Vec<i64> = rows.iter().map(|r| r.dead_if_older_than.map_or(-1, micros)).collect();

    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Int8)]
        id: i64,
        #[diesel(sql_type = Text)]
        status: String,
    }
    let out: Vec<Row> = prepared(
        "UPDATE outbox AS o
         SET status = CASE WHEN v.max_age_us >= 0 AND o.created_at < now() - v.max_age_us * interval '1 microsecond'
                           THEN 'dead' ELSE 'pending' END,
             last_error = CASE WHEN v.max_age_us >= 0 AND o.created_at < now() - v.max_age_us * interval '1 microsecond'
                               THEN 'deferred past the maximum deferral age; last: ' || v.err
                               ELSE v.err END,
             available_at = now() + v.delay_us * interval '1 microsecond',
             attempts = o.attempts - v.refund,
             lease_owner = NULL,
             lease_until = NULL
         FROM unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::text[], $5::int[], $6::bigint[])
              AS v(id, ver, delay_us, err, refund, max_age_us)
         WHERE o.id = v.id AND o.lease_version = v.ver AND o.status = 'processing'
         RETURNING o.id, o.status",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Array<BigInt>, _>(versions)
    .bind::<Array<BigInt>, _>(delays)
    .bind::<Array<Text>, _>(errors)
    .bind::<Array<Int4>, _>(refunds)
    .bind::<Array<BigInt>, _>(max_ages)
    .load(conn)
    .await?;
    out.into_iter()
        .map(|r| {
            let status = r.status.parse().map_err(|e: crate::model::UnknownStatus| {
                StoreError::Query(diesel::result::Error::DeserializationError(Box::new(e)))
            })?;
            Ok(Rescheduled { id: r.id, status })
        })
        .collect()
}

/// Extends the lease of each row to `now() + lease` (a heartbeat for a slow publish), fenced;
/// returns the ids won. A row not returned has been taken over: its publish is now a duplicate.
pub async fn extend_leases(
    conn: &mut AsyncPgConnection,
    fences: &[Fence],
    lease: Duration,
) -> Result<Vec<i64>, StoreError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, versions) = split(fences.iter().copied());
    let won: Vec<Won> = prepared(
        "UPDATE outbox AS o
         SET lease_until = now() + $3
         FROM unnest($1::bigint[], $2::bigint[]) AS v(id, ver)
         WHERE o.id = v.id AND o.lease_version = v.ver AND o.status = 'processing'
         RETURNING o.id",
    )
    .bind::<Array<BigInt>, _>(ids)
    .bind::<Array<BigInt>, _>(versions)
    .bind::<Interval, _>(interval(lease))
    .load(conn)
    .await?;
    Ok(won.into_iter().map(|w| w.id).collect())
}

/// The rows of `fences` that are no longer `processing` at their fence's `lease_version`, with
/// their status now.
///
/// This answers a finalize whose outcome was in doubt: when the connection drops while a fenced
/// write runs, the write may have committed before the answer was lost, and running it again
/// then finds nothing to win. A row settled at the version of the caller's own claim was written
/// by that claim's holder (only the claim's holder writes at its version, and the reaper, which
/// sends it dead).
pub async fn settled_at_version(
    conn: &mut AsyncPgConnection,
    fences: &[Fence],
) -> Result<Vec<(i64, Status)>, StoreError> {
    use diesel::{ExpressionMethods, QueryDsl};

    use crate::schema::outbox;

    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = fences.iter().map(|f| f.id).collect();
    let rows: Vec<(i64, i64, String)> = outbox::table
        .filter(outbox::id.eq_any(&ids))
        .filter(outbox::status.ne(Status::Processing.as_str()))
        .select((outbox::id, outbox::lease_version, outbox::status))
        .load(conn)
        .await?;
    let versions: std::collections::HashMap<i64, i64> = fences.iter().map(|f| (f.id, f.lease_version)).collect();
    rows.into_iter()
        .filter(|(id, version, _)| versions.get(id) == Some(version))
        .map(|(id, _, status)| {
            let status = status.parse().map_err(|e: crate::model::UnknownStatus| {
                StoreError::Query(diesel::result::Error::DeserializationError(Box::new(e)))
            })?;
            Ok((id, status))
        })
        .collect()
}
