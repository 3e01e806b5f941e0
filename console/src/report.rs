//! What `actix-outbox stats --json` prints and the console's `/api/stats` answers: one
//! definition for both.

use actix_outbox::admin::{BlockedAggregate, Stats};
use actix_outbox::{Fifo, StoreError};
use diesel_async::AsyncPgConnection;
use serde::Serialize;

/// Blocked aggregates a [`StatsReport`] lists at most (`actix-outbox dead blocked` lists more).
pub const BLOCKED_SHOWN: i64 = 20;

/// The aggregates blocked under a FIFO gate, as `actix-outbox stats --fifo --json` adds them to
/// its object.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct BlockedView {
    /// The first of them, oldest dead head first.
    pub blocked_aggregates: Vec<BlockedAggregate>,
    /// How many there are in all.
    pub blocked_aggregates_total: i64,
}

impl BlockedView {
    /// Reads the first `limit` aggregates blocked under `fifo` and their total in one read-only
    /// snapshot, so that the total never disagrees with the list.
    pub async fn read(conn: &mut AsyncPgConnection, fifo: &Fifo, limit: i64) -> Result<Self, StoreError> {
        conn.build_transaction()
            .read_only()
            .repeatable_read()
            .run(async |tx| {
                Ok(BlockedView {
                    blocked_aggregates: actix_outbox::admin::blocked_aggregates(tx, fifo, limit).await?,
                    blocked_aggregates_total: actix_outbox::admin::blocked_aggregates_count(tx, fifo).await?,
                })
            })
            .await
    }
}

/// The store's [`Stats`], and the blocked aggregates when a FIFO gate is on (their keys absent
/// otherwise: under no gate a dead row blocks nothing, and an empty list would claim more than
/// is known).
///
/// Serialized: `{"by_status": {...}, "oldest_unfinished_age_s": ..., "expired_leases": n,
/// "attempts": {...}}`, plus `"blocked_aggregates"` and `"blocked_aggregates_total"` under a gate.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct StatsReport {
    /// The table's figures.
    #[serde(flatten)]
    pub stats: Stats,
    /// The blocked aggregates, under a gate.
    #[serde(flatten)]
    pub blocked: Option<BlockedView>,
}

impl StatsReport {
    /// Reads [`actix_outbox::admin::stats`] and, when `fifo` is on, the first
    /// [`BLOCKED_SHOWN`] blocked aggregates and their total.
    ///
    /// The statistics count every row of the table, `done` ones included, in one pass: the same
    /// statement (and cost) as the dispatcher's table gauges.
    pub async fn read(conn: &mut AsyncPgConnection, fifo: &Fifo) -> Result<Self, StoreError> {
        let stats = actix_outbox::admin::stats(conn).await?;
        let blocked = if fifo.is_on() { Some(BlockedView::read(conn, fifo, BLOCKED_SHOWN).await?) } else { None };
        Ok(StatsReport { stats, blocked })
    }
}
