//! What a kept history costs the dispatcher's statements: the claim, the fenced finalize and
//! the purge on a table of `--kept` `done` rows (default 2,000,000, about a day of a busy
//! service under the default `Keep` retention) and a backlog of `--pending` new rows.
//!
//! ```text
//! cargo run --release -p actix-outbox-tools --bin history-explain -- --kept 20000000
//! ```
//!
//! Fills `outbox_history_explain` (`DATABASE_URL` overrides it; created if missing, emptied if
//! not), vacuums and analyses it as autovacuum would have, prints the table's and each index's
//! size, `EXPLAIN (ANALYZE, BUFFERS)` of a 200-row claim (gate off and on), of the finalize of
//! those rows and of one purge batch, and the median time of each over 15 runs (the purge: of
//! the oldest 50,000 rows), every run in a
//! transaction that is rolled back so that each sees the same table. Exits non-zero if a plan
//! of the claim or the finalize scans the table.

use std::time::{Duration, Instant};

use actix_outbox::Fifo;
use actix_outbox::dispatcher::Fence;
use actix_outbox::testing::ClaimParams;
use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Text};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};

mod common;

use common::BoxError;

const DEFAULT_URL: &str = "postgres://root@127.0.0.1:5432/outbox_history_explain";
const RUNS: usize = 15;
/// Rows one claim takes: the dispatcher's default batch.
const BATCH: usize = 200;
/// Rows one purge statement deletes: the CLI's default.
const PURGE_BATCH: i64 = 1000;
/// Rows the timed purge deletes.
const PURGED: u64 = 50_000;

/// The history: `done` over the last day, one attempt each, over 20,000 aggregates; then the
/// backlog over 1,000 aggregates, as they would arrive.
const FILL: &str = r#"
TRUNCATE outbox RESTART IDENTITY;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, status, available_at,
                    attempts, lease_version, done_at)
SELECT 'order', 'agg-' || (g % 20000), 'order.changed', jsonb_build_object('n', g, 'pad', repeat('x', 200)),
       t, 'done', t, 1, 1, t + interval '5 milliseconds'
FROM generate_series(1, $KEPT) AS g,
     LATERAL (SELECT now() - interval '1 day' + (interval '1 day' / $KEPT) * g) AS s(t);
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', 'agg-' || (g % 1000), 'order.changed', jsonb_build_object('n', g, 'pad', repeat('x', 200))
FROM generate_series(1, $PENDING) AS g;
"#;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let (kept, pending) = args()?;
    let mut conn = common::open(DEFAULT_URL).await?;
    let fill = FILL.replace("$KEPT", &kept.to_string()).replace("$PENDING", &pending.to_string());
    let took = common::fill(&mut conn, &fill).await?;
    println!("filled {kept} done + {pending} pending rows in {:.1} s", took.as_secs_f64());
    print_sizes(&mut conn).await?;

    let mut scanned = false;
    for (name, fifo) in [("gate off", &Fifo::Off), ("gate on all types", &Fifo::All)] {
        let plan = actix_outbox::testing::explain_claim(&mut conn, &params(fifo), true).await?;
        println!("\n--- claim of {BATCH} rows, {name}: EXPLAIN (ANALYZE, BUFFERS) ---");
        print_plan(&plan);
        scanned |= plan.iter().any(|l| l.contains("Seq Scan on outbox"));
    }

    // The finalize of one claim's rows, as `mark_done` writes it (the fence: each id at its
    // claim's version).
    AnsiTransactionManager::begin_transaction(&mut conn).await?;
    let claim = actix_outbox::testing::claim(&mut conn, &params(&Fifo::Off)).await?;
    let fences: Vec<Fence> = claim.messages.iter().map(|m| m.fence()).collect();
    let ids: Vec<i64> = fences.iter().map(|f| f.id).collect();
    let versions: Vec<i64> = fences.iter().map(|f| f.lease_version).collect();
    let plan = explain(
        &mut conn,
        "UPDATE outbox SET status = 'done', done_at = now(), lease_owner = NULL, lease_until = NULL
         WHERE status IS NOT DISTINCT FROM 'processing' AND id = ANY($1)
           AND lease_version = ($2)[width_bucket(id, $1)]
         RETURNING id",
        &[&ids, &versions],
    )
    .await?;
    AnsiTransactionManager::rollback_transaction(&mut conn).await?;
    println!("\n--- finalize (mark done) of those {} rows: EXPLAIN (ANALYZE, BUFFERS) ---", fences.len());
    print_plan(&plan);
    scanned |= plan.iter().any(|l| l.contains("Seq Scan on outbox"));

    let plan = explain(
        &mut conn,
        &format!(
            "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox AS old
                WHERE old.status = 'done' AND old.done_at < now() - interval '23 hours'
                LIMIT {PURGE_BATCH} FOR UPDATE SKIP LOCKED)"
        ),
        &[],
    )
    .await?;
    println!("\n--- one purge batch ({PURGE_BATCH} rows done over 23 h ago): EXPLAIN (ANALYZE, BUFFERS) ---");
    print_plan(&plan);

    println!("\n--- median of {RUNS} runs, each rolled back (client round trip) ---");
    let claim_off = time(&mut conn, async |c| {
        actix_outbox::testing::claim(c, &params(&Fifo::Off)).await.map(|claim| claim.messages.len() as u64)
    })
    .await?;
    let claim_fifo = time(&mut conn, async |c| {
        actix_outbox::testing::claim(c, &params(&Fifo::All)).await.map(|claim| claim.messages.len() as u64)
    })
    .await?;
    let finalize = time(&mut conn, async |c| {
        let claim = actix_outbox::testing::claim(c, &params(&Fifo::Off)).await?;
        let fences: Vec<Fence> = claim.messages.iter().map(|m| m.fence()).collect();
        // Only the finalize is timed: its microseconds are what this run returns.
        let started = Instant::now();
        actix_outbox::testing::mark_done(c, &fences).await?;
        Ok(started.elapsed().as_micros() as u64)
    })
    .await?;
    // The oldest PURGED rows of the history (whose `done_at` spreads over a day): the same work
    // whatever the history's size.
    let purged = PURGED.min(kept);
    let older_than = Duration::from_secs_f64(86_400.0 * (1.0 - purged as f64 / kept.max(1) as f64));
    let purge = time(&mut conn, async |c| actix_outbox::admin::purge_done(c, older_than, PURGE_BATCH).await).await?;
    let stats = time(&mut conn, async |c| actix_outbox::admin::stats(c).await.map(|s| s.expired_leases as u64)).await?;
    println!("claim, gate off         {:>9.2} ms  ({} rows)", claim_off.0, claim_off.1);
    println!("claim, gate on          {:>9.2} ms  ({} rows)", claim_fifo.0, claim_fifo.1);
    println!("finalize of {BATCH} rows    {:>9.2} ms  (the mark-done statement alone)", finalize.1 as f64 / 1e3);
    println!(
        "purge of the oldest     {:>9.2} ms  ({} rows, {:.0} rows/s)",
        purge.0,
        purge.1,
        purge.1 as f64 / purge.0 * 1e3
    );
    println!("stats (exact counts)    {:>9.2} ms  (reads every row; the dispatcher's sampler does not)", stats.0);

    if scanned {
        eprintln!("\nFAIL: a plan of the claim or the finalize scans the outbox table");
        std::process::exit(1);
    }
    println!("\nOK: neither the claim nor the finalize scans the table");
    Ok(())
}

/// Prints a plan, each line cut at 160 characters (the finalize's plan shows its bound arrays
/// inline).
fn print_plan(plan: &[String]) {
    for line in plan {
        match line.char_indices().nth(160) {
            Some((cut, _)) => println!("{}...", &line[..cut]),
            None => println!("{line}"),
        }
    }
}

/// `--kept N --pending M`.
fn args() -> Result<(u64, u64), BoxError> {
    let (mut kept, mut pending) = (2_000_000, 30_000);
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = || -> Result<u64, BoxError> {
            let text = pair.get(1).ok_or_else(|| format!("{} needs a number", pair[0]))?;
            text.parse().map_err(|e| format!("{} {text}: {e}", pair[0]).into())
        };
        match pair[0].as_str() {
            "--kept" => kept = value()?,
            "--pending" => pending = value()?,
            other => {
                return Err(format!("unknown argument {other}; usage: history-explain [--kept N] [--pending M]").into());
            }
        }
    }
    Ok((kept, pending))
}

fn params(fifo: &Fifo) -> ClaimParams<'_> {
    common::claim_params(fifo, BATCH)
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of `sql` with `arrays` bound as `$1, $2, ...` (`bigint[]`), in
/// a transaction rolled back (a savepoint inside an open one).
async fn explain(conn: &mut AsyncPgConnection, sql: &str, arrays: &[&Vec<i64>]) -> Result<Vec<String>, BoxError> {
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    AnsiTransactionManager::begin_transaction(conn).await?;
    let mut query = diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {sql}")).into_boxed();
    for array in arrays {
        query = query.bind::<Array<BigInt>, _>(array.to_vec());
    }
    let lines: Result<Vec<PlanLine>, _> = query.load(conn).await;
    AnsiTransactionManager::rollback_transaction(conn).await?;
    Ok(lines?.into_iter().map(|l| l.line).collect())
}

/// Runs `f` `RUNS` times (after 2 warm-ups), each in a transaction rolled back; returns the
/// median milliseconds and what the median run returned.
async fn time<F>(conn: &mut AsyncPgConnection, f: F) -> Result<(f64, u64), BoxError>
where
    F: AsyncFn(&mut AsyncPgConnection) -> Result<u64, actix_outbox::StoreError>,
{
    let mut runs = Vec::with_capacity(RUNS);
    for run in 0..RUNS + 2 {
        AnsiTransactionManager::begin_transaction(conn).await?;
        let started = Instant::now();
        let result = f(conn).await;
        let took = started.elapsed();
        AnsiTransactionManager::rollback_transaction(conn).await?;
        if run >= 2 {
            runs.push((took.as_secs_f64() * 1e3, result?));
        }
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(runs[RUNS / 2])
}

async fn print_sizes(conn: &mut AsyncPgConnection) -> Result<(), BoxError> {
    #[derive(QueryableByName)]
    struct Size {
        #[diesel(sql_type = Text)]
        name: String,
        #[diesel(sql_type = BigInt)]
        bytes: i64,
    }
    let sizes: Vec<Size> = diesel::sql_query(
        "SELECT 'outbox (heap)' AS name, pg_relation_size('outbox') AS bytes
         UNION ALL
         SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index
         WHERE indrelid = 'outbox'::regclass ORDER BY 1",
    )
    .load(conn)
    .await?;
    for s in sizes {
        println!("{:<20} {:>10.1} MiB", s.name, s.bytes as f64 / (1 << 20) as f64);
    }
    Ok(())
}
