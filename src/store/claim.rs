//! The claim: one short statement (and so one transaction) that reaps, then leases a batch.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::pg::data_types::PgInterval;
use diesel::sql_types::{Array, BigInt, Bool, Int4, Int8, Interval, Nullable, Text, Timestamptz};
use diesel::{ExpressionMethods, QueryableByName};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

use super::fence::processing;
use super::prepared::{Prepared, prepared};
use super::sql::{CLAIM_FIFO_SQL, CLAIM_FIFO_TYPES_SQL, CLAIM_SQL, EXPLAIN, EXPLAIN_ANALYZE};
use crate::config::Fifo;
use crate::error::StoreError;
use crate::model::{Fence, OutboxMessage, Status};
use crate::schema::outbox;

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

/// Hands back to `pending` the rows a claim of `owner` leased but whose answer never reached
/// it, and returns their ids: every row still `processing` under `owner` whose id is not in
/// `in_flight` (the rows that worker is publishing). Their claim's attempt is refunded and
/// their `lease_version` moves on, so no write of that lost claim can land; their
/// `available_at` is untouched, so they keep their place in the claim order.
///
/// A claim statement whose connection breaks after it was sent may have committed: its rows
/// are leased, and nobody will publish them until the lease expires. The claim actor runs this
/// before its next claim after such a failure. `owner` names one worker of one process (see
/// [`DispatcherConfig::worker_owner`](crate::DispatcherConfig::worker_owner)), so only that
/// worker's rows match, and a row another worker reclaimed after its lease expired, or the
/// reaper sent dead, no longer does.
pub async fn release_unanswered(
    conn: &mut AsyncPgConnection,
    owner: &str,
    in_flight: &[i64],
) -> Result<Vec<i64>, StoreError> {
    Ok(diesel::update(outbox::table)
        .filter(processing())
        .filter(outbox::lease_owner.eq(owner))
        .filter(outbox::id.ne_all(in_flight))
        .set((
            outbox::status.eq(Status::Pending),
            outbox::lease_version.eq(outbox::lease_version + 1),
            outbox::attempts.eq(outbox::attempts - 1),
            outbox::lease_owner.eq(None::<String>),
            outbox::lease_until.eq(None::<DateTime<Utc>>),
        ))
        .returning(outbox::id)
        .get_results(conn)
        .await?)
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
/// use actix_outbox::testing::{ClaimParams, explain_claim};
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
    let explain = if analyze { EXPLAIN_ANALYZE } else { EXPLAIN };
    let sql = format!("{explain}{}", claim_sql(params.fifo));
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
    /// The `headers` column's JSON text (`headers::text`; NULL when the column is).
    #[diesel(sql_type = Nullable<Text>)]
    headers: Option<String>,
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
            headers: crate::model::headers_from_json(self.headers.as_deref()),
            // The dispatcher stamps its own.
            source: crate::model::no_source(),
        })
    }
}
