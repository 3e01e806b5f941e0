//! The claim: one short statement (and so one transaction) that reaps, then leases a batch.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::pg::data_types::PgInterval;
use diesel::sql_types::{Array, BigInt, Bool, Int4, Int8, Interval, Nullable, Text, Timestamptz};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

use super::prepared::{Prepared, prepared};
use crate::config::Fifo;
use crate::error::StoreError;
use crate::model::{Fence, OutboxMessage};

/// What one claim asks for.
#[derive(Debug, Clone)]
pub struct ClaimParams<'a> {
    /// Written to `lease_owner`, for humans.
    pub owner: &'a str,
    /// Rows to lease at most.
    pub batch: usize,
    /// Payload bytes (JSON text) to lease at most: rows are taken in order while they fit, and
    /// the first row is taken whatever its size, so a row larger than the budget still goes,
    /// alone.
    pub max_bytes: usize,
    /// `lease_until = now() + lease`.
    pub lease: Duration,
    /// Rows whose lease expired at this many attempts are reaped instead of reclaimed.
    pub max_attempts: i32,
    /// The per-aggregate gate: which rows wait for the earlier rows of their aggregate.
    pub fifo: &'a Fifo,
    /// Start the walk of pending rows here instead of at the oldest one: pass the
    /// [`Claim::resume`] of this worker's previous claim while the backlog is deep.
    ///
    /// Every claimed row leaves a dead entry behind in the index of pending rows until
    /// `VACUUM` removes it, and a claim from the start steps over all of them: hundreds of
    /// index pages per claim after a hundred thousand claims. The position is a hint only: a
    /// pending row before it (one committed late with an old `available_at`, or released by a
    /// claim that rolled back) is not seen by a hinted claim, so callers must claim without it
    /// now and then, and whenever a claim comes back short (the [`ClaimActor`] does so at
    /// least once a second).
    ///
    /// [`ClaimActor`]: crate::OutboxSupervisor
    pub resume: Option<ReadyPosition>,
    /// Under [`Fifo::All`]: where the scan of aggregates for free heads starts, the
    /// [`HeadsScan::StoppedAfter`] of this worker's previous claim (`None`: from the first
    /// aggregate). Each scan visits at most `4 × batch` aggregates, so successive claims take
    /// turns over all of them.
    pub heads_after: Option<&'a AggregateKey>,
}

/// An aggregate, as the FIFO gate sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AggregateKey {
    /// `aggregate_type`.
    pub aggregate_type: String,
    /// `aggregate_id`.
    pub aggregate_id: String,
}

/// How far a claim's scan of aggregates for free heads went (only under [`Fifo::All`], and only
/// when the walk of the oldest pending rows came back short).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum HeadsScan {
    /// The claim found enough rows without scanning aggregates.
    #[default]
    NotRun,
    /// The scan reached the last aggregate: the next one starts from the first.
    ReachedEnd,
    /// The scan stopped at its bound after this aggregate: the next one starts after it.
    StoppedAfter(AggregateKey),
}

/// A place in the order in which pending rows are claimed: `(available_at, id)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReadyPosition {
    /// The row's `available_at`.
    pub available_at: DateTime<Utc>,
    /// The row's id.
    pub id: i64,
}

/// What one claim did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// Rows leased to the caller, in id order.
    pub messages: Vec<OutboxMessage>,
    /// Rows sent dead because their lease expired with no attempt left (a message that keeps
    /// killing its worker), as (id, fence at the time).
    pub reaped: Vec<Fence>,
    /// The earliest pending row this claim took (expired leases aside): where the next claim
    /// may start its walk ([`ClaimParams::resume`]). `None` if it took no pending row.
    pub resume: Option<ReadyPosition>,
    /// Where the scan of aggregates stopped, for [`ClaimParams::heads_after`].
    pub heads: HeadsScan,
    /// Claimable rows left for a later claim because they did not fit in
    /// [`ClaimParams::max_bytes`]: the backlog goes on even though the claim took fewer rows
    /// than the batch.
    pub cut_by_budget: usize,
}

/// Reaps, then leases up to `batch` rows: pending rows whose `available_at` has passed, and
/// processing rows whose lease expired with attempts left. Every leased row gets
/// `lease_version + 1` and `attempts + 1`; rows other workers hold locked are skipped.
///
/// The two kinds of candidate are read by two index-friendly branches (`outbox_ready` by
/// `(available_at, id)`, `outbox_leased` by `lease_until`) rather than one `OR` predicate,
/// which would match neither partial index and walk every done row by primary key.
///
/// With [`ClaimParams::fifo`] on, both branches also require that no earlier row of the same
/// aggregate is unfinished (a `NOT EXISTS` probe of `outbox_fifo_gate` per candidate; see
/// [`Fifo`] for the rule). The gate reads committed rows only, and `done` is final, so a row
/// that passes it has every gated predecessor finished for good: the gate holds across
/// concurrent claims, processes and lease takeovers without any lock beyond the claimed rows.
pub async fn claim(conn: &mut AsyncPgConnection, params: &ClaimParams<'_>) -> Result<Claim, StoreError> {
    let rows: Vec<ClaimRow> = claim_query(claim_sql(params.fifo), params).load(conn).await?;
    let mut claim = Claim::default();
    for row in rows {
        match row.kind {
            KIND_REAPED => {
                claim.reaped.push(Fence { id: row.id, lease_version: row.lease_version });
                continue;
            }
            KIND_CUT => {
                claim.cut_by_budget = usize::try_from(row.id).unwrap_or_default();
                continue;
            }
            KIND_HEADS_END => {
                claim.heads = match row.heads_bounded {
                    Some(true) => HeadsScan::StoppedAfter(AggregateKey {
                        aggregate_type: row.aggregate_type,
                        aggregate_id: row.aggregate_id,
                    }),
                    _ => HeadsScan::ReachedEnd,
                };
                continue;
            }
            _ => {}
        }
        if let Some(available_at) = row.ready_at {
            let here = ReadyPosition { available_at, id: row.id };
            claim.resume = Some(claim.resume.map_or(here, |r| r.min(here)));
        }
        claim.messages.push(row.into_message()?);
    }
    // RETURNING order is unspecified.
    claim.messages.sort_by_key(|m| m.id);
    claim.reaped.sort_by_key(|f| f.id);
    Ok(claim)
}

/// The plan PostgreSQL picks for [`claim`] with `params`, one line per row of `EXPLAIN`
/// output, for operators asking why claims are slow.
///
/// With `analyze`, the claim really runs (`EXPLAIN (ANALYZE, BUFFERS)`), inside a transaction
/// that is then rolled back, so no row changes; the locks it took are held until the rollback,
/// so other workers may skip those rows for that instant.
///
/// ```no_run
/// # async fn f(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), actix_outbox::StoreError> {
/// use actix_outbox::Fifo;
/// use actix_outbox::store::{ClaimParams, explain_claim};
///
/// let params = ClaimParams {
///     owner: "explain",
///     batch: 50,
///     max_bytes: usize::MAX,
///     lease: std::time::Duration::from_secs(60),
///     max_attempts: 12,
///     fifo: &Fifo::All,
///     resume: None,
///     heads_after: None,
/// };
/// for line in explain_claim(conn, &params, true).await? {
///     println!("{line}");
/// }
/// # Ok(()) }
/// ```
pub async fn explain_claim(
    conn: &mut AsyncPgConnection,
    params: &ClaimParams<'_>,
    analyze: bool,
) -> Result<Vec<String>, StoreError> {
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let options = if analyze { "ANALYZE, BUFFERS" } else { "COSTS" };
    let sql = format!("EXPLAIN ({options}) {}", claim_sql(params.fifo));
    // EXPLAIN ANALYZE executes the claim: do it in a transaction (a savepoint if the caller
    // has one open) and roll it back.
    if analyze {
        AnsiTransactionManager::begin_transaction(conn).await?;
    }
    let lines: Result<Vec<PlanLine>, _> = claim_query(&sql, params).load(conn).await;
    if analyze {
        AnsiTransactionManager::rollback_transaction(conn).await?;
    }
    Ok(lines?.into_iter().map(|l| l.line).collect())
}

fn claim_sql(fifo: &Fifo) -> &'static str {
    match fifo {
        Fifo::Off => CLAIM_SQL,
        Fifo::All => CLAIM_FIFO_SQL,
        Fifo::EventTypes(_) => CLAIM_FIFO_TYPES_SQL,
    }
}

fn claim_query<'a>(sql: &'a str, params: &'a ClaimParams<'a>) -> Prepared<'a> {
    let query = prepared(sql)
        .bind::<Int4, _>(params.max_attempts)
        .bind::<BigInt, _>(i64::try_from(params.batch).unwrap_or(i64::MAX))
        .bind::<Text, _>(params.owner)
        .bind::<Interval, _>(interval(params.lease))
        .bind::<Nullable<Timestamptz>, _>(params.resume.map(|r| r.available_at))
        .bind::<Nullable<Int8>, _>(params.resume.map(|r| r.id));
    // $7 and $8 depend on the gate; a statement that does not use them binds placeholders that
    // never reach the text. $9 is the byte budget.
    let no_text = None::<&str>;
    let query = match params.fifo {
        Fifo::EventTypes(types) => query.bind::<Array<Text>, _>(types).bind::<Nullable<Text>, _>(no_text),
        Fifo::All => query
            .bind::<Nullable<Text>, _>(params.heads_after.map(|k| k.aggregate_type.as_str()))
            .bind::<Nullable<Text>, _>(params.heads_after.map(|k| k.aggregate_id.as_str())),
        Fifo::Off => query.bind::<Nullable<Text>, _>(no_text).bind::<Nullable<Text>, _>(no_text),
    };
    query.bind::<BigInt, _>(i64::try_from(params.max_bytes).unwrap_or(i64::MAX))
}

pub(crate) fn interval(d: Duration) -> PgInterval {
    PgInterval::from_microseconds(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

// The claim statement. `$gate` is appended to the expired-lease branch (the candidate row is
// `o`); `$ready` is the CTE list that defines `ready`, the pending rows to lease. $1
// max_attempts, $2 batch, $3 owner, $4 lease, $5 and $6 the resume position (both NULL for a
// walk from the start), then either $7 the gated event types (when the gate names them) or $7
// and $8 the aggregate after which the scan of heads starts (gate on all types), and $9 the
// byte budget: `picked` takes the candidates in id order while their payloads (as JSON text)
// fit in it, and the first whatever its size. `$tail` adds rows to the result. Each result row
// is claimed (kind 0), reaped (1), where the heads scan ended (2), or how many candidates the
// byte budget left out (3, only when some were).
//
// The reaper runs first in the same statement; its rows (attempts >= max) and the claim's
// (attempts < max) are disjoint, so no row is written twice. It is not gated: a dead row blocks
// its aggregate as well as a processing one does.
macro_rules! claim_sql {
    ($gate:literal) => {
        claim_sql!($gate, ready_walk!($gate), "")
    };
    ($gate:literal, $ready:expr, $tail:expr) => {
        concat!(
            r#"
WITH reaped AS (
    UPDATE outbox
    SET status = 'dead',
        lease_version = lease_version + 1,
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
    -- The fence of the claim that died; the row's own version moved past it, so that no
    -- late write of that claim (nor a read-back of one) can count the reaped row as its own.
    RETURNING id, lease_version - 1 AS lease_version
), expired AS (
    SELECT o.id FROM outbox AS o
    WHERE o.status = 'processing' AND o.lease_until < now() AND o.attempts < $1"#,
            $gate,
            r#"
    ORDER BY o.lease_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), "#,
            $ready,
            r#"
), candidates AS (
    SELECT c.id, c.from_ready, octet_length(o.payload::text) AS bytes
    FROM (SELECT id, false AS from_ready FROM expired UNION ALL SELECT id, true FROM ready) AS c
    JOIN outbox AS o ON o.id = c.id
    ORDER BY c.id
    LIMIT $2
), picked AS (
    SELECT id, from_ready
    FROM (SELECT id, from_ready, bytes, sum(bytes) OVER (ORDER BY id) - bytes AS before FROM candidates) AS w
    WHERE before = 0 OR before + bytes <= $9
), claimed AS (
    UPDATE outbox AS o
    SET status = 'processing',
        lease_owner = $3,
        lease_until = now() + $4,
        lease_version = o.lease_version + 1,
        attempts = o.attempts + 1
    FROM picked
    WHERE o.id = picked.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS payload, o.created_at,
              o.attempts, o.lease_version, o.lease_until,
              CASE WHEN picked.from_ready THEN o.available_at END AS ready_at
)
SELECT 0 AS kind, id, aggregate_type, aggregate_id, event_type, payload, created_at,
       attempts, lease_version, lease_until, ready_at, NULL::bool AS heads_bounded
FROM claimed
UNION ALL
SELECT 1, id, '', '', '', 'null', now(), 0, lease_version, NULL, NULL, NULL
FROM reaped
UNION ALL
SELECT 3, cut, '', '', '', 'null', now(), 0, 0, NULL, NULL, NULL
FROM (SELECT (SELECT count(*) FROM candidates) - (SELECT count(*) FROM picked) AS cut) AS budget
WHERE cut > 0"#,
            $tail,
            "\n"
        )
    };
}

// `ready` as a walk of the pending rows in claim order from the resume position, each
// candidate passing `$gate`.
macro_rules! ready_walk {
    ($gate:literal) => {
        concat!(
            r#"ready AS (
    SELECT o.id FROM outbox AS o
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND (o.available_at, o.id) >= (coalesce($5, '-infinity'), coalesce($6, -9223372036854775808))"#,
            $gate,
            r#"
    ORDER BY o.available_at, o.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED"#
        )
    };
}

// `ready` under the FIFO gate (see `CLAIM_FIFO_SQL`): a walk of the oldest pending rows, each
// `o` passing `$gate`, that stops at the batch or at the end of a window of `4 × batch` rows;
// then, only when it came back short, the first unfinished row of each of up to `4 × batch`
// aggregates after $7/$8 (`heads_end` reports where that scan stopped). Both lock as they go
// (`SKIP LOCKED`), so concurrent claims pass over each other's rows.
macro_rules! fifo_ready {
    ($gate:literal) => {
        concat!(
            r#"window_end AS (
    SELECT available_at, id FROM outbox
    WHERE status = 'pending' AND available_at <= now()
    ORDER BY available_at, id
    OFFSET $2 * 4 - 1
    LIMIT 1
), walk AS (
    SELECT o.id FROM outbox AS o
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND o.available_at <= coalesce((SELECT available_at FROM window_end), 'infinity')
      AND (o.available_at, o.id) <= (coalesce((SELECT available_at FROM window_end), 'infinity'),
                                     coalesce((SELECT id FROM window_end), 9223372036854775807))"#,
            $gate,
            r#"
    ORDER BY o.available_at, o.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), heads AS (
    WITH RECURSIVE first_unfinished (aggregate_type, aggregate_id, id, step) AS (
        (SELECT aggregate_type, aggregate_id, id, 1 FROM outbox
         WHERE status IN ('pending', 'processing', 'dead')
           AND ($7::text IS NULL OR (aggregate_type, aggregate_id) > ($7, $8))
         ORDER BY aggregate_type, aggregate_id, id
         LIMIT 1)
        UNION ALL
        SELECT next.aggregate_type, next.aggregate_id, next.id, f.step + 1
        FROM first_unfinished AS f
        CROSS JOIN LATERAL (
            SELECT aggregate_type, aggregate_id, id FROM outbox
            WHERE status IN ('pending', 'processing', 'dead')
              AND (aggregate_type, aggregate_id) > (f.aggregate_type, f.aggregate_id)
            ORDER BY aggregate_type, aggregate_id, id
            LIMIT 1) AS next
        WHERE f.step < $2 * 4
    )
    SELECT * FROM first_unfinished WHERE (SELECT count(*) FROM walk) < $2
), heads_ready AS (
    SELECT o.id FROM heads AS h JOIN outbox AS o ON o.id = h.id
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND o.id NOT IN (SELECT id FROM walk)
    ORDER BY o.available_at, o.id
    LIMIT (SELECT $2 - count(*) FROM walk)
    FOR UPDATE OF o SKIP LOCKED
), heads_end AS (
    SELECT last.aggregate_type, last.aggregate_id, coalesce(last.step >= $2 * 4, false) AS bounded
    FROM (SELECT 1) AS one
    LEFT JOIN LATERAL (SELECT * FROM heads ORDER BY step DESC LIMIT 1) AS last ON true
    WHERE (SELECT count(*) FROM walk) < $2
), ready AS (
    SELECT id FROM walk
    UNION ALL
    SELECT id FROM heads_ready"#
        )
    };
}

/// No gate: any ready row.
const CLAIM_SQL: &str = claim_sql!("");

/// Every row waits for the earlier unfinished rows of its aggregate. The probe is a range scan
/// of the partial index `outbox_fifo_gate (aggregate_type, aggregate_id, id)`, whose predicate
/// is exactly the unfinished statuses.
///
/// Pending rows are found two ways, the second only when the first comes back short:
///
/// - `walk`: the oldest pending rows in claim order, each probed by the gate, until the batch
///   is full or `4 × batch` rows have been seen. Cheap when most pending rows head their
///   aggregate (many aggregates, short backlogs each).
/// - `heads`: a skip scan of `outbox_fifo_gate` that visits aggregates with unfinished rows in
///   key order, one index descent each, and takes each one's first unfinished row: claimable if
///   pending. It starts after [`ClaimParams::heads_after`] and stops after `4 × batch`
///   aggregates ([`Claim::heads`] says where), so its cost is bounded however many aggregates
///   there are, and successive claims take turns over all of them.
///
/// A walk of rows alone degrades when the free heads are fewer than the batch (few aggregates,
/// or every aggregate's head in flight): it then walks every pending row, a probe each, to find
/// them: about a second per claim at 100,000 pending rows in 1,000 aggregates, against 22–27 ms
/// for both parts; 25 ms with one aggregate's 1,000 rows ahead of 10,000 others (`EXPLAIN
/// ANALYZE`, batch 200). The resume position does not apply: a walk passes over
/// blocked rows, and a hint would hide them once they are unblocked.
const CLAIM_FIFO_SQL: &str = claim_sql!(
    r#"
      AND NOT EXISTS (
          SELECT 1 FROM outbox AS prev
          WHERE prev.aggregate_type = o.aggregate_type AND prev.aggregate_id = o.aggregate_id
            AND prev.id < o.id AND prev.status IN ('pending', 'processing', 'dead'))"#,
    fifo_ready!(
        r#"
      AND NOT EXISTS (
          SELECT 1 FROM outbox AS prev
          WHERE prev.aggregate_type = o.aggregate_type AND prev.aggregate_id = o.aggregate_id
            AND prev.id < o.id AND prev.status IN ('pending', 'processing', 'dead'))"#
    ),
    r#"
UNION ALL
SELECT 2, 0, coalesce(aggregate_type, ''), coalesce(aggregate_id, ''), '', 'null', now(), 0, 0, NULL, NULL,
       bounded
FROM heads_end"#
);

/// Rows of the types in $7 wait for the earlier unfinished rows of those types of their
/// aggregate; other rows pass without a probe. The `OR` keeps the probe a per-row subplan that
/// runs only for gated rows and stops at the first match; written as an anti-join with the
/// outer test inside, PostgreSQL evaluates that test as a join filter after the probe, and an
/// unlisted row behind a long backlog of its aggregate then walks the whole backlog.
///
/// This variant walks rows only, without the bound and the skip scan of [`CLAIM_FIFO_SQL`]: a
/// bounded walk could leave unlisted rows (which never wait) stuck behind a window of blocked
/// listed ones. Its cost grows with the pending rows it passes over when the free rows are
/// fewer than the batch.
const CLAIM_FIFO_TYPES_SQL: &str = claim_sql!(
    r#"
      AND (o.event_type <> ALL($7) OR NOT EXISTS (
          SELECT 1 FROM outbox AS prev
          WHERE prev.aggregate_type = o.aggregate_type AND prev.aggregate_id = o.aggregate_id
            AND prev.id < o.id AND prev.status IN ('pending', 'processing', 'dead')
            AND prev.event_type = ANY($7)))"#
);

#[derive(QueryableByName)]
struct ClaimRow {
    /// 0: a claimed row; `KIND_REAPED`; `KIND_HEADS_END`.
    #[diesel(sql_type = Int4)]
    kind: i32,
    #[diesel(sql_type = Int8)]
    id: i64,
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
    #[diesel(sql_type = Text)]
    event_type: String,
    /// The payload's JSON text (`payload::text`).
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Int4)]
    attempts: i32,
    #[diesel(sql_type = Int8)]
    lease_version: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    lease_until: Option<DateTime<Utc>>,
    /// `available_at` of a row taken from the pending ones (not an expired lease).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    ready_at: Option<DateTime<Utc>>,
    /// For the heads-scan row: whether the scan stopped at its bound (else it reached the end).
    #[diesel(sql_type = Nullable<Bool>)]
    heads_bounded: Option<bool>,
}

const KIND_REAPED: i32 = 1;
const KIND_HEADS_END: i32 = 2;
const KIND_CUT: i32 = 3;

impl ClaimRow {
    fn into_message(self) -> Result<OutboxMessage, StoreError> {
        // PostgreSQL wrote this text from a jsonb value; the check is a scan, not a parse tree.
        let payload = serde_json::value::RawValue::from_string(self.payload)
            .map_err(|e| StoreError::Query(diesel::result::Error::DeserializationError(Box::new(e))))?;
        Ok(OutboxMessage {
            id: self.id,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            event_type: self.event_type,
            payload,
            created_at: self.created_at,
            attempts: self.attempts,
            lease_version: self.lease_version,
            lease_until: self.lease_until,
        })
    }
}
