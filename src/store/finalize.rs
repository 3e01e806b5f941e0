//! Fenced writes after a claim. Each takes a whole batch and costs one round trip; each returns
//! the rows it won. A row absent from the result was not written: its `lease_version` moved on
//! (another worker reclaimed it) or it is no longer `processing` (reaped, or finalized already).
//!
//! Each is a Diesel `update` (or, for [`delete_done`], a `delete`) of [`outbox`](crate::schema::outbox), filtered by
//! [`processing`] and by the batch's [`Fenced`](super::fence::Fenced), its `SET` clause typed
//! assignments, values that differ from row to row [`PerRow`](super::fence::PerRow) lookups:
//! no column, type or status is spelled in text, so a schema change that breaks one of them
//! breaks the build. Each statement's text depends on nothing but its types (every batch is
//! one array bind per column), so each stays one prepared statement per connection, planned
//! afresh on every run (see [`super::connect_pool`]).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::dsl::{case_when, now};
use diesel::sql_types::{Int4, Interval, Nullable, Text, Timestamptz};
use diesel::{ExpressionMethods, IntoSql, NullableExpressionMethods, QueryDsl, TextExpressionMethods};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::claim::interval;
use super::fence::{Batch, held};
use super::prepared::keep_prepared;
use crate::error::StoreError;
use crate::model::{Fence, Status};
use crate::schema::outbox;

/// `last_error` is cut to this many characters, so that a sink's huge error cannot bloat rows.
const MAX_ERROR_CHARS: usize = 2000;

/// Before the last error of a row that a deferral sends dead ([`Reschedule::dead_if_older_than`]).
const DEFERRED_TOO_LONG: &str = "deferred past the maximum deferral age; last: ";

#[diesel::declare_sql_function]
extern "SQL" {
    /// SQL `least` of two timestamps.
    fn least(a: Timestamptz, b: Timestamptz) -> Timestamptz;
    /// SQL `greatest` of two timestamps.
    fn greatest(a: Timestamptz, b: Timestamptz) -> Timestamptz;
}

/// `9999-12-31`: the `available_at` of a dead row, which waits in `outbox_later` and is never
/// due (not `'infinity'`, which clients such as chrono cannot read). A constant, so the statement's text still depends on its types alone.
pub(crate) fn never() -> diesel::expression::SqlLiteral<Timestamptz> {
    diesel::dsl::sql::<Timestamptz>("'9999-12-31 00:00:00+00'::timestamptz")
}

fn clip(error: &str) -> String {
    error.chars().take(MAX_ERROR_CHARS).collect()
}

/// Marks each row `done` (clearing the lease; `last_error` stays, so that a row delivered after
/// failures still says what failed last), fenced; returns the ids won.
///
/// A row that waited (`available_at` past `created_at`) leaves `outbox_later` (its
/// `available_at` goes back to `created_at`); for any other row no indexed value changes, so the
/// update is HOT: a new version beside the old one on its page, no index entry.
pub async fn mark_done(conn: &mut AsyncPgConnection, fences: &[Fence]) -> Result<Vec<i64>, StoreError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let batch = Batch::new(fences, |f| *f);
    Ok(keep_prepared(
        diesel::update(outbox::table)
            .filter(held())
            .filter(batch.fenced())
            .set((
                outbox::status.eq(Status::Done),
                outbox::done_at.eq(now),
                outbox::lease_owner.eq(None::<String>),
                outbox::lease_until.eq(None::<DateTime<Utc>>),
                outbox::available_at.eq(least(outbox::available_at, outbox::created_at)),
            ))
            .returning(outbox::id),
    )
    .get_results(conn)
    .await?)
}

/// Deletes each row, fenced: the finalize of a confirmed message under
/// [`Retention::Delete`](crate::Retention::Delete). Returns the ids won.
pub async fn delete_done(conn: &mut AsyncPgConnection, fences: &[Fence]) -> Result<Vec<i64>, StoreError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let batch = Batch::new(fences, |f| *f);
    Ok(keep_prepared(diesel::delete(outbox::table).filter(held()).filter(batch.fenced()).returning(outbox::id))
        .get_results(conn)
        .await?)
}

/// A row to send dead.
#[derive(Debug, Clone, PartialEq)]
pub struct Bury {
    /// The claim.
    pub fence: Fence,
    /// Why, for `last_error`.
    pub error: String,
}

/// Marks each row `dead` with its error, fenced; returns the ids won. Dead rows wait in
/// `outbox_later` at `available_at = 9999-12-31`: listed from there, never due.
pub async fn mark_dead(conn: &mut AsyncPgConnection, rows: &[Bury]) -> Result<Vec<i64>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let batch = Batch::new(rows, |r| r.fence);
    let errors: Vec<String> = batch.rows().map(|r| clip(&r.error)).collect();
    Ok(keep_prepared(
        diesel::update(outbox::table)
            .filter(held())
            .filter(batch.fenced())
            .set((
                outbox::status.eq(Status::Dead),
                outbox::last_error.eq(batch.per_row::<Text, _>(&errors).nullable()),
                outbox::lease_owner.eq(None::<String>),
                outbox::lease_until.eq(None::<DateTime<Utc>>),
                outbox::available_at.eq(never()),
            ))
            .returning(outbox::id),
    )
    .get_results(conn)
    .await?)
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
    /// Give the claim's attempt back (a deferral, or a release of a row the sink could not take).
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
///
/// A pending row waits in `outbox_later` until `now() + delay` (at least a microsecond past its
/// `created_at`, which is what places it there even with no delay); a dead one at `9999-12-31`.
pub async fn reschedule(conn: &mut AsyncPgConnection, rows: &[Reschedule]) -> Result<Vec<Rescheduled>, StoreError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let batch = Batch::new(rows, |r| r.fence);
    let delays: Vec<_> = batch.rows().map(|r| interval(r.delay)).collect();
    let errors: Vec<String> = batch.rows().map(|r| clip(&r.error)).collect();
    let refunds: Vec<i32> = batch.rows().map(|r| i32::from(r.refund_attempt)).collect();
    let max_ages: Vec<_> = batch.rows().map(|r| r.dead_if_older_than.map(interval)).collect();

    // NULL (never) for a row without a maximum age.
    let too_old = outbox::created_at
        .nullable()
        .lt(now.into_sql::<Nullable<Timestamptz>>() - batch.per_row::<Nullable<Interval>, _>(&max_ages));
    let won: Vec<(i64, Status)> = keep_prepared(
        diesel::update(outbox::table)
            .filter(held())
            .filter(batch.fenced())
            .set((
                outbox::status.eq(case_when::<_, _, Text>(too_old, Status::Dead).otherwise(Status::Pending)),
                outbox::last_error.eq(case_when::<_, _, Text>(too_old, DEFERRED_TOO_LONG)
                    .otherwise("")
                    .concat(batch.per_row::<Text, _>(&errors))
                    .nullable()),
                outbox::available_at.eq(case_when::<_, _, Timestamptz>(too_old, never()).otherwise(greatest(
                    now.into_sql::<Timestamptz>() + batch.per_row::<Interval, _>(&delays),
                    outbox::created_at + interval(Duration::from_micros(1)),
                ))),
                outbox::attempts.eq(outbox::attempts - batch.per_row::<Int4, _>(&refunds)),
                outbox::lease_owner.eq(None::<String>),
                outbox::lease_until.eq(None::<DateTime<Utc>>),
            ))
            .returning((outbox::id, outbox::status)),
    )
    .get_results(conn)
    .await?;
    Ok(won.into_iter().map(|(id, status)| Rescheduled { id, status }).collect())
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
    let batch = Batch::new(fences, |f| *f);
    Ok(keep_prepared(
        diesel::update(outbox::table)
            .filter(held())
            .filter(batch.fenced())
            .set(outbox::lease_until.eq((now.into_sql::<Timestamptz>() + interval(lease)).nullable()))
            .returning(outbox::id),
    )
    .get_results(conn)
    .await?)
}

/// How each of `fences` stands now, when it no longer stands as its claim left it: `Some(status)`
/// for a row no longer `processing` at its fence's `lease_version`, `None` for a row that is gone.
/// Rows still `processing` at their fence's version, and rows at another version (reclaimed),
/// are left out.
///
/// This answers a finalize whose outcome was in doubt: when the connection drops while a fenced
/// write runs, the write may have committed before the answer was lost, and running it again
/// then finds nothing to win. A row settled at the version of the caller's own claim was written
/// by that claim's holder (only the claim's holder writes at its version, and the reaper, which
/// sends it dead). A row that is gone was deleted by a fenced delete of a confirmed message
/// ([`delete_done`], under [`Retention::Delete`](crate::Retention::Delete)) or purged once `done`.
/// One statement, whatever the number of fences.
pub async fn settled(conn: &mut AsyncPgConnection, fences: &[Fence]) -> Result<Vec<(i64, Option<Status>)>, StoreError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = fences.iter().map(|f| f.id).collect();
    let current: HashMap<i64, (Status, i64)> = outbox::table
        .filter(outbox::id.eq_any(&ids))
        .select((outbox::id, outbox::status, outbox::lease_version))
        .load::<(i64, Status, i64)>(conn)
        .await?
        .into_iter()
        .map(|(id, status, version)| (id, (status, version)))
        .collect();
    Ok(fences
        .iter()
        .filter_map(|f| match current.get(&f.id) {
            None => Some((f.id, None)),
            Some(&(status, version)) if version == f.lease_version && status != Status::Processing => {
                Some((f.id, Some(status)))
            }
            Some(_) => None,
        })
        .collect())
}
