//! The claim: one short statement (and so one transaction) that reaps, then leases a batch.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::pg::data_types::PgInterval;
use diesel::sql_types::{BigInt, Bool, Int4, Int8, Interval, Jsonb, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::StoreError;
use crate::model::{Fence, OutboxMessage};

/// What one claim asks for.
#[derive(Debug, Clone)]
pub struct ClaimParams<'a> {
    /// Written to `lease_owner`, for humans.
    pub owner: &'a str,
    /// Rows to lease at most.
    pub batch: usize,
    /// `lease_until = now() + lease`.
    pub lease: Duration,
    /// Rows whose lease expired at this many attempts are reaped instead of reclaimed.
    pub max_attempts: i32,
}

/// What one claim did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// Rows leased to the caller, in id order.
    pub messages: Vec<OutboxMessage>,
    /// Rows sent dead because their lease expired with no attempt left (a message that keeps
    /// killing its worker), as (id, fence at the time).
    pub reaped: Vec<Fence>,
}

/// Reaps, then leases up to `batch` rows: pending rows whose `available_at` has passed, and
/// processing rows whose lease expired with attempts left. Every leased row gets
/// `lease_version + 1` and `attempts + 1`; rows other workers hold locked are skipped.
///
/// The two kinds of candidate are read by two index-friendly branches (`outbox_ready` by
/// `(available_at, id)`, `outbox_leased` by `lease_until`) rather than one `OR` predicate,
/// which would match neither partial index and walk every done row by primary key.
pub async fn claim(conn: &mut AsyncPgConnection, params: &ClaimParams<'_>) -> Result<Claim, StoreError> {
    let rows: Vec<ClaimRow> = diesel::sql_query(CLAIM_SQL)
        .bind::<Int4, _>(params.max_attempts)
        .bind::<BigInt, _>(i64::try_from(params.batch).unwrap_or(i64::MAX))
        .bind::<Text, _>(params.owner)
        .bind::<Interval, _>(interval(params.lease))
        .load(conn)
        .await?;
    let mut claim = Claim::default();
    for row in rows {
        if row.reaped {
            claim.reaped.push(Fence { id: row.id, lease_version: row.lease_version });
        } else {
            claim.messages.push(row.into_message());
        }
    }
    // RETURNING order is unspecified.
    claim.messages.sort_by_key(|m| m.id);
    claim.reaped.sort_by_key(|f| f.id);
    Ok(claim)
}

pub(crate) fn interval(d: Duration) -> PgInterval {
    PgInterval::from_microseconds(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

// $1 max_attempts, $2 batch, $3 owner, $4 lease.
// The reaper runs first in the same statement; its rows (attempts >= max) and the claim's
// (attempts < max) are disjoint, so no row is written twice.
const CLAIM_SQL: &str = r#"
WITH reaped AS (
    UPDATE outbox
    SET status = 'dead',
        last_error = 'reaped: lease expired after ' || attempts || ' of ' || $1::int
                     || ' attempts (the worker died or stalled mid-publish)'
                     || coalesce('; last error: ' || last_error, ''),
        lease_owner = NULL,
        lease_until = NULL
    WHERE id IN (
        SELECT id FROM outbox
        WHERE status = 'processing' AND lease_until < now() AND attempts >= $1
        ORDER BY lease_until
        LIMIT 1000
        FOR UPDATE SKIP LOCKED)
    RETURNING id, lease_version
), expired AS (
    SELECT id FROM outbox
    WHERE status = 'processing' AND lease_until < now() AND attempts < $1
    ORDER BY lease_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), ready AS (
    SELECT id FROM outbox
    WHERE status = 'pending' AND available_at <= now()
    ORDER BY available_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id FROM (SELECT id FROM expired UNION ALL SELECT id FROM ready) AS candidates
    ORDER BY id
    LIMIT $2
), claimed AS (
    UPDATE outbox AS o
    SET status = 'processing',
        lease_owner = $3,
        lease_until = now() + $4,
        lease_version = o.lease_version + 1,
        attempts = o.attempts + 1
    FROM picked
    WHERE o.id = picked.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.created_at,
              o.attempts, o.lease_version, o.lease_until
)
SELECT false AS reaped, id, aggregate_type, aggregate_id, event_type, payload, created_at,
       attempts, lease_version, lease_until
FROM claimed
UNION ALL
SELECT true, id, '', '', '', 'null'::jsonb, now(), 0, lease_version, NULL
FROM reaped
"#;

#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(sql_type = Bool)]
    reaped: bool,
    #[diesel(sql_type = Int8)]
    id: i64,
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
    #[diesel(sql_type = Text)]
    event_type: String,
    #[diesel(sql_type = Jsonb)]
    payload: serde_json::Value,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Int4)]
    attempts: i32,
    #[diesel(sql_type = Int8)]
    lease_version: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    lease_until: Option<DateTime<Utc>>,
}

impl ClaimRow {
    fn into_message(self) -> OutboxMessage {
        OutboxMessage {
            id: self.id,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            event_type: self.event_type,
            payload: self.payload,
            created_at: self.created_at,
            attempts: self.attempts,
            lease_version: self.lease_version,
            lease_until: self.lease_until,
        }
    }
}
