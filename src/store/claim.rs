//! The claim: one short statement (and so one transaction) that leases a batch.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::pg::data_types::PgInterval;
use diesel::sql_types::{Array, BigInt, Bool, Int4, Int8, Interval, Nullable, Text, Timestamptz};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager};

use super::cursor::{Cursor, Snapshot, Taken};
use super::pool::{in_transaction_set, through_indexes};
use super::prepared::{Prepared, prepared};
use super::sql::{CLAIM_FIFO_SQL, CLAIM_FIFO_TYPES_SQL, CLAIM_SQL, EXPLAIN, EXPLAIN_ANALYZE, RELEASE_UNANSWERED_SQL};
use crate::config::Fifo;
use crate::error::StoreError;
use crate::model::OutboxMessage;

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
    /// Rows whose lease expired at this many attempts are left to the sweep, which reaps them,
    /// instead of being claimed again.
    pub max_attempts: i32,
    /// The per-aggregate gate: which rows wait for the earlier rows of their aggregate.
    pub fifo: &'a Fifo,
    /// The dispatcher's cursor over new rows (one claim of a dispatcher at a time holds it). The
    /// claim returns what it did with the cursor's rows ([`Claim::cursor`]) for
    /// [`Cursor::advance`]. `None`, for tools and tests: every new row from the oldest, as a
    /// cursor at its start would, and nothing to move on.
    pub cursor: Option<&'a Cursor>,
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
/// when the other parts of the claim came back short).
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

/// What one claim did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// Rows leased to the caller, in id order.
    pub messages: Vec<OutboxMessage>,
    /// Where the scan of aggregates stopped, for [`ClaimParams::heads_after`].
    pub heads: HeadsScan,
    /// Claimable rows left for a later claim because they did not fit in
    /// [`ClaimParams::max_bytes`]: the backlog goes on even though the claim took fewer rows
    /// than the batch.
    pub cut_by_budget: usize,
    /// New rows the FIFO gate held back, moved to wait in `outbox_later` (due at once) so that
    /// the cursor can pass them.
    pub evicted: usize,
    /// When the claim held the cursor: the snapshot its statement ran on and what it did with
    /// the cursor's rows, for [`Cursor::advance`].
    pub cursor: Option<(Snapshot, Taken)>,
}

/// How the claim is planned, set for its own transaction: once per connection, for any values
/// (`force_generic_plan`), through indexes only (`enable_seqscan = off`), never compiled (`jit =
/// off`).
///
/// Planning the claim, a statement of a dozen parts, cost PostgreSQL twice what running it did
/// (0.54 ms against 0.34 ms for a claim of 23 rows, `pg_stat_statements`, 2,000 rows a second);
/// the plan made once is the one every run needs, because each part of the statement is an
/// ordered scan of its index that stops at the batch, whatever the values and the statistics
/// (`claim_sql!`, and the test `the_claims_plan_reads_both_indexes_in_order_whatever_the_statistics`).
/// Without `enable_seqscan = off` a plan made while the table was small would read it whole and
/// go on doing so once it is large; with it, no plan of the claim reads the table but through an
/// index. The settings end with the claim's transaction: the producers' statements on the same
/// connections keep the pool's (custom plans, see `pool.rs`).
pub(crate) const CLAIM_PLANNING: &str =
    "SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off; SET LOCAL jit = off";

/// Leases up to `batch` rows: rows that wait in `outbox_later` and are due (pending ones past
/// their `available_at`, and processing ones whose lease expired with attempts left), then the
/// new rows after the dispatcher's [`Cursor`]. Every leased row gets
/// `lease_version + 1` and `attempts + 1`; rows other claims hold locked are skipped.
///
/// No index the claim reads names a column that the claim or a finalize changes: each update is
/// HOT (written beside the row, no index entry), and no claim steps over the entries of rows
/// that left the state it looks for, however long vacuum is held off. See `cursor.rs` for how
/// new rows are found in commit order.
///
/// It runs in a transaction of its own that sets `plan_cache_mode = force_generic_plan`,
/// `enable_seqscan = off` and `jit = off` for it: on a pooled connection the statement is planned
/// once, for any values, every part an ordered index scan whatever the statistics (planning it
/// cost more than running it).
///
/// With [`ClaimParams::fifo`] on, every candidate must also have no earlier unfinished row of
/// its aggregate (a `NOT EXISTS` probe of `outbox_fifo_gate` per candidate; see [`Fifo`] for
/// the rule). The gate reads committed rows only, and `done` is final, so a row that passes it
/// has every gated predecessor finished for good: the gate holds across concurrent claims,
/// processes and lease takeovers without any lock beyond the claimed rows.
pub async fn claim(conn: &mut AsyncPgConnection, params: &ClaimParams<'_>) -> Result<Claim, StoreError> {
    let query = claim_query(claim_sql(params.fifo), params)?;
    let rows: Vec<ClaimRow> = in_transaction_set(conn, CLAIM_PLANNING, async |conn| query.load(conn).await).await?;
    let mut claim = Claim::default();
    let mut taken = Taken::default();
    let mut snapshot = None;
    for row in rows {
        match row.kind {
            KIND_EVICTED => {
                claim.evicted += 1;
                taken.push(row.part, row.txid.as_deref(), row.id)?;
            }
            KIND_HEADS_END => {
                claim.heads = match row.bounded {
                    Some(true) => HeadsScan::StoppedAfter(AggregateKey {
                        aggregate_type: row.aggregate_type,
                        aggregate_id: row.aggregate_id,
                    }),
                    _ => HeadsScan::ReachedEnd,
                };
            }
            KIND_FOUND => {
                let count = |n: Option<i64>| usize::try_from(n.unwrap_or_default()).unwrap_or_default();
                taken.found = count(row.fresh_found);
                taken.wanted = count(row.fresh_wanted);
                taken.cut = count(row.fresh_cut);
                claim.cut_by_budget = count(row.cut);
                snapshot = row.snapshot.as_deref().map(Snapshot::parse).transpose().map_err(bad_row)?;
            }
            _ => {
                taken.push(row.part, row.txid.as_deref(), row.id)?;
                claim.messages.push(row.into_message()?);
            }
        }
    }
    if params.cursor.is_some() {
        let snapshot = snapshot.ok_or_else(|| bad_row("the claim returned no snapshot"))?;
        claim.cursor = Some((snapshot, taken));
    }
    // RETURNING order is unspecified.
    claim.messages.sort_by_key(|m| m.id);
    Ok(claim)
}

impl Taken {
    /// Records a row of the cursor's that the claim took or moved (`part` 1: late, 2: next).
    fn push(&mut self, part: Option<i32>, txid: Option<&str>, id: i64) -> Result<(), StoreError> {
        let list = match part {
            Some(PART_LATE) => &mut self.late,
            Some(PART_NEXT) => &mut self.next,
            _ => return Ok(()),
        };
        let txid = txid.ok_or_else(|| bad_row("a new row without its txid"))?;
        list.push((txid.parse().map_err(|_| bad_row(format!("not a transaction id: {txid:?}")))?, id));
        Ok(())
    }
}

fn bad_row(e: impl std::fmt::Display) -> StoreError {
    StoreError::Query(diesel::result::Error::DeserializationError(e.to_string().into()))
}

/// Hands back to `pending` the rows a claim of `owner` leased but whose answer never reached
/// it, and returns their ids: every row still `processing` under `owner` whose id is not in
/// `in_flight` (the rows that worker is publishing). Their claim's attempt is refunded, their
/// `lease_version` moves on, so no write of that lost claim can land, and they wait in
/// `outbox_later`, due at once, where the next claim finds them.
///
/// A claim statement whose connection breaks after it was sent may have committed: its rows
/// are leased, and nobody will publish them until the lease expires. The claim actor runs this
/// before its next claim after such a failure. `owner` names one worker of one process (see
/// [`DispatcherConfig::worker_owner`](crate::DispatcherConfig::worker_owner)), so only that
/// worker's rows match, and a row another worker reclaimed after its lease expired, or the
/// sweep sent dead, no longer does. The rows a claim can lease are either new ones, which lie
/// after the outbox's horizon (the sweep moves it past a row only once it is finished), or due
/// waiting ones: the statement reads those two sets, not the history.
pub async fn release_unanswered(
    conn: &mut AsyncPgConnection,
    owner: &str,
    in_flight: &[i64],
) -> Result<Vec<i64>, StoreError> {
    #[derive(QueryableByName)]
    struct Released {
        #[diesel(sql_type = Int8)]
        id: i64,
    }
    let rows: Vec<Released> = through_indexes(conn, async |conn| {
        diesel::sql_query(RELEASE_UNANSWERED_SQL)
            .bind::<Text, _>(owner)
            .bind::<Array<Int8>, _>(in_flight)
            .load(conn)
            .await
    })
    .await?;
    Ok(rows.into_iter().map(|r| r.id).collect())
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
///     cursor: None,
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
    let lines: Result<Vec<PlanLine>, _> = claim_query(&sql, params)?.load(conn).await;
    if analyze {
        AnsiTransactionManager::rollback_transaction(conn).await?;
    }
    Ok(lines?.into_iter().map(|l| l.line).collect())
}

/// The plan the claim under `fifo` runs with (planned once per connection for any values, through
/// indexes only: see [`claim`]), one line per row of `EXPLAIN` output. Nothing runs: the statement is prepared under a name of its own, explained
/// and deallocated, in a transaction that is rolled back.
pub async fn claim_plan(conn: &mut AsyncPgConnection, fifo: &Fifo) -> Result<Vec<String>, StoreError> {
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let (gate_type, gate_value) = match fifo {
        Fifo::EventTypes(_) => ("text[]", "'{}'"),
        Fifo::All | Fifo::Off => ("text", "NULL"),
    };
    AnsiTransactionManager::begin_transaction(conn).await?;
    let plan = async {
        conn.batch_execute(CLAIM_PLANNING).await?;
        conn.batch_execute(&format!(
            "PREPARE actix_outbox_claim_plan(text, int8, interval, int4, text[], int8[], text, int8, int8, timestamptz, \
             {gate_type}, text) AS {}",
            claim_sql(fifo)
        ))
        .await?;
        let lines: Vec<PlanLine> = diesel::sql_query(format!(
            "EXPLAIN EXECUTE actix_outbox_claim_plan('explain', 200, '60s', 12, '{{}}', '{{}}', '3', 0, \
             9223372036854775807, '1970-01-01', {gate_value}, NULL)"
        ))
        .load(conn)
        .await?;
        conn.batch_execute("DEALLOCATE actix_outbox_claim_plan").await?;
        Ok::<_, StoreError>(lines.into_iter().map(|l| l.line).collect())
    }
    .await;
    AnsiTransactionManager::rollback_transaction(conn).await?;
    plan
}

fn claim_sql(fifo: &Fifo) -> &'static str {
    match fifo {
        Fifo::Off => CLAIM_SQL,
        Fifo::All => CLAIM_FIFO_SQL,
        Fifo::EventTypes(_) => CLAIM_FIFO_TYPES_SQL,
    }
}

fn claim_query<'a>(sql: &'a str, params: &'a ClaimParams<'a>) -> Result<Prepared<'a>, StoreError> {
    let origin = Cursor::at(Snapshot::origin());
    let cursor = params.cursor.unwrap_or(&origin);
    let (late_txids, late_after): (Vec<String>, Vec<i64>) = cursor.late().map(|(t, id)| (t.to_string(), id)).unzip();
    let (from_txid, from_id) = cursor.from();
    let query = prepared(sql)
        .bind::<Text, _>(params.owner)
        .bind::<BigInt, _>(i64::try_from(params.batch).unwrap_or(i64::MAX))
        .bind::<Interval, _>(interval(params.lease))
        .bind::<Int4, _>(params.max_attempts)
        .bind::<Array<Text>, _>(late_txids)
        .bind::<Array<Int8>, _>(late_after)
        .bind::<Text, _>(from_txid.to_string())
        .bind::<BigInt, _>(from_id)
        .bind::<BigInt, _>(i64::try_from(params.max_bytes).unwrap_or(i64::MAX))
        .bind::<Timestamptz, _>(DateTime::<Utc>::UNIX_EPOCH);
    // $11 and $12 depend on the gate: the gated event types, or the aggregate after which the
    // scan of heads starts. A statement that does not use them binds placeholders that never
    // reach the text.
    let no_text = None::<String>;
    Ok(match params.fifo {
        Fifo::EventTypes(types) => query.bind::<Array<Text>, _>(types.clone()).bind::<Nullable<Text>, _>(no_text),
        Fifo::All => query
            .bind::<Nullable<Text>, _>(params.heads_after.map(|k| k.aggregate_type.clone()))
            .bind::<Nullable<Text>, _>(params.heads_after.map(|k| k.aggregate_id.clone())),
        Fifo::Off => query.bind::<Nullable<Text>, _>(no_text.clone()).bind::<Nullable<Text>, _>(no_text),
    })
}

pub(crate) fn interval(d: Duration) -> PgInterval {
    PgInterval::from_microseconds(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

#[derive(QueryableByName)]
struct ClaimRow {
    /// 0: a claimed row; `KIND_EVICTED`; `KIND_HEADS_END`; `KIND_FOUND`.
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
    /// The `headers` column's JSON text (`headers::text`; NULL when the column is).
    #[diesel(sql_type = Nullable<Text>)]
    headers: Option<String>,
    /// Where a claimed or evicted row came from: 0 later, 1 late, 2 next, 3 heads.
    #[diesel(sql_type = Nullable<Int4>)]
    part: Option<i32>,
    /// Its `txid`, for rows of the cursor.
    #[diesel(sql_type = Nullable<Text>)]
    txid: Option<String>,
    /// For the heads-scan row: whether the scan stopped at its bound (else it reached the end).
    #[diesel(sql_type = Nullable<Bool>)]
    bounded: Option<bool>,
    #[diesel(sql_type = Nullable<Int8>)]
    fresh_found: Option<i64>,
    #[diesel(sql_type = Nullable<Int8>)]
    fresh_wanted: Option<i64>,
    #[diesel(sql_type = Nullable<Int8>)]
    fresh_cut: Option<i64>,
    #[diesel(sql_type = Nullable<Int8>)]
    cut: Option<i64>,
    /// The statement's snapshot, on the `KIND_FOUND` row.
    #[diesel(sql_type = Nullable<Text>)]
    snapshot: Option<String>,
}

const KIND_EVICTED: i32 = 1;
const KIND_HEADS_END: i32 = 2;
const KIND_FOUND: i32 = 3;
const PART_LATE: i32 = 1;
const PART_NEXT: i32 = 2;

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

#[cfg(test)]
mod tests {
    #[test]
    #[ignore = "prints the claim statements"]
    fn print_claim_statements() {
        println!("{}\n----\n{}\n----\n{}", super::CLAIM_SQL, super::CLAIM_FIFO_SQL, super::CLAIM_FIFO_TYPES_SQL);
    }
}
