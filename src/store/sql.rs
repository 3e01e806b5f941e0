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
//!   ([`OUTBOX_SCHEMAS_SQL`]): catalog and control functions;
//! - with the `testkit` feature, the server's clock in seconds and the test databases left
//!   behind ([`SERVER_SECONDS_SQL`], [`STALE_TEST_DATABASES_SQL`]): the shared catalogs.
//!
//! Statuses are spelled here as SQL literals; everywhere else in the crate's Rust code they are
//! [`Status`](crate::admin::Status) values. The fenced writes after a claim are built with the DSL
//! and two typed expressions of their own (see `fence.rs`), which add keywords and functions
//! but no column name. Connection setup and database creation stay beside the pool in
//! `store/mod.rs`; they do not touch the outbox table.
//!
//! The claim runs through [`Prepared`](super::prepared::Prepared) (prepared once per
//! connection); the others through `diesel::sql_query`.

// The claim statement, assembled from parts. Each candidate comes from one of:
//
// - `later` (part 0): rows that wait in `outbox_later` (`available_at > created_at`) and are due:
//   pending ones, and processing ones whose lease ran out with attempts left (their worker died
//   or stalled: the sweep moved them here, or they were claimed from here);
// - `late` (part 1): rows of the transactions the cursor still probes ($5, each with the last id
//   of it passed, $6), by `(txid, id)`;
// - `next` (part 2): rows of later transactions in `(txid, id)` order after $7/$8, through
//   `outbox_txid`. The upper bound (the statement's own snapshot's `xmax`, beyond which nothing is
//   visible anyway) makes both ends of the range expressions, so that the plan PostgreSQL keeps
//   for the prepared statement is an ordered index scan whatever the statistics say (with one
//   end open it may pick a bitmap scan and a sort of everything after the cursor);
// - `heads` (part 3, under `Fifo::All` only, when the others came back short): see
//   `CLAIM_FIFO_SQL`.
//
// $1 owner, $2 batch, $3 lease, $4 max_attempts, $5/$6 the late transactions and their last
// ids, $7/$8 the position after which `next` starts, $9 the byte budget, $10 the lower bound of
// `later` (1970, before any row: a bound that is a parameter keeps its plan an ordered index scan,
// as for `next`), then $11/$12 per gate (see each statement).
//
// Statuses are tested as `status IS NOT DISTINCT FROM 'pending'` (the same test: `status` is never
// NULL) so that the planner cannot answer them from the FIFO gate's partial index, whose
// predicate they would imply: the plan is made once per connection, and with statistics taken
// when no row was unfinished it would scan that index whole, and sort, on every claim after.
//
// `picked` takes the candidates that pass the gate in (part, txid, id) order while their
// payloads (as JSON text) fit in $9, and the first whatever its size. Under the gate, a row of
// the cursor that does not pass it is moved to `outbox_later` (`evicted`), due at once, so that
// the cursor can pass it and the later part finds it once its aggregate's earlier rows are done;
// none is moved when the budget left a row out (the cursor stays before that row anyway).
//
// Each result row is claimed (kind 0), evicted (1), where the heads scan ended (2) or, once,
// what the claim found (3): `fresh_found` (late + next, locked for it), `fresh_wanted`,
// `fresh_cut` (of those, passing the gate but left out by the budget), `cut` (the same over
// every part) and the statement's snapshot.
macro_rules! claim_sql {
    (gate: $gate:tt, later_bound: $later_bound:tt, heads: $heads:tt, heads_tail: $heads_tail:tt) => {
        concat!(
            r#"
WITH "#,
            $later_bound,
            r#"later AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS body FROM outbox AS o
    WHERE o.available_at > o.created_at AND o.available_at > $10 AND o.available_at <= now()
      AND (o.status IS NOT DISTINCT FROM 'pending'
           OR (o.status IS NOT DISTINCT FROM 'processing' AND o.lease_until < now() AND o.attempts < $4))"#,
            later_window!($later_bound),
            "\n      AND ",
            $gate,
            r#"
    ORDER BY o.available_at, o.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), late AS (
    SELECT f.id, f.txid, f.aggregate_type, f.aggregate_id, f.event_type, f.body
    FROM unnest($5::text[]::xid8[], $6::int8[]) AS l(txid, after)
    CROSS JOIN LATERAL (
        SELECT o.id, o.txid, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS body FROM outbox AS o
        WHERE o.txid = l.txid AND (o.txid, o.id) > (l.txid, l.after)
          AND o.available_at <= o.created_at AND o.status IS NOT DISTINCT FROM 'pending'
        ORDER BY o.txid, o.id
        LIMIT $2
        FOR UPDATE SKIP LOCKED) AS f
    ORDER BY f.txid, f.id
    LIMIT $2 - (SELECT count(*) FROM later)
), next AS (
    SELECT o.id, o.txid, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS body FROM outbox AS o
    WHERE o.txid >= $7::xid8 AND o.txid < pg_snapshot_xmax(pg_current_snapshot())
      AND (o.txid, o.id) > ($7::xid8, $8)
      AND o.available_at <= o.created_at AND o.status IS NOT DISTINCT FROM 'pending'
    ORDER BY o.txid, o.id
    LIMIT $2 - (SELECT count(*) FROM later) - (SELECT count(*) FROM late)
    FOR UPDATE SKIP LOCKED
), candidates AS (
    SELECT o.id, o.part, o.txid, o.body, o.part = 0 OR "#,
            gate_on!($gate),
            r#" AS open
    FROM (SELECT id, 0 AS part, NULL::xid8 AS txid, aggregate_type, aggregate_id, event_type, body FROM later
          UNION ALL SELECT id, 1, txid, aggregate_type, aggregate_id, event_type, body FROM late
          UNION ALL SELECT id, 2, txid, aggregate_type, aggregate_id, event_type, body FROM next) AS o
), "#,
            $heads,
            r#"picked AS (
    SELECT id, part, txid, body
    FROM (SELECT id, part, txid, body, octet_length(body) AS bytes,
                 sum(octet_length(body)) OVER (ORDER BY part, txid, id) - octet_length(body) AS before
          FROM (SELECT id, part, txid, body FROM candidates WHERE open"#,
            heads_rows!($heads),
            r#") AS o) AS w
    WHERE before = 0 OR before + bytes <= $9
), "#,
            evicted!($gate),
            r#"claimed AS (
    UPDATE outbox AS o
    SET status = 'processing',
        lease_owner = $1,
        lease_until = now() + $3,
        lease_version = o.lease_version + 1,
        attempts = o.attempts + 1
    FROM picked
    WHERE o.id = picked.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, picked.body AS payload, o.created_at,
              o.attempts, o.lease_version, o.lease_until, o.headers::text AS headers, picked.part, picked.txid
)
SELECT 0 AS kind, id, aggregate_type, aggregate_id, event_type, payload, created_at, attempts, lease_version,
       lease_until, headers, part, txid::text AS txid, NULL::bool AS bounded,
       NULL::int8 AS fresh_found, NULL::int8 AS fresh_wanted, NULL::int8 AS fresh_cut, NULL::int8 AS cut,
       NULL::text AS snapshot
FROM claimed
"#,
            evicted_rows!($gate),
            r#"
UNION ALL
SELECT 3, 0, '', '', '', 'null', now(), 0, 0, NULL, NULL, NULL, NULL, NULL,
       (SELECT count(*) FROM late) + (SELECT count(*) FROM next),
       $2 - (SELECT count(*) FROM later),
       (SELECT count(*) FROM candidates WHERE open AND part > 0) - (SELECT count(*) FROM picked WHERE part > 0),
       (SELECT count(*) FROM candidates WHERE open)"#,
            heads_count!($heads),
            r#" - (SELECT count(*) FROM picked),
       pg_current_snapshot()::text"#,
            $heads_tail,
            "\n"
        )
    };
}

// The gate as a test of a candidate `c` (the rows of the cursor: late and next), or `true`.
macro_rules! gate_on {
    ("true") => {
        "true"
    };
    ($gate:tt) => {
        concat!("(", $gate, ")")
    };
}

// Under `Fifo::All`, `later` walks at most `4 × batch` due rows: the end of that window.
macro_rules! later_window {
    ("") => {
        ""
    };
    ($bound:tt) => {
        r#"
      AND (o.available_at, o.id) <= (coalesce((SELECT available_at FROM window_end), 'infinity'),
                                     coalesce((SELECT id FROM window_end), 9223372036854775807))"#
    };
}

// Under the gate, the cursor's rows that do not pass it move to `outbox_later` (see above).
macro_rules! evicted {
    ("true") => {
        ""
    };
    ($gate:tt) => {
        r#"evicted AS (
    UPDATE outbox AS o
    SET available_at = o.created_at + interval '1 microsecond'
    FROM candidates AS c
    WHERE o.id = c.id AND c.part > 0 AND NOT c.open
      AND NOT EXISTS (SELECT 1 FROM candidates AS k WHERE k.open AND k.part > 0 AND k.id NOT IN (SELECT id FROM picked))
    RETURNING o.id, c.part, c.txid
), "#
    };
}

// The rows `evicted` reports.
macro_rules! evicted_rows {
    ("true") => {
        ""
    };
    ($gate:tt) => {
        "
UNION ALL
SELECT 1, id, '', '', '', 'null', now(), 0, 0, NULL, NULL, part, txid::text, NULL, NULL, NULL, NULL, NULL, NULL
FROM evicted"
    };
}

// The heads scan's rows, counted among the candidates the budget may cut.
macro_rules! heads_count {
    ("") => {
        ""
    };
    ($heads:tt) => {
        " + (SELECT count(*) FROM heads_ready)"
    };
}

// The heads scan's rows among those `picked` takes from.
macro_rules! heads_rows {
    ("") => {
        ""
    };
    ($heads:tt) => {
        "\n                UNION ALL SELECT id, 3, NULL, body FROM heads_ready"
    };
}

/// No gate: any due or new row.
pub(super) const CLAIM_SQL: &str = claim_sql!(gate: "true", later_bound: "", heads: "", heads_tail: "");

/// Every row waits for the earlier unfinished rows of its aggregate: the probe is the first such
/// row in the order of `outbox_fifo_gate (aggregate_type, aggregate_id, id)`, whose predicate is
/// exactly the unfinished statuses (written as `ORDER BY ... LIMIT 1` rather than `NOT EXISTS`, so
/// that the plan made once per connection is a probe of that index whatever the statistics: with
/// every row in one aggregate, `NOT EXISTS` was planned as a scan of the table).
///
/// Candidates are found three ways, the third only when the first two come back short:
///
/// - `later`: the due rows that wait, each probed by the gate, within a window of the first
///   `4 × batch` of them (rows of a blocked aggregate wait here, and a walk of all of them on
///   every claim would grow with the blocked backlog);
/// - `late` and `next`: the cursor's new rows, each probed by the gate; those that do not pass
///   are moved to `outbox_later` (see `claim_sql!`);
/// - `heads`: a skip scan of `outbox_fifo_gate` that visits aggregates with unfinished rows in
///   key order, one index descent each, and takes each one's first unfinished row: claimable if
///   pending and due. It starts after [`ClaimParams::heads_after`](super::ClaimParams::heads_after)
///   ($11, $12) and stops after `4 × batch` aggregates ([`Claim::heads`](super::Claim::heads) says
///   where), so its cost is bounded however many aggregates there are, and successive claims take
///   turns over all of them.
pub(super) const CLAIM_FIFO_SQL: &str = claim_sql!(
    gate: "(SELECT prev.id FROM outbox AS prev WHERE prev.aggregate_type = o.aggregate_type AND prev.aggregate_id = o.aggregate_id AND prev.id < o.id AND prev.status IN ('pending', 'processing', 'dead') ORDER BY prev.aggregate_type, prev.aggregate_id, prev.id LIMIT 1) IS NULL",
    later_bound: r#"window_end AS (
    SELECT o.available_at, o.id FROM outbox AS o
    WHERE o.available_at > o.created_at AND o.available_at > $10 AND o.available_at <= now()
      AND (o.status IS NOT DISTINCT FROM 'pending'
           OR (o.status IS NOT DISTINCT FROM 'processing' AND o.lease_until < now() AND o.attempts < $4))
    ORDER BY o.available_at, o.id
    OFFSET $2 * 4 - 1
    LIMIT 1
), "#,
    heads: r#"heads AS (
    WITH RECURSIVE first_unfinished (aggregate_type, aggregate_id, id, step) AS (
        (SELECT aggregate_type, aggregate_id, id, 1 FROM outbox
         WHERE status IN ('pending', 'processing', 'dead')
           AND ($11::text IS NULL OR (aggregate_type, aggregate_id) > ($11, $12))
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
    SELECT * FROM first_unfinished WHERE (SELECT count(*) FROM candidates WHERE open) < $2
), heads_ready AS (
    SELECT o.id, o.payload::text AS body FROM heads AS h JOIN outbox AS o ON o.id = h.id
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND o.id NOT IN (SELECT id FROM candidates)
    ORDER BY o.available_at, o.id
    LIMIT (SELECT $2 - count(*) FROM candidates WHERE open)
    FOR UPDATE OF o SKIP LOCKED
), heads_end AS (
    SELECT last.aggregate_type, last.aggregate_id, coalesce(last.step >= $2 * 4, false) AS bounded
    FROM (SELECT 1) AS one
    LEFT JOIN LATERAL (SELECT * FROM heads ORDER BY step DESC LIMIT 1) AS last ON true
    WHERE (SELECT count(*) FROM candidates WHERE open) < $2
), "#,
    heads_tail: r#"
UNION ALL
SELECT 2, 0, coalesce(aggregate_type, ''), coalesce(aggregate_id, ''), '', 'null', now(), 0, 0, NULL, NULL, NULL,
       NULL, bounded, NULL, NULL, NULL, NULL, NULL
FROM heads_end"#
);

/// Rows of the types in $11 wait for the earlier unfinished rows of those types of their
/// aggregate; other rows pass without a probe. The `OR` keeps the probe a per-row subplan that
/// runs only for gated rows and stops at the first match; written as an anti-join with the
/// outer test inside, PostgreSQL evaluates that test as a join filter after the probe, and an
/// unlisted row behind a long backlog of its aggregate then walks the whole backlog.
///
/// This variant walks the due waiting rows without the bound and the skip scan of
/// [`CLAIM_FIFO_SQL`]: a bounded walk could leave unlisted rows (which never wait) stuck behind
/// a window of blocked listed ones. Its cost grows with the blocked rows of the listed types it
/// passes over.
pub(super) const CLAIM_FIFO_TYPES_SQL: &str = claim_sql!(
    gate: "(o.event_type <> ALL($11::text[]) OR (SELECT prev.id FROM outbox AS prev WHERE prev.aggregate_type = o.aggregate_type AND prev.aggregate_id = o.aggregate_id AND prev.id < o.id AND prev.status IN ('pending', 'processing', 'dead') AND prev.event_type = ANY($11::text[]) ORDER BY prev.aggregate_type, prev.aggregate_id, prev.id LIMIT 1) IS NULL)",
    later_bound: "",
    heads: "",
    heads_tail: ""
);

/// The rows a lost claim of worker $1 leased, but for those its publishes hold ($2), back to
/// pending (see [`super::release_unanswered`]): among the rows after the outbox's horizon (the
/// new rows, not yet all finished) and the due rows that wait, which are every row a claim can
/// have leased. They wait in `outbox_later`, due at once.
pub(super) const RELEASE_UNANSWERED_SQL: &str = "
UPDATE outbox SET status = 'pending', lease_version = lease_version + 1, attempts = attempts - 1,
                  lease_owner = NULL, lease_until = NULL,
                  available_at = greatest(now(), created_at + interval '1 microsecond')
WHERE id IN (SELECT o.id FROM outbox AS o
             WHERE o.txid >= (SELECT pg_snapshot_xmax(horizon) FROM outbox_horizon LIMIT 1)
               AND o.status = 'processing' AND o.lease_owner = $1 AND o.id <> ALL($2)
             UNION ALL
             SELECT o.id
             FROM (SELECT horizon FROM outbox_horizon LIMIT 1) AS h
             CROSS JOIN LATERAL pg_snapshot_xip(h.horizon) AS x(txid)
             CROSS JOIN LATERAL (SELECT id FROM outbox
                                 WHERE txid = x.txid AND status = 'processing' AND lease_owner = $1
                                   AND id <> ALL($2)
                                 OFFSET 0) AS o
             UNION ALL
             SELECT o.id FROM outbox AS o
             WHERE o.available_at > o.created_at AND o.available_at <= now()
               AND o.status = 'processing' AND o.lease_owner = $1 AND o.id <> ALL($2))
  AND status = 'processing' AND lease_owner = $1
RETURNING id";

/// The indexes the migrations build concurrently that a failed build left invalid, by name.
pub(super) const INVALID_MIGRATION_INDEXES_SQL: &str = "
SELECT c.relname::text AS name FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass('outbox') AND NOT i.indisvalid AND c.relname IN ('outbox_txid', 'outbox_later')";

/// The outbox's horizon (see `sweep.rs`).
pub(super) const HORIZON_SQL: &str = "SELECT horizon::text AS horizon FROM outbox_horizon";

/// The sweep's state, locked for the sweep's transaction (another process sweeping: no row),
/// and the snapshot of now.
pub(super) const SWEEP_LOCK_SQL: &str = "
SELECT horizon::text AS horizon, candidate::text AS candidate, pass_txid::text AS pass_txid, pass_id, pass_clean,
       pg_current_snapshot()::text AS now
FROM outbox_horizon
FOR UPDATE SKIP LOCKED";

/// The sweep's state after a run. $1 horizon, $2 candidate, $3/$4 where the pass resumes, $5
/// whether it is clean so far.
pub(super) const SWEEP_SAVE_SQL: &str = "
UPDATE outbox_horizon
SET horizon = $1::pg_snapshot, candidate = $2::pg_snapshot, pass_txid = $3::xid8, pass_id = $4, pass_clean = $5,
    swept_at = now()";

/// A stretch of the new rows after the horizon, read without locks: the rows of the
/// transactions in $1 (at a pass's start: those in progress at the horizon), then up to $4 rows
/// after $2/$3 in `(txid, id)` order (an ordered index scan, as the claim's `next`). Each row's
/// state: 0 pending, 1 processing with its lease running, 2 processing with its lease expired,
/// 3 finished, 4 dead (made dead by something that did not park it); whether it is older
/// than $5, and whether no claim ever took it.
pub(super) const SWEEP_STRETCH_SQL: &str = "
SELECT id, txid::text AS txid,
       CASE WHEN status = 'pending' THEN 0
            WHEN status = 'processing' AND lease_until >= now() THEN 1
            WHEN status = 'processing' THEN 2
            WHEN status = 'dead' THEN 4
            ELSE 3 END AS state,
       attempts, created_at < now() - $5 AS old, lease_version = 0 AS untouched
FROM ((SELECT id, txid, status, lease_until, attempts, created_at, lease_version FROM outbox
       WHERE txid = ANY($1::text[]::xid8[]) AND available_at <= created_at)
      UNION ALL
      (SELECT id, txid, status, lease_until, attempts, created_at, lease_version FROM outbox
       WHERE txid >= $2::xid8 AND txid < pg_snapshot_xmax(pg_current_snapshot()) AND (txid, id) > ($2::xid8, $3)
         AND available_at <= created_at
       ORDER BY txid, id
       LIMIT $4)) AS o
ORDER BY txid, id";

/// Moves new rows ($1) to `outbox_later`, due at once: those still pending, and those whose
/// lease expired (a claim then takes them over). A row a claim took meanwhile is left alone.
pub(super) const SWEEP_EVICT_SQL: &str = "
UPDATE outbox SET available_at = greatest(now(), created_at + interval '1 microsecond')
WHERE id = ANY($1) AND available_at <= created_at
  AND (status = 'pending' OR (status = 'processing' AND lease_until < now()))
RETURNING id";

/// Parks dead rows ($1) where the dispatcher keeps dead rows (`outbox_later`, at 9999-12-31, never
/// due), for rows made dead by something else (an operator's statement, a dispatcher from before
/// the migrations), so that the listings and gauges that read that index see them.
pub(super) const SWEEP_PARK_SQL: &str = "
UPDATE outbox SET available_at = '9999-12-31 00:00:00+00'
WHERE id = ANY($1) AND status = 'dead' AND available_at <= created_at";

// What the reaper writes: the row `dead` at 9999-12-31 (listed through `outbox_later`, never
// due), its version moved past the fence of the claim that died so that no late write of that
// claim (nor a read-back of one) can count the row as its own, the reason in `last_error`.
macro_rules! reap_set {
    () => {
        "
UPDATE outbox
SET status = 'dead',
    lease_version = lease_version + 1,
    last_error = 'reaped: lease expired after ' || attempts || ' of ' || $2::int
                 || ' attempts (the worker died or stalled mid-publish)'
                 || coalesce('; last error: ' || last_error, ''),
    lease_owner = NULL,
    lease_until = NULL,
    available_at = '9999-12-31 00:00:00+00'"
    };
}

/// Reaps new rows ($1) whose lease expired with no attempt left ($2 max_attempts); returns each
/// with the fence of the claim that died.
pub(super) const SWEEP_REAP_SQL: &str = concat!(
    reap_set!(),
    "
WHERE id = ANY($1) AND status = 'processing' AND lease_until < now() AND attempts >= $2
RETURNING id, lease_version - 1 AS lease_version"
);

/// Reaps up to 1,000 rows waiting in `outbox_later` whose lease expired with no attempt left
/// ($2 max_attempts; $1 is unused, and bound to keep the numbering of [`SWEEP_REAP_SQL`]).
pub(super) const SWEEP_REAP_LATER_SQL: &str = concat!(
    reap_set!(),
    "
WHERE id IN (SELECT id FROM outbox
             WHERE available_at > created_at AND available_at <= now()
               AND status = 'processing' AND lease_until < now() AND attempts >= $2
             ORDER BY available_at, id
             LIMIT 1000
             FOR UPDATE SKIP LOCKED)
  AND status = 'processing'
RETURNING id, lease_version - 1 AS lease_version"
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

// A pending row the producer scheduled for later (`NewEvent::not_before`) and not yet due: never
// claimed (lease_version 0, unlike a row backing off or deferred) and available later. Not
// backlog, and not counted in the age of the oldest unfinished row.
macro_rules! scheduled {
    () => {
        "lease_version = 0 AND available_at > now()"
    };
}

// Since when an unfinished row has been due: a row never claimed, since its scheduled time (its
// available_at, which is its created_at unless the producer scheduled it); any other, since it
// was created.
macro_rules! due_since {
    () => {
        "CASE WHEN lease_version = 0 THEN greatest(created_at, available_at) ELSE created_at END"
    };
}

/// For `stats` ([`super::sample`]): rows per status, the scheduled ones among the pending, the
/// age in seconds of the oldest pending or processing row that is due (NULL when none) and the
/// count of processing rows whose lease ran out, in one pass over the table, on the database
/// clock. Exact, so it reads every row, history included.
pub(super) const SAMPLE_SQL: &str = concat!(
    "
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'pending' AND ",
    scheduled!(),
    ") AS scheduled,
       count(*) FILTER (WHERE status = 'processing') AS processing,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       extract(epoch FROM now() - min(",
    due_since!(),
    ") FILTER (WHERE status IN ('pending', 'processing') AND NOT (",
    scheduled!(),
    ")))::float8 AS oldest,
       count(*) FILTER (WHERE status = 'processing' AND lease_until < now()) AS expired
FROM outbox"
);

/// The same for the dispatcher's gauges ([`super::sample_unfinished`]), every few seconds: it
/// reads only the rows that can be unfinished, so its cost follows the backlog, not the
/// history: the new rows after the outbox's horizon (through `outbox_txid`: those of later
/// transactions as a range, those of the transactions in progress at the horizon one probe each,
/// as a lateral subquery that `OFFSET 0` keeps from being flattened into a join, so that no
/// statistics can turn it into a scan of the table) and the rows that wait in `outbox_later`
/// (scheduled and dead ones included). The `done` count is the statistics collector's estimate of
/// the table's live rows less the others (0 rather than negative).
pub(super) const SAMPLE_UNFINISHED_SQL: &str = concat!(
    "
WITH rows AS (
    SELECT o.status, o.created_at, o.lease_until, o.lease_version, o.available_at FROM outbox AS o
    WHERE o.txid >= (SELECT pg_snapshot_xmax(horizon) FROM outbox_horizon LIMIT 1)
      AND o.available_at <= o.created_at AND o.status IN ('pending', 'processing')
    UNION ALL
    SELECT o.status, o.created_at, o.lease_until, o.lease_version, o.available_at
    FROM (SELECT horizon FROM outbox_horizon LIMIT 1) AS h
    CROSS JOIN LATERAL pg_snapshot_xip(h.horizon) AS x(txid)
    CROSS JOIN LATERAL (SELECT status, created_at, lease_until, lease_version, available_at FROM outbox
                        WHERE txid = x.txid AND available_at <= created_at AND status IN ('pending', 'processing')
                        OFFSET 0) AS o
    UNION ALL
    SELECT o.status, o.created_at, o.lease_until, o.lease_version, o.available_at FROM outbox AS o
    WHERE o.available_at > o.created_at AND o.status <> 'done'
), counts AS (
    SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'pending' AND ",
    scheduled!(),
    ") AS scheduled,
           count(*) FILTER (WHERE status = 'processing') AS processing,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           extract(epoch FROM now() - min(",
    due_since!(),
    ") FILTER (WHERE status IN ('pending', 'processing') AND NOT (",
    scheduled!(),
    ")))::float8 AS oldest,
           count(*) FILTER (WHERE status = 'processing' AND lease_until < now()) AS expired
    FROM rows
)
SELECT pending, scheduled, processing, dead, oldest, expired,
       greatest(pg_stat_get_live_tuples('outbox'::regclass) - pending - processing - dead, 0) AS done
FROM counts"
);

/// One stretch of the prune ([`super::prune_step`]): of the $2 rows after id $1 in primary-key
/// order, deletes the `done` ones finished more than $3 ago, and says where the stretch ended,
/// how many it deleted, and whether it held a `done` row finished more recently. With $4, only
/// while it gets the table's pruning lock (a transaction-scoped advisory lock: one pruner of a
/// fleet at a time); without it, the stretch is empty. `DELETE ... USING` a stretch of the
/// primary key has no form in Diesel's DSL.
pub(super) const PRUNE_SQL: &str = "
WITH lock AS (
    SELECT NOT $4 OR pg_try_advisory_xact_lock(hashtextextended('actix-outbox:prune:' || 'outbox'::regclass::oid, 0))
        AS held
), stretch AS (
    SELECT id, status, done_at FROM outbox WHERE (SELECT held FROM lock) AND id > $1 ORDER BY id LIMIT $2
), gone AS (
    DELETE FROM outbox AS o USING stretch AS s
    WHERE o.id = s.id AND o.status = 'done' AND o.done_at < now() - $3
    RETURNING o.id
)
SELECT (SELECT max(id) FROM stretch) AS last,
       (SELECT count(*) FROM gone) AS deleted,
       EXISTS (SELECT 1 FROM stretch WHERE status = 'done' AND done_at >= now() - $3) AS reached_recent";

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

/// The server's clock, in whole seconds since the epoch: what a test database's name carries.
#[cfg(feature = "testkit")]
pub(crate) const SERVER_SECONDS_SQL: &str = "SELECT extract(epoch FROM now())::int8 AS seconds";

/// The test databases the kit made and nobody uses any more, older than `$1` seconds by the
/// server's clock (see `testkit::drop_stale_databases`): named exactly as the kit names them
/// (ten digits of seconds first, which no pid has: the names of earlier versions,
/// `outbox_test_<pid>_<n>_<nanoseconds>`, never match), owned by the connecting role, and with
/// no session connected.
#[cfg(feature = "testkit")]
pub(crate) const STALE_TEST_DATABASES_SQL: &str = "
SELECT d.datname::text AS name FROM pg_database d
WHERE d.datname ~ '^outbox_test_[0-9]{10}_[0-9]{1,10}_[0-9]{1,19}$'
  AND d.datdba = (SELECT oid FROM pg_roles WHERE rolname = current_user)
  AND split_part(d.datname, '_', 3)::int8 <= extract(epoch FROM now()) - $1
  AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)
ORDER BY d.datname";

/// Opens a transaction that the server ends by itself (terminating the session, which releases
/// its locks) once it has waited longer than the number of milliseconds appended for the client's
/// next statement: a client whose link went silent mid-transaction cannot hold its row locks for
/// ever. `SET LOCAL` lasts as long as the transaction, so it works through a transaction pooler.
pub(super) const BEGIN_IDLE_BOUNDED: &str = "BEGIN; SET LOCAL idle_in_transaction_session_timeout = ";
