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
use super::finalize::never;
use super::pool::{in_transaction, through_indexes};
use super::sql::{PRUNE_SQL, SAMPLE_SQL, SAMPLE_UNFINISHED_SQL, SOURCE_SQL};
use crate::error::{EraseError, StoreError};
use crate::model::{OutboxRow, Status};
use crate::schema::outbox;

/// A snapshot of the outbox table for operators: queue depth, scheduled rows, age of the oldest
/// unfinished row, expired leases, attempts histogram.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Rows per status; every status is present, zero when empty. `pending` includes the
    /// [`scheduled`](Stats::scheduled) rows.
    pub by_status: BTreeMap<String, i64>,
    /// Pending rows a producer scheduled for later ([`NewEvent::not_before`](crate::NewEvent::not_before))
    /// that are not due yet: never claimed, their `available_at` ahead. Part of
    /// `by_status["pending"]`, but not backlog: [`Stats::backlog`] leaves them out, and so does
    /// [`Stats::oldest_unfinished_age_s`]. A row backing off after a failure, or deferred by
    /// the sink, is backlog, not scheduled.
    pub scheduled: i64,
    /// Seconds since the oldest `pending` or `processing` row that is due became due: since it
    /// was created, or, for a row scheduled by its producer and not yet claimed, since its
    /// scheduled time. `None` when none (scheduled rows do not count). A scheduled row that
    /// fails once counts from its creation again, like any row tried before.
    pub oldest_unfinished_age_s: Option<f64>,
    /// `processing` rows whose lease ran out (a worker crashed or stalled).
    pub expired_leases: i64,
    /// Unfinished rows per attempt count (`"1": n` ...).
    pub attempts: BTreeMap<String, i64>,
    /// The outbox's default source name ([`outbox_source`]); `None` where it cannot be derived.
    /// A dispatcher given a source by hand stamps that one instead.
    pub source: Option<String>,
}

impl Stats {
    /// Rows still to publish now: `pending` ones that are not [scheduled](Stats::scheduled),
    /// and `processing` ones.
    pub fn backlog(&self) -> i64 {
        let count = |status: Status| self.by_status.get(status.as_str()).copied().unwrap_or(0);
        count(Status::Pending) - self.scheduled + count(Status::Processing)
    }
}

/// Reads [`Stats`] (database clock).
pub async fn stats(conn: &mut AsyncPgConnection) -> Result<Stats, StoreError> {
    in_transaction(conn, async |conn| {
        // Exact, unlike the dispatcher's gauges (whose `done` count is an estimate): an operator's
        // question, asked now and then, may read the history.
        let sample = sample(conn).await?;
        let mut stats = Stats {
            by_status: sample.by_status().into_iter().map(|(s, n)| (s.as_str().to_owned(), n)).collect(),
            scheduled: sample.scheduled,
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
    /// Pending rows scheduled for later and not yet due (see [`Stats::scheduled`]).
    #[diesel(sql_type = Int8)]
    pub(crate) scheduled: i64,
    #[diesel(sql_type = Int8)]
    pub(crate) processing: i64,
    #[diesel(sql_type = Int8)]
    pub(crate) done: i64,
    #[diesel(sql_type = Int8)]
    pub(crate) dead: i64,
    /// Seconds since the oldest pending or processing row that is due became due; `None` when
    /// none (see [`Stats::oldest_unfinished_age_s`]).
    #[diesel(sql_type = Nullable<Double>)]
    pub(crate) oldest: Option<f64>,
    /// Processing rows whose lease ran out.
    #[diesel(sql_type = Int8)]
    pub(crate) expired: i64,
}

impl Sample {
    /// Rows still to publish now: pending and not scheduled, or processing.
    pub(crate) fn backlog(&self) -> i64 {
        self.pending - self.scheduled + self.processing
    }

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

/// The rows of the table that are not history, counted: what is still to do (pending, scheduled
/// among them, processing, expired leases, the age of the oldest due row) and what failed (dead).
/// Read by [`overview`] through indexes only, so its cost follows the backlog, never the history
/// the table keeps (`done` rows are not counted: [`stats`] counts them, reading the whole table).
/// What the console's overview shows, and the dispatcher's gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Overview {
    /// `pending` rows, the scheduled ones included.
    pub pending: i64,
    /// Pending rows a producer scheduled for later, not yet due (see [`Stats::scheduled`]).
    pub scheduled: i64,
    /// `processing` rows.
    pub processing: i64,
    /// `dead` rows.
    pub dead: i64,
    /// Seconds since the oldest pending or processing row that is due became due (see
    /// [`Stats::oldest_unfinished_age_s`]); `None` when none.
    pub oldest_unfinished_age_s: Option<f64>,
    /// `processing` rows whose lease ran out (a worker crashed or stalled).
    pub expired_leases: i64,
}

impl Overview {
    /// Rows still to publish now: pending and not scheduled, and processing.
    pub fn backlog(&self) -> i64 {
        self.pending - self.scheduled + self.processing
    }

    /// Pending rows that are not scheduled: due now, or backing off.
    pub fn ready(&self) -> i64 {
        self.pending - self.scheduled
    }
}

/// Reads the [`Overview`] (database clock).
pub async fn overview(conn: &mut AsyncPgConnection) -> Result<Overview, StoreError> {
    let s = sample_unfinished(conn).await?;
    Ok(Overview {
        pending: s.pending,
        scheduled: s.scheduled,
        processing: s.processing,
        dead: s.dead,
        oldest_unfinished_age_s: s.oldest,
        expired_leases: s.expired,
    })
}

/// Reads a [`Sample`] from the unfinished rows only, its `done` count estimated: for the
/// dispatcher's gauges, whose cost must not grow with the history a table keeps.
pub(crate) async fn sample_unfinished(conn: &mut AsyncPgConnection) -> Result<Sample, StoreError> {
    through_indexes(conn, async |conn| Ok(diesel::sql_query(SAMPLE_UNFINISHED_SQL).get_result(conn).await?)).await
}

/// Dead rows, oldest first, at most `limit`.
pub async fn dead_list(conn: &mut AsyncPgConnection, limit: i64) -> Result<Vec<OutboxRow>, StoreError> {
    in_transaction(conn, async |conn| {
        Ok(outbox::table
            .filter(parked_dead())
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
        // By primary key: a dead row is found whether or not it waits where the dispatcher parks
        // dead rows (one made dead by hand does not).
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
        Ok(diesel::update(outbox::table.filter(parked_dead()))
            .set(retry_changes())
            .returning(outbox::id)
            .get_results(conn)
            .await?)
    })
    .await
}

/// The `available_at` of every dead row: 9999-12-31 00:00 UTC. A dead row is never due, and
/// waits there in the index `outbox_later` (rows whose `available_at` is past their
/// `created_at`), through which queries of one's own find dead rows without reading the history:
///
/// ```
/// # use diesel::prelude::*;
/// use actix_outbox::admin::{Status, dead_available_at};
/// use actix_outbox::schema::outbox;
///
/// let dead = outbox::table
///     .filter(outbox::available_at.gt(outbox::created_at)) // the index's predicate, for the planner
///     .filter(outbox::available_at.eq(dead_available_at()))
///     .filter(outbox::status.eq(Status::Dead));
/// ```
pub fn dead_available_at() -> DateTime<Utc> {
    DateTime::from_timestamp(DEAD_AVAILABLE_AT_SECONDS, 0).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// 9999-12-31T00:00:00Z in seconds since the epoch (the literal of `never()`).
const DEAD_AVAILABLE_AT_SECONDS: i64 = 253_402_214_400;

/// The dead rows, as the index `outbox_later` finds them: dead rows wait there at
/// `available_at = 9999-12-31` (the first test is the index's predicate, which the planner must
/// see to use it), so listing and retrying them reads neither the history nor the backlog.
#[allow(clippy::type_complexity)]
fn parked_dead() -> diesel::dsl::And<
    diesel::dsl::And<
        diesel::dsl::Gt<outbox::available_at, outbox::created_at>,
        diesel::dsl::Eq<outbox::available_at, diesel::expression::SqlLiteral<Timestamptz>>,
    >,
    diesel::dsl::Eq<outbox::status, Status>,
> {
    outbox::available_at
        .gt(outbox::created_at)
        .and(outbox::available_at.eq(never()))
        .and(outbox::status.eq(Status::Dead))
}

#[allow(clippy::type_complexity)]
fn retry_changes() -> (
    diesel::dsl::Eq<outbox::status, Status>,
    diesel::dsl::Eq<outbox::attempts, i32>,
    diesel::dsl::Eq<outbox::available_at, diesel::dsl::now>,
    diesel::dsl::Eq<outbox::lease_owner, Option<String>>,
    diesel::dsl::Eq<outbox::lease_until, Option<DateTime<Utc>>>,
) {
    // `now()` is past the row's `created_at`: the row waits in `outbox_later`, due at once.
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
                // Out of `outbox_later`, as every done row.
                outbox::available_at.eq(outbox::created_at),
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
///
/// No index reads `done_at` (every finalize would then write an entry in it): the purge walks
/// the table by primary key, `batch` rows at a time, from the oldest, and deletes the expired
/// `done` rows of each stretch. `run` prunes by itself (see
/// [`Retention`](crate::Retention)); this is for one-off use.
pub async fn purge_done(conn: &mut AsyncPgConnection, older_than: Duration, batch: i64) -> Result<u64, StoreError> {
    let mut total = 0u64;
    let mut after = 0;
    loop {
        let stretch = purge_done_batch(conn, older_than, after, batch).await?;
        total += stretch.deleted;
        match stretch.next {
            Some(next) => after = next,
            None => return Ok(total),
        }
    }
}

/// One stretch of [`purge_done`]: what [`purge_done_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeStretch {
    /// `done` rows deleted.
    pub deleted: u64,
    /// The id after which the next stretch starts; `None` once the walk reached the table's
    /// end.
    pub next: Option<i64>,
}

/// One statement of [`purge_done`]: of the `batch` rows after id `after` in primary-key order,
/// deletes the `done` ones whose `done_at` is older than `older_than`. Start at `after = 0` and
/// go on from [`PurgeStretch::next`] until it is `None`. For a caller that bounds each statement
/// (`actix-outbox purge` gives each its `--query-timeout`) or paces them.
pub async fn purge_done_batch(
    conn: &mut AsyncPgConnection,
    older_than: Duration,
    after: i64,
    batch: i64,
) -> Result<PurgeStretch, StoreError> {
    let step = prune_step(conn, after, batch, older_than, false).await?;
    Ok(PurgeStretch { deleted: u64::try_from(step.deleted).unwrap_or_default(), next: step.last })
}

/// One stretch of [`purge_done`] and of the dispatcher's pruner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, QueryableByName)]
pub(crate) struct PruneStep {
    /// The last id of the stretch (`None`: the stretch was empty, the walk reached the end).
    #[diesel(sql_type = Nullable<Int8>)]
    pub(crate) last: Option<i64>,
    /// Rows deleted.
    #[diesel(sql_type = Int8)]
    pub(crate) deleted: i64,
    /// Whether the stretch held a `done` row finished within `older_than`: the walk has reached
    /// the rows finished lately, and those after are younger still (rows finish roughly in id
    /// order).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub(crate) reached_recent: bool,
}

/// Deletes the expired `done` rows among the `batch` rows after id `after` (primary-key
/// order), in a transaction of its own; when `exclusive`, only while no other process is
/// pruning the table (else nothing, as at the table's end).
pub(crate) async fn prune_step(
    conn: &mut AsyncPgConnection,
    after: i64,
    batch: i64,
    older_than: Duration,
    exclusive: bool,
) -> Result<PruneStep, StoreError> {
    through_indexes(conn, async |conn| {
        Ok(diesel::sql_query(PRUNE_SQL)
            .bind::<Int8, _>(after)
            .bind::<Int8, _>(batch.max(1))
            .bind::<diesel::sql_types::Interval, _>(interval(older_than))
            .bind::<diesel::sql_types::Bool, _>(exclusive)
            .get_result(conn)
            .await?)
    })
    .await
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

#[cfg(test)]
mod tests {
    #[test]
    fn dead_rows_wait_at_9999_12_31() {
        assert_eq!(super::dead_available_at().to_rfc3339(), "9999-12-31T00:00:00+00:00");
    }
}
