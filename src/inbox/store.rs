//! The inbox's SQL: its migrations and every statement the consumer runs, as typed Diesel
//! queries. Each function takes a connection, so that it runs inside the caller's transaction;
//! the consumer runs them in the same transaction as the handler.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::upsert::excluded;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};

use super::message::InboxMessage;
use super::schema::{inbox, inbox_aggregates};
use crate::error::StoreError;

/// The inbox's migrations (`migrations/inbox/`), compiled into the crate. They share diesel's
/// `__diesel_schema_migrations` table with the outbox's [`MIGRATIONS`](crate::admin::MIGRATIONS) but
/// never a version, so either set can be applied first, alone, or again.
pub const INBOX_MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/inbox");

/// Applies the inbox's pending migrations to `database_url` (the consumer's database) and
/// returns the versions it applied. It touches neither the outbox's tables nor its migrations.
///
/// Runs diesel's synchronous harness on a blocking thread, so it is safe to await from an actix
/// or tokio runtime.
///
/// ```no_run
/// # async fn f() -> Result<(), actix_outbox::StoreError> {
/// let applied = actix_outbox::inbox::migrate_inbox("postgres://localhost/billing").await?;
/// println!("applied {applied:?}");
/// # Ok(()) }
/// ```
pub async fn migrate_inbox(database_url: &str) -> Result<Vec<String>, StoreError> {
    crate::store::apply_migrations(database_url, INBOX_MIGRATIONS).await
}

/// [`migrate_inbox`] for callers outside any async runtime.
pub fn migrate_inbox_blocking(database_url: &str) -> Result<Vec<String>, StoreError> {
    crate::store::block_on(migrate_inbox(database_url))
}

/// The inbox migrations not yet applied to `database_url`, by name (empty when up to date).
pub async fn pending_inbox_migrations(database_url: &str) -> Result<Vec<String>, StoreError> {
    crate::store::pending_in(database_url, INBOX_MIGRATIONS).await
}

/// Records that `consumer` handled `message`, keyed by `(consumer, source, message_id)`
/// (`INSERT ... ON CONFLICT DO NOTHING`). Returns
/// whether the row is new: `false` means an earlier copy of the message was already recorded
/// (committed), or is being recorded by a transaction still open, in which case the insert
/// waits for that transaction and then reports what it did.
pub async fn record(conn: &mut AsyncPgConnection, consumer: &str, message: &InboxMessage) -> QueryResult<bool> {
    let inserted = diesel::insert_into(inbox::table)
        .values((
            inbox::consumer.eq(consumer),
            inbox::source.eq(&message.source),
            inbox::message_id.eq(message.message_id),
            inbox::event_type.eq(&message.event_type),
            inbox::aggregate_type.eq(&message.aggregate_type),
            inbox::aggregate_id.eq(&message.aggregate_id),
            inbox::late.eq(message.late),
        ))
        .on_conflict_do_nothing()
        .execute(conn)
        .await?;
    Ok(inserted == 1)
}

/// Whether `consumer` has recorded `message_id` of `source` (for the tests, through
/// `testing::inbox`).
#[cfg_attr(not(feature = "test-util"), allow(dead_code))]
pub async fn is_recorded(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    source: &str,
    message_id: i64,
) -> QueryResult<bool> {
    diesel::select(diesel::dsl::exists(
        inbox::table
            .filter(inbox::consumer.eq(consumer))
            .filter(inbox::source.eq(source))
            .filter(inbox::message_id.eq(message_id)),
    ))
    .get_result(conn)
    .await
}

/// Where a message stands against the newest one applied for its aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AggregateOrder {
    /// No newer message of the aggregate was applied: the message is now the newest.
    InOrder,
    /// A message with a higher id (`newest`) was already applied; the high-water mark stays.
    Late {
        /// The highest message id applied for the aggregate.
        newest: i64,
    },
}

/// The aggregate of one producer, as an ordered consumer tracks it: message ids are comparable
/// only within one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggregateRef<'a> {
    /// The producing outbox (`x-outbox-source`; `''` when the messages carry none).
    pub source: &'a str,
    /// `x-aggregate-type`.
    pub aggregate_type: &'a str,
    /// `x-aggregate-id`.
    pub aggregate_id: &'a str,
}

impl<'a> AggregateRef<'a> {
    /// The aggregate `message` belongs to.
    pub fn of(message: &'a InboxMessage) -> Self {
        Self { source: &message.source, aggregate_type: &message.aggregate_type, aggregate_id: &message.aggregate_id }
    }
}

/// Raises the high-water mark of `consumer` for `aggregate` to `message_id` unless it is
/// already at or above it, and says which it was. The aggregate's row stays locked until the
/// transaction ends, so two transactions for one aggregate take turns.
pub async fn advance_aggregate(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    aggregate: AggregateRef<'_>,
    message_id: i64,
) -> QueryResult<AggregateOrder> {
    // The filter of `ON CONFLICT DO UPDATE ... WHERE` (diesel's prelude brings the query's).
    use diesel::query_dsl::methods::FilterDsl;
    use inbox_aggregates::dsl as a;
    let raised: Option<i64> = diesel::insert_into(a::inbox_aggregates)
        .values((
            a::consumer.eq(consumer),
            a::source.eq(aggregate.source),
            a::aggregate_type.eq(aggregate.aggregate_type),
            a::aggregate_id.eq(aggregate.aggregate_id),
            a::last_message_id.eq(message_id),
        ))
        .on_conflict((a::consumer, a::source, a::aggregate_type, a::aggregate_id))
        .do_update()
        .set((a::last_message_id.eq(excluded(a::last_message_id)), a::updated_at.eq(diesel::dsl::now)))
        .filter(a::last_message_id.lt(excluded(a::last_message_id)))
        .returning(a::last_message_id)
        .get_result(conn)
        .await
        .optional()?;
    if raised.is_some() {
        return Ok(AggregateOrder::InOrder);
    }
    // ON CONFLICT locked the row even though it did not update it: this read is current.
    let newest = last_applied(conn, consumer, aggregate).await?.unwrap_or(message_id);
    Ok(AggregateOrder::Late { newest })
}

/// The highest message id `consumer` applied for `aggregate`, if any.
pub async fn last_applied(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    aggregate: AggregateRef<'_>,
) -> QueryResult<Option<i64>> {
    use inbox_aggregates::dsl as a;
    a::inbox_aggregates
        .filter(a::consumer.eq(consumer))
        .filter(a::source.eq(aggregate.source))
        .filter(a::aggregate_type.eq(aggregate.aggregate_type))
        .filter(a::aggregate_id.eq(aggregate.aggregate_id))
        .select(a::last_message_id)
        .first(conn)
        .await
        .optional()
}

/// Deletes `consumer`'s inbox rows received before `received_before` and returns how many.
///
/// A purged message id is no longer recognised: a copy of it delivered afterwards is handled
/// again. Keep rows for longer than a copy can take to arrive (a producer's retries and
/// lease takeovers, a consumer's retry delays, messages parked in queues).
pub async fn purge_inbox(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    received_before: DateTime<Utc>,
) -> QueryResult<usize> {
    let delete = diesel::delete(
        inbox::table.filter(inbox::consumer.eq(consumer)).filter(inbox::received_at.lt(received_before)),
    );
    // In a transaction of its own (or the caller's), so that it works through a transaction pooler.
    crate::store::in_transaction(conn, async |c| delete.execute(c).await).await
}

/// What [`erase_aggregate`] did to the inbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct InboxErasure {
    /// `inbox` rows whose `aggregate_type` and `aggregate_id` were blanked (`''`).
    pub anonymised: u64,
    /// `inbox_aggregates` rows (ordered consumers' high-water marks) deleted.
    pub marks_deleted: u64,
}

/// Whether the connection's `search_path` reaches both inbox tables (`inbox`,
/// `inbox_aggregates`): for tools that act on a database that may or may not hold an inbox.
pub async fn has_inbox_tables(conn: &mut AsyncPgConnection) -> Result<bool, StoreError> {
    #[derive(QueryableByName)]
    struct Present {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        present: bool,
    }
    // Catalog functions: no table of the schema to build the query from.
    let row: Present = diesel::sql_query(
        "SELECT to_regclass('inbox') IS NOT NULL AND to_regclass('inbox_aggregates') IS NOT NULL AS present",
    )
    .get_result(conn)
    .await?;
    Ok(row.present)
}

/// Erases one aggregate from the inbox, for every consumer and source, in one transaction (or
/// the caller's): blanks `aggregate_type` and `aggregate_id` (to `''`, as for a message that
/// carried none) in its `inbox` rows, and deletes its `inbox_aggregates` rows.
///
/// The inbox keeps no payload, only the message's key and, for operators, its aggregate and
/// event type. The key `(consumer, source, message_id)` stays, so a copy of an erased message
/// delivered later is still recognised as a duplicate and not applied again. Nothing in the
/// consumer reads the blanked columns back: it records them and keys every decision on the
/// message's own headers.
///
/// For an ordered consumer ([`InboxConfig::ordered`](crate::inbox::InboxConfig::ordered)) the
/// deleted row was the aggregate's high-water mark: a later message of the aggregate starts a
/// new mark, and one older than the erased mark that was never applied (still in a queue, a
/// retry on its way) is taken as in order instead of late. Copies of messages already applied
/// stay duplicates, but an ordered consumer raises the mark before it finds the duplicate, so
/// such a copy writes the aggregate's type and id into `inbox_aggregates` again (as any new
/// message of the aggregate does into both tables): erase once the aggregate's messages have
/// stopped arriving, and again if one arrives later.
pub async fn erase_aggregate(
    conn: &mut AsyncPgConnection,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<InboxErasure, StoreError> {
    crate::store::in_transaction(conn, async |conn| {
        let anonymised = diesel::update(
            inbox::table.filter(inbox::aggregate_type.eq(aggregate_type)).filter(inbox::aggregate_id.eq(aggregate_id)),
        )
        .set((inbox::aggregate_type.eq(""), inbox::aggregate_id.eq("")))
        .execute(conn)
        .await?;
        let marks_deleted = diesel::delete(
            inbox_aggregates::table
                .filter(inbox_aggregates::aggregate_type.eq(aggregate_type))
                .filter(inbox_aggregates::aggregate_id.eq(aggregate_id)),
        )
        .execute(conn)
        .await?;
        Ok(InboxErasure { anonymised: anonymised as u64, marks_deleted: marks_deleted as u64 })
    })
    .await
}

#[cfg(test)]
mod tests {
    use diesel::migration::MigrationSource;
    use diesel::pg::Pg;

    use super::*;

    #[test]
    fn inbox_and_outbox_versions_never_collide() {
        let versions = |source: &EmbeddedMigrations| -> Vec<String> {
            MigrationSource::<Pg>::migrations(source).unwrap().iter().map(|m| m.name().version().to_string()).collect()
        };
        let outbox = versions(&crate::admin::MIGRATIONS);
        let inbox = versions(&INBOX_MIGRATIONS);
        assert!(!inbox.is_empty() && !outbox.is_empty());
        for v in &inbox {
            assert!(!outbox.contains(v), "inbox migration version {v} is also an outbox version");
        }
    }
}
