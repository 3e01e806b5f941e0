//! The console's own reads of the table. The table keeps its history (possibly millions of
//! `done` rows), and the overview reloads itself, so every statement here reads only what an
//! index bounds: the figures of the library's overview, dead rows through `outbox_later` (where
//! they wait, never due), or one row by its primary key. None counts the `done` rows. Each read is a transaction of its own, so that it works
//! through a transaction pooler too.

use actix_outbox::StoreError;
use actix_outbox::admin::{OutboxRow, Status};
use actix_outbox::schema::outbox;
use diesel::prelude::*;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

/// The overview's figures: the library's, read through indexes only (never the `done` rows).
pub(crate) use actix_outbox::admin::Overview;

pub(crate) async fn overview(conn: &mut AsyncPgConnection) -> Result<Overview, StoreError> {
    actix_outbox::admin::overview(conn).await
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

/// The dead rows `filter` selects (through `outbox_later`, where dead rows wait, never due).
fn dead_matching(filter: &DeadFilter) -> outbox::BoxedQuery<'static, diesel::pg::Pg> {
    let mut query = outbox::table
        .filter(outbox::available_at.gt(outbox::created_at))
        .filter(outbox::available_at.eq(actix_outbox::admin::dead_available_at()))
        .filter(outbox::status.eq(Status::Dead))
        .into_boxed();
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
