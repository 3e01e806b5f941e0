//! Every statement of the store that is SQL text rather than Diesel's query builder, and why.
//!
//! The rest of the store names the table and its columns only through
//! [`crate::schema::outbox`], so renaming a column, changing its type or misspelling a status
//! fails the build. The text here is checked by nothing but a run: the integration tests run
//! every statement of this module against a migrated database. Text stays where the DSL cannot
//! say what the statement does, or cannot say it at the same cost:
//!
//! - the claim ([`CLAIM_SQL`] and its gated variants): data-modifying CTEs, `FOR UPDATE SKIP
//!   LOCKED` inside them, `UNION ALL` of rows of different origins, a recursive skip scan over
//!   aggregates and `LATERAL` joins; and `EXPLAIN` of it, for operators;
//! - the dead heads of blocked aggregates ([`BLOCKED_SQL`], [`BLOCKED_COUNT_SQL`]): subqueries
//!   of the table correlated with itself (`prev` and `w` against `d`), and one `FROM ... WHERE`
//!   shared by the list and the count so that they cannot disagree;
//! - the table sample of `stats` and of the dispatcher's gauges ([`SAMPLE_SQL`],
//!   [`SAMPLE_UNFINISHED_SQL`]): every count in one pass with aggregate `FILTER` clauses, a
//!   statistics function for the estimate of `done` rows, and the age of the oldest unfinished row as
//!   `extract(epoch FROM ...)` of a difference of timestamps, on the database clock;
//! - the producer's advisory lock ([`LOCK_AGGREGATE_SQL`]): a function returning `void`;
//! - the outbox's default source name ([`SOURCE_SQL`]) and the schemas that hold an outbox
//!   ([`OUTBOX_SCHEMAS_SQL`]): catalog and control functions.
//!
//! Statuses are spelled here as SQL literals; everywhere else in the crate's Rust code they are
//! [`Status`](crate::admin::Status) values. The fenced writes after a claim are built with the DSL
//! and two typed expressions of their own (see `fence.rs`), which add keywords and functions
//! but no column name. Connection setup and database creation stay beside the pool in
//! `store/mod.rs`; they do not touch the outbox table.
//!
//! The claim runs through [`Prepared`](super::prepared::Prepared) (prepared once per
//! connection); the others through `diesel::sql_query`.

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
    -- The payload is rendered as text once, here: measured for the budget, returned as is.
    SELECT c.id, c.from_ready, o.payload::text AS body
    FROM (SELECT id, false AS from_ready FROM expired UNION ALL SELECT id, true FROM ready) AS c
    JOIN outbox AS o ON o.id = c.id
    ORDER BY c.id
    LIMIT $2
), picked AS (
    SELECT id, from_ready, body
    FROM (SELECT id, from_ready, body, octet_length(body) AS bytes,
                 sum(octet_length(body)) OVER (ORDER BY id) - octet_length(body) AS before
          FROM candidates) AS w
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
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, picked.body AS payload, o.created_at,
              o.attempts, o.lease_version, o.lease_until,
              CASE WHEN picked.from_ready THEN o.available_at END AS ready_at,
              o.headers::text AS headers
)
SELECT 0 AS kind, id, aggregate_type, aggregate_id, event_type, payload, created_at,
       attempts, lease_version, lease_until, ready_at, NULL::bool AS heads_bounded, headers
FROM claimed
UNION ALL
SELECT 1, id, '', '', '', 'null', now(), 0, lease_version, NULL, NULL, NULL, NULL
FROM reaped
UNION ALL
SELECT 3, cut, '', '', '', 'null', now(), 0, 0, NULL, NULL, NULL, NULL
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
pub(super) const CLAIM_SQL: &str = claim_sql!("");

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
///   pending. It starts after [`ClaimParams::heads_after`](super::ClaimParams::heads_after) and stops after `4 × batch`
///   aggregates ([`Claim::heads`](super::Claim::heads) says where), so its cost is bounded however many aggregates
///   there are, and successive claims take turns over all of them.
///
/// A walk of rows alone degrades when the free heads are fewer than the batch (few aggregates,
/// or every aggregate's head in flight): it then walks every pending row, a probe each, to find
/// them: about a second per claim at 100,000 pending rows in 1,000 aggregates, against 22–27 ms
/// for both parts; 25 ms with one aggregate's 1,000 rows ahead of 10,000 others (`EXPLAIN
/// ANALYZE`, batch 200). The resume position does not apply: a walk passes over
/// blocked rows, and a hint would hide them once they are unblocked.
pub(super) const CLAIM_FIFO_SQL: &str = claim_sql!(
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
       bounded, NULL
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
pub(super) const CLAIM_FIFO_TYPES_SQL: &str = claim_sql!(
    r#"
      AND (o.event_type <> ALL($7) OR NOT EXISTS (
          SELECT 1 FROM outbox AS prev
          WHERE prev.aggregate_type = o.aggregate_type AND prev.aggregate_id = o.aggregate_id
            AND prev.id < o.id AND prev.status IN ('pending', 'processing', 'dead')
            AND prev.event_type = ANY($7)))"#
);

/// `FROM ... WHERE` selecting the dead heads of blocked aggregates, as `d`: shared, as text, by
/// the list and the count so that they cannot disagree on what "blocked" means. `$1` is the
/// gated event types (NULL: all). Every probe is a range of the partial index
/// `outbox_fifo_gate (aggregate_type, aggregate_id, id)`, which holds only unfinished rows.
macro_rules! blocked_heads {
    () => {
        r#"
FROM outbox AS d
WHERE d.status = 'dead'
  AND ($1::text[] IS NULL OR d.event_type = ANY($1))
  AND NOT EXISTS (
      SELECT 1 FROM outbox AS prev
      WHERE prev.aggregate_type = d.aggregate_type AND prev.aggregate_id = d.aggregate_id
        AND prev.id < d.id AND prev.status IN ('pending', 'processing', 'dead')
        AND ($1::text[] IS NULL OR prev.event_type = ANY($1)))
"#
    };
}

/// Put before a claim statement by [`super::explain_claim`]: its plan, without running it.
pub(super) const EXPLAIN: &str = "EXPLAIN (COSTS) ";

/// Put before a claim statement by [`super::explain_claim`]: its plan, run and timed.
pub(super) const EXPLAIN_ANALYZE: &str = "EXPLAIN (ANALYZE, BUFFERS) ";

/// The aggregates blocked by a dead head ([`super::blocked_aggregates`]). $1 the gated event
/// types (NULL: all), $2 limit.
pub(super) const BLOCKED_SQL: &str = concat!(
    r#"
SELECT d.aggregate_type, d.aggregate_id, d.id AS dead_id, d.event_type, d.last_error, d.attempts, d.created_at,
       (SELECT count(*) FROM outbox AS w
        WHERE w.aggregate_type = d.aggregate_type AND w.aggregate_id = d.aggregate_id
          AND w.id > d.id AND w.status IN ('pending', 'processing', 'dead')
          AND ($1::text[] IS NULL OR w.event_type = ANY($1))) AS waiting"#,
    blocked_heads!(),
    "ORDER BY d.id\nLIMIT $2\n"
);

/// How many aggregates [`BLOCKED_SQL`] would list without a limit. $1 the gated event types
/// (NULL: all).
pub(super) const BLOCKED_COUNT_SQL: &str = concat!("\nSELECT count(*) AS n", blocked_heads!());

/// The producer's per-aggregate lock ([`super::lock_aggregate`]). $1 aggregate_type, $2
/// aggregate_id.
pub(super) const LOCK_AGGREGATE_SQL: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1 || ':' || $2, 0))";

/// For `stats` ([`super::sample`]): rows per status, the age in seconds of the oldest pending or
/// processing row (NULL when none) and the count of processing rows whose lease ran out, in one
/// pass over the table, on the database clock. Exact, so it reads every row, history included.
pub(super) const SAMPLE_SQL: &str = "
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'processing') AS processing,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE status IN ('pending', 'processing')))::float8
           AS oldest,
       count(*) FILTER (WHERE status = 'processing' AND lease_until < now()) AS expired
FROM outbox";

/// The same for the dispatcher's gauges ([`super::sample_unfinished`]), every few seconds: it
/// reads only the unfinished rows, one status at a time through that status's partial index
/// (`outbox_ready`, `outbox_leased`, `outbox_dead`), so its cost follows the backlog, not the
/// history. The `done` count is the statistics collector's estimate of the table's live rows
/// less the unfinished ones (0 rather than negative).
pub(super) const SAMPLE_UNFINISHED_SQL: &str = "
SELECT pending, processing, dead, extract(epoch FROM now() - least(p.oldest, l.oldest))::float8 AS oldest, expired,
       greatest(pg_stat_get_live_tuples('outbox'::regclass) - pending - processing - dead, 0) AS done
FROM (SELECT count(*) AS pending, min(created_at) AS oldest FROM outbox WHERE status = 'pending') AS p,
     (SELECT count(*) AS processing, min(created_at) AS oldest,
             count(*) FILTER (WHERE lease_until < now()) AS expired
      FROM outbox WHERE status = 'processing') AS l,
     (SELECT count(*) AS dead FROM outbox WHERE status = 'dead') AS d";

/// Whether the FIFO gate's index exists, and is valid (a `CREATE INDEX CONCURRENTLY` that
/// failed leaves an invalid one behind): one row, `NULL` when there is none.
pub(super) const FIFO_INDEX_STATE_SQL: &str = "
SELECT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('outbox_fifo_gate')) AS valid";

/// The session lock a builder of the FIFO gate's index holds, so that two dispatchers starting
/// at once build it once ("outbox-fifo-index" hashed; tried, never waited for in the database).
pub(super) const FIFO_INDEX_TRY_LOCK_SQL: &str =
    "SELECT pg_try_advisory_lock(hashtextextended('actix-outbox:fifo-index', 0)) AS locked";
pub(super) const FIFO_INDEX_UNLOCK_SQL: &str =
    "SELECT pg_advisory_unlock(hashtextextended('actix-outbox:fifo-index', 0)) AS locked";

/// Drops an invalid index a failed build left behind.
pub(super) const FIFO_INDEX_DROP_SQL: &str = "DROP INDEX CONCURRENTLY IF EXISTS outbox_fifo_gate";

/// The FIFO gate's index: "is there an earlier unfinished row of this aggregate?" in one range
/// probe, and the skip scan over aggregates with unfinished rows. Its predicate is exactly the
/// gate's status list, so it holds only unfinished rows however long the history. Built without
/// blocking writers, so a build on a big table takes a while (one pass over the table).
pub(super) const FIFO_INDEX_CREATE_SQL: &str = "
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_fifo_gate ON outbox (aggregate_type, aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'dead')";

/// What the outbox's default source name ([`super::outbox_source`]) is made of, in one row:
/// the cluster's system identifier (NULL where the role may not call `pg_control_system()`, so
/// that the statement cannot fail inside a caller's transaction), the database, and the
/// schema-qualified table (NULL when there is no `outbox` table: an unmigrated database).
pub(super) const SOURCE_SQL: &str = "
SELECT CASE WHEN has_function_privilege('pg_control_system()', 'EXECUTE')
            THEN (SELECT system_identifier::text FROM pg_control_system()) END AS system_identifier,
       current_database() AS database,
       (SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = to_regclass('outbox')) AS table_name";

/// The schemas whose name is `LIKE $1` and that hold a table `outbox`, by name.
pub(super) const OUTBOX_SCHEMAS_SQL: &str = "
SELECT n.nspname AS name FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid
WHERE c.relname = 'outbox' AND c.relkind IN ('r', 'p') AND n.nspname LIKE $1
ORDER BY n.nspname";

/// Opens a transaction that the server ends by itself (terminating the session, which releases
/// its locks) once it has waited longer than the number of milliseconds appended for the client's
/// next statement: a client whose link went silent mid-transaction cannot hold its row locks for
/// ever. `SET LOCAL` lasts as long as the transaction, so it works through a transaction pooler.
pub(super) const BEGIN_IDLE_BOUNDED: &str = "BEGIN; SET LOCAL idle_in_transaction_session_timeout = ";
