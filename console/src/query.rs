//! The console's own reads of the table. The table keeps its history (possibly millions of
//! `done` rows), and the overview reloads itself, so every statement here reads only what an
//! index bounds: unfinished and dead rows through the partial indexes on them, or one row by
//! its primary key. None counts the `done` rows. Each read is a transaction of its own, so that it works
//! through a transaction pooler too.

use actix_outbox::StoreError;
use actix_outbox::admin::{OutboxRow, Status};
use actix_outbox::schema::outbox;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Double, Nullable};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

/// The overview's figures, read in one statement, one status at a time through that status's
/// partial index (`outbox_ready`, `outbox_leased`, `outbox_dead`), so the planner reads those
/// rows and no `done` one. Scheduled rows and the age of the oldest unfinished row are what
/// `actix_outbox::admin::stats` calls them (`Stats::scheduled`, `Stats::oldest_unfinished_age_s`),
/// which `console/tests/http.rs` compares this with: pending rows never claimed whose
/// `available_at` is ahead are scheduled, and a row never claimed is due since its
/// `available_at` (its `created_at` unless it was scheduled).
const OVERVIEW_SQL: &str = "
SELECT pending, scheduled, processing, dead,
       extract(epoch FROM now() - least(p.oldest, l.oldest))::float8 AS oldest_unfinished_age_s, expired_leases
FROM (SELECT count(*) AS pending,
             count(*) FILTER (WHERE lease_version = 0 AND available_at > now()) AS scheduled,
             min(CASE WHEN lease_version = 0 THEN greatest(created_at, available_at) ELSE created_at END)
                 FILTER (WHERE NOT (lease_version = 0 AND available_at > now())) AS oldest
      FROM outbox WHERE status = 'pending') AS p,
     (SELECT count(*) AS processing, min(created_at) AS oldest,
             count(*) FILTER (WHERE lease_until < now()) AS expired_leases
      FROM outbox WHERE status = 'processing') AS l,
     (SELECT count(*) AS dead FROM outbox WHERE status = 'dead') AS d";

/// Rows of the table that are not history: what is still to do, and what failed.
#[derive(Debug, Clone, Copy, Default, PartialEq, QueryableByName)]
pub(crate) struct Overview {
    #[diesel(sql_type = BigInt)]
    pub(crate) pending: i64,
    /// Pending rows a producer scheduled for later, not yet due: part of `pending`, not backlog.
    #[diesel(sql_type = BigInt)]
    pub(crate) scheduled: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) processing: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) dead: i64,
    /// Seconds since the oldest due pending or processing row became due (database clock).
    #[diesel(sql_type = Nullable<Double>)]
    pub(crate) oldest_unfinished_age_s: Option<f64>,
    /// Processing rows whose lease ran out.
    #[diesel(sql_type = BigInt)]
    pub(crate) expired_leases: i64,
}

impl Overview {
    /// Rows still to publish now: pending and not scheduled, and processing.
    pub(crate) fn backlog(&self) -> i64 {
        self.pending - self.scheduled + self.processing
    }

    /// Pending rows that are not scheduled: due now, or backing off.
    pub(crate) fn ready(&self) -> i64 {
        self.pending - self.scheduled
    }
}

pub(crate) async fn overview(conn: &mut AsyncPgConnection) -> Result<Overview, StoreError> {
    conn.transaction(async |c| Ok(diesel::sql_query(OVERVIEW_SQL).get_result(c).await?)).await
}

/// What `/dead` is filtered by; blank fields filter nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
pub(crate) struct DeadFilter {
    /// The event type, exactly.
    #[serde(default)]
    pub(crate) event_type: String,
    /// Text within `aggregate_type/aggregate_id`, case-insensitive.
    #[serde(default)]
    pub(crate) aggregate: String,
    /// Text within `last_error`, case-insensitive.
    #[serde(default)]
    pub(crate) error: String,
}

/// `%text%` for `ILIKE`, with the pattern characters of `text` taken literally.
fn contains_pattern(text: &str) -> String {
    let mut pattern = String::from("%");
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}

/// The dead rows `filter` selects (through the partial index that holds dead rows).
fn dead_matching(filter: &DeadFilter) -> outbox::BoxedQuery<'static, diesel::pg::Pg> {
    let mut query = outbox::table.filter(outbox::status.eq(Status::Dead)).into_boxed();
    let event_type = filter.event_type.trim();
    if !event_type.is_empty() {
        query = query.filter(outbox::event_type.eq(event_type.to_owned()));
    }
    let aggregate = filter.aggregate.trim();
    if !aggregate.is_empty() {
        query = query
            .filter(outbox::aggregate_type.concat("/").concat(outbox::aggregate_id).ilike(contains_pattern(aggregate)));
    }
    let error = filter.error.trim();
    if !error.is_empty() {
        query = query.filter(outbox::last_error.ilike(contains_pattern(error)));
    }
    query
}

/// A page of dead rows: those `filter` selects with an id above `after`, oldest first, at most
/// `limit`; whether more follow; and how many match in all.
pub(crate) struct DeadPage {
    pub(crate) rows: Vec<OutboxRow>,
    pub(crate) more: bool,
    pub(crate) total: i64,
}

pub(crate) async fn dead_page(
    conn: &mut AsyncPgConnection,
    filter: &DeadFilter,
    after: Option<i64>,
    limit: i64,
) -> Result<DeadPage, StoreError> {
    let mut query = dead_matching(filter);
    if let Some(after) = after {
        query = query.filter(outbox::id.gt(after));
    }
    conn.transaction(async |c| {
        // One row more than shown tells whether there is a next page.
        let mut rows: Vec<OutboxRow> =
            query.order(outbox::id).limit(limit + 1).select(OutboxRow::as_select()).load(c).await?;
        let more = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let total = dead_matching(filter).select(diesel::dsl::count_star()).get_result(c).await?;
        Ok(DeadPage { rows, more, total })
    })
    .await
}

/// One row by id, whatever its status.
pub(crate) async fn row(conn: &mut AsyncPgConnection, id: i64) -> Result<Option<OutboxRow>, StoreError> {
    conn.transaction(async |c| Ok(outbox::table.find(id).select(OutboxRow::as_select()).first(c).await.optional()?))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_take_wildcards_literally() {
        assert_eq!(contains_pattern("order/4"), "%order/4%");
        assert_eq!(contains_pattern("50%_off\\"), "%50\\%\\_off\\\\%");
    }
}
