//! What operators need: statistics, the dead-letter list and its two ways out, purging, and
//! erasing one aggregate's rows.
//!
//! Each function runs in a transaction of its own (or in the caller's), so that it works on
//! any connection, through a transaction pooler too (see `pool`).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::dsl::now;
use diesel::prelude::*;
use diesel::sql_types::{Double, Int8, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use tracing::info;

use super::claim::interval;
use super::pool::in_transaction;
use super::sql::{SAMPLE_SQL, SAMPLE_UNFINISHED_SQL, SOURCE_SQL};
use crate::error::{EraseError, StoreError};
use crate::model::{OutboxRow, Status};
use crate::schema::outbox;

/// A snapshot of the outbox table for operators: queue depth, age of the oldest unfinished row,
/// expired leases, attempts histogram.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Rows per status; every status is present, zero when empty.
    pub by_status: BTreeMap<String, i64>,
    /// Seconds since the oldest `pending` or `processing` row was created; `None` when none.
    pub oldest_unfinished_age_s: Option<f64>,
    /// `processing` rows whose lease ran out (a worker crashed or stalled).
    pub expired_leases: i64,
    /// Unfinished rows per attempt count (`"1": n` ...).
    pub attempts: BTreeMap<String, i64>,
    /// The outbox's default source name ([`outbox_source`]); `None` where it cannot be derived.
    /// A dispatcher given a source by hand stamps that one instead.
    pub source: Option<String>,
}

/// Reads [`Stats`] (database clock).
pub async fn stats(conn: &mut AsyncPgConnection) -> Result<Stats, StoreError> {
    in_transaction(conn, async |conn| {
        // Exact, unlike the dispatcher's gauges (whose `done` count is an estimate): an operator's
        // question, asked now and then, may read the history.
        let sample = sample(conn).await?;
        let mut stats = Stats {
            by_status: sample.by_status().into_iter().map(|(s, n)| (s.as_str().to_owned(), n)).collect(),
            oldest_unfinished_age_s: sample.oldest,
            expired_leases: sample.expired,
            ..Stats::default()
        };

        let histogram: Vec<(i32, i64)> = outbox::table
            .filter(outbox::status.eq_any([Status::Pending, Status::Processing]))
            .group_by(outbox::attempts)
            .select((outbox::attempts, diesel::dsl::count_star()))
            .load(conn)
            .await?;
        stats.attempts = histogram.into_iter().map(|(a, n)| (a.to_string(), n)).collect();
        stats.source = match outbox_source(conn).await {
            Ok(source) => Some(source),
            Err(StoreError::NoSystemIdentifier { .. }) => None,
            Err(e) => return Err(e),
        };
        Ok(stats)
    })
    .await
}

/// The outbox's default source name, `<system identifier>/<database>/<schema>.outbox`: what a
/// dispatcher without [`DispatcherConfig::source`](crate::DispatcherConfig::source) puts in
/// every message's [`x-outbox-source`](crate::wire::SOURCE) header, so that
/// `(source, message_id)` is unique across databases (see [`wire`](crate::wire#message-identity)).
///
/// Fails with [`StoreError::NoOutboxTable`] on a database that has no `outbox` table, and with
/// [`StoreError::NoSystemIdentifier`] where the role may not call `pg_control_system()` (some
/// managed services revoke it; set the source by hand there). Neither failure is an SQL error,
/// so the caller's transaction stays usable.
pub async fn outbox_source(conn: &mut AsyncPgConnection) -> Result<String, StoreError> {
    in_transaction(conn, async |conn| {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = Nullable<Text>)]
            system_identifier: Option<String>,
            #[diesel(sql_type = Text)]
            database: String,
            #[diesel(sql_type = Nullable<Text>)]
            table_name: Option<String>,
        }
        let row: Row = diesel::sql_query(SOURCE_SQL).get_result(conn).await?;
        match (row.system_identifier, row.table_name) {
            (_, None) => Err(StoreError::NoOutboxTable { database: row.database }),
            (None, Some(_)) => Err(StoreError::NoSystemIdentifier { database: row.database }),
            (Some(system), Some(table)) => Ok(format!("{system}/{}/{table}", row.database)),
        }
    })
    .await
}

/// What the dispatcher samples of the table for its gauges: [`Stats`] less the attempts, read
/// in one statement.
#[derive(Debug, Clone, Copy, Default, PartialEq, QueryableByName)]
pub(crate) struct Sample {
    #[diesel(sql_type = Int8)]
    pub(crate) pending: i64,
    #[diesel(sql_type = Int8)]
    pub(crate) processing: i64,
    #[diesel(sql_type = Int8)]
    pub(crate) done: i64,
    #[diesel(sql_type = Int8)]
    pub(crate) dead: i64,
    /// Seconds since the oldest pending or processing row was created; `None` when none.
    #[diesel(sql_type = Nullable<Double>)]
    pub(crate) oldest: Option<f64>,
    /// Processing rows whose lease ran out.
    #[diesel(sql_type = Int8)]
    pub(crate) expired: i64,
}

impl Sample {
    /// The row count of each status.
    pub(crate) fn by_status(&self) -> [(Status, i64); 4] {
        [
            (Status::Pending, self.pending),
            (Status::Processing, self.processing),
            (Status::Done, self.done),
            (Status::Dead, self.dead),
        ]
    }
}

/// Reads a [`Sample`] (database clock), exact: every row is read.
pub(crate) async fn sample(conn: &mut AsyncPgConnection) -> Result<Sample, StoreError> {
    in_transaction(conn, async |conn| Ok(diesel::sql_query(SAMPLE_SQL).get_result(conn).await?)).await
}

/// Reads a [`Sample`] from the unfinished rows only, its `done` count estimated: for the
/// dispatcher's gauges, whose cost must not grow with the history a table keeps.
pub(crate) async fn sample_unfinished(conn: &mut AsyncPgConnection) -> Result<Sample, StoreError> {
    in_transaction(conn, async |conn| Ok(diesel::sql_query(SAMPLE_UNFINISHED_SQL).get_result(conn).await?)).await
}

/// Dead rows, oldest first, at most `limit`.
pub async fn dead_list(conn: &mut AsyncPgConnection, limit: i64) -> Result<Vec<OutboxRow>, StoreError> {
    in_transaction(conn, async |conn| {
        Ok(outbox::table
            .filter(outbox::status.eq(Status::Dead))
            .order(outbox::id)
            .limit(limit)
            .select(OutboxRow::as_select())
            .load(conn)
            .await?)
    })
    .await
}

/// Sends the given dead rows back to `pending`, attempts reset, claimable now. Returns the ids
/// changed; an id that is not a dead row is left alone and absent from the result.
pub async fn dead_retry(conn: &mut AsyncPgConnection, ids: &[i64]) -> Result<Vec<i64>, StoreError> {
    in_transaction(conn, async |conn| {
        Ok(diesel::update(outbox::table.filter(outbox::id.eq_any(ids)).filter(outbox::status.eq(Status::Dead)))
            .set(retry_changes())
            .returning(outbox::id)
            .get_results(conn)
            .await?)
    })
    .await
}

/// Sends every dead row back to `pending`; returns the ids changed.
pub async fn dead_retry_all(conn: &mut AsyncPgConnection) -> Result<Vec<i64>, StoreError> {
    in_transaction(conn, async |conn| {
        Ok(diesel::update(outbox::table.filter(outbox::status.eq(Status::Dead)))
            .set(retry_changes())
            .returning(outbox::id)
            .get_results(conn)
            .await?)
    })
    .await
}

#[allow(clippy::type_complexity)]
fn retry_changes() -> (
    diesel::dsl::Eq<outbox::status, Status>,
    diesel::dsl::Eq<outbox::attempts, i32>,
    diesel::dsl::Eq<outbox::available_at, diesel::dsl::now>,
    diesel::dsl::Eq<outbox::lease_owner, Option<String>>,
    diesel::dsl::Eq<outbox::lease_until, Option<DateTime<Utc>>>,
) {
    (
        outbox::status.eq(Status::Pending),
        outbox::attempts.eq(0),
        outbox::available_at.eq(diesel::dsl::now),
        outbox::lease_owner.eq(None::<String>),
        outbox::lease_until.eq(None::<DateTime<Utc>>),
    )
}

/// The `last_error` prefix that records an operator's skip.
pub const SKIPPED_PREFIX: &str = "skipped by operator: ";

/// Marks the given dead rows `done` without publishing them, recording
/// `skipped by operator: <reason>` in `last_error` (the previous error is kept after it).
/// Returns the ids changed; an id that is not a dead row is left alone.
pub async fn dead_skip(conn: &mut AsyncPgConnection, ids: &[i64], reason: &str) -> Result<Vec<i64>, StoreError> {
    in_transaction(conn, async |conn| {
        let was = " (was: ".into_sql::<Nullable<Text>>().concat(outbox::last_error).concat(")");
        Ok(diesel::update(outbox::table.filter(outbox::id.eq_any(ids)).filter(outbox::status.eq(Status::Dead)))
            .set((
                outbox::status.eq(Status::Done),
                outbox::done_at.eq(now),
                outbox::last_error.eq(SKIPPED_PREFIX
                    .into_sql::<Text>()
                    .concat(reason)
                    .concat(coalesce(was, ""))
                    .nullable()),
            ))
            .returning(outbox::id)
            .get_results(conn)
            .await?)
    })
    .await
}

#[diesel::declare_sql_function]
extern "SQL" {
    /// SQL `coalesce` of a nullable text and a fallback.
    fn coalesce(value: Nullable<Text>, fallback: Text) -> Text;
}

/// Deletes `done` rows whose `done_at` is older than `older_than`, `batch` rows per statement
/// so that no statement holds many locks for long. Returns how many it deleted.
pub async fn purge_done(conn: &mut AsyncPgConnection, older_than: Duration, batch: i64) -> Result<u64, StoreError> {
    let mut total = 0u64;
    loop {
        let n = purge_done_batch(conn, older_than, batch).await?;
        total += n;
        if (n as i64) < batch.max(1) {
            return Ok(total);
        }
    }
}

/// One statement of [`purge_done`]: deletes at most `batch` of the `done` rows whose
/// `done_at` is older than `older_than`, and returns how many it deleted (fewer than `batch`:
/// none are left). For a caller that bounds each statement (`actix-outbox purge` gives each
/// its `--query-timeout`) or paces them.
pub async fn purge_done_batch(
    conn: &mut AsyncPgConnection,
    older_than: Duration,
    batch: i64,
) -> Result<u64, StoreError> {
    // The subquery reads the table under an alias of its own, as a self-join needs.
    let old = diesel::alias!(outbox as old);
    // A batch at a time, locked, passing over rows another purge holds.
    let purgeable = old
        .select(old.field(outbox::id))
        .filter(old.field(outbox::status).eq(Status::Done))
        .filter(old.field(outbox::done_at).lt((now.into_sql::<Timestamptz>() - interval(older_than)).nullable()))
        .limit(batch.max(1))
        .for_update()
        .skip_locked();
    let delete = diesel::delete(outbox::table.filter(outbox::id.eq_any(purgeable)));
    let n = in_transaction(conn, async |conn| Ok::<_, StoreError>(delete.execute(conn).await?)).await?;
    Ok(n as u64)
}

/// What [`erase`] deleted: the aggregate's `done` and `dead` rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Erasure {
    /// `done` rows deleted.
    pub done: u64,
    /// `dead` rows deleted.
    pub dead: u64,
}

/// How far the table is from idle: rows being published, pending rows due within a horizon,
/// and pending rows that wait longer (deferred, or backing off for longer).
#[cfg(feature = "testkit")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Unsettled {
    pub(crate) processing: i64,
    pub(crate) due: i64,
    pub(crate) waiting: i64,
}

/// Reads [`Unsettled`] in one statement (database clock), so that a row moving from
/// `pending` to `processing` and back between two counts cannot make a busy table look idle.
#[cfg(feature = "testkit")]
pub(crate) async fn unsettled(conn: &mut AsyncPgConnection, horizon: Duration) -> Result<Unsettled, StoreError> {
    use diesel::dsl::count;
    in_transaction(conn, async |conn| {
        let pending = outbox::status.eq(Status::Pending);
        let due = pending.and(outbox::available_at.le(now.into_sql::<Timestamptz>() + interval(horizon)));
        let (processing, due, pending): (i64, i64, i64) = outbox::table
            .select((
                count(outbox::id).aggregate_filter(outbox::status.eq(Status::Processing)),
                count(outbox::id).aggregate_filter(due),
                count(outbox::id).aggregate_filter(pending),
            ))
            .get_result(conn)
            .await?;
        Ok(Unsettled { processing, due, waiting: pending - due })
    })
    .await
}

/// Erases the outbox's data of one aggregate (a request to erase a person's data): deletes its
/// `done` and `dead` rows, in one transaction, and says how many of each.
///
/// The aggregate's rows are locked first (`SELECT ... FOR UPDATE`), so no worker finishes or
/// claims one meanwhile. If any is still `pending` or `processing`, nothing is deleted and the
/// answer is [`EraseError::InFlight`] with both counts: those rows have not been published
/// yet, and would carry the data out after the erasure. Wait until they are done (under the
/// FIFO gate, a dead head holds the aggregate's later rows back: retry or skip it first), then
/// erase again.
///
/// The rows are deleted, not redacted: a redacted row would still carry the aggregate id, its
/// headers and its `last_error`, any of which can identify the person; and the only use of a
/// dead row, repairing it, would publish the data again.
///
/// What it cannot reach: copies already published (in queues and dead-letter queues), the
/// consumers' own tables, backups, WAL archives and replicas that still hold the old rows, and
/// logs. An inbox on the same database is erased by `inbox::erase_aggregate` (feature `inbox`).
pub async fn erase(
    conn: &mut AsyncPgConnection,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<Erasure, EraseError> {
    let erasure = in_transaction(conn, async |conn| {
        let of_aggregate = || {
            outbox::table
                .filter(outbox::aggregate_type.eq(aggregate_type))
                .filter(outbox::aggregate_id.eq(aggregate_id))
        };
        // Row locks cannot be taken on an aggregate (`count(*) ... FOR UPDATE`): lock the
        // aggregate's rows and count their statuses here.
        let statuses: Vec<Status> = of_aggregate().select(outbox::status).for_update().load(conn).await?;
        let count = |status: Status| statuses.iter().filter(|s| **s == status).count() as u64;
        let (pending, processing) = (count(Status::Pending), count(Status::Processing));
        if pending + processing > 0 {
            return Err(EraseError::InFlight { pending, processing });
        }
        let deleted: Vec<Status> =
            diesel::delete(of_aggregate().filter(outbox::status.eq_any([Status::Done, Status::Dead])))
                .returning(outbox::status)
                .get_results(conn)
                .await?;
        let count = |status: Status| deleted.iter().filter(|s| **s == status).count() as u64;
        Ok(Erasure { done: count(Status::Done), dead: count(Status::Dead) })
    })
    .await?;
    // Not the aggregate id: it identifies the person, and a log is one more copy nobody erases.
    info!(aggregate_type, done = erasure.done, dead = erasure.dead, "erased aggregate");
    Ok(erasure)
}
