//! The FIFO-gated claim on a table of a million rows: its plan, its buffers and its timing.
//!
//! ```text
//! cargo run --release -p actix-outbox-tools   # DATABASE_URL defaults to a database of its own
//! ```
//!
//! Fills `outbox_fifo_explain` (created if missing, emptied if not) with 1,000,000 rows: 990,000
//! `done` rows, then a backlog of 10,000 `pending` rows over 1,000 aggregates, 20 of them held
//! by a dead head and 20 by a head being processed. Then it prints `EXPLAIN (ANALYZE, BUFFERS)`
//! of the claim with the gate on all types and on some types, and times each claim (run inside a
//! transaction that is rolled back, so every run sees the same table), next to the claim without
//! the gate. A second scenario puts one hot aggregate's 5,000-row backlog ahead of the others:
//! the case the gate is slowest in. Exits non-zero if any plan scans the table.

use std::time::{Duration, Instant};

mod common;

use actix_outbox::Fifo;
use actix_outbox::testing::ClaimParams;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager};

const DEFAULT_URL: &str = "postgres://root@127.0.0.1:5432/outbox_fifo_explain";
const RUNS: usize = 30;

/// 990,000 done rows over 20,000 aggregates, then the backlog: 1,000 aggregates × 10 pending
/// rows, interleaved as they would arrive; 20 aggregates' heads dead, 20 processing.
const FILL: &str = r#"
TRUNCATE outbox RESTART IDENTITY;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, created_at, available_at,
                    attempts, lease_version, done_at)
SELECT 'order', 'agg-' || (g % 20000), CASE WHEN g % 3 = 0 THEN 'email.sent' ELSE 'order.changed' END,
       jsonb_build_object('n', g), 'done', now() - interval '1 day', now() - interval '1 day', 1, 1,
       now() - interval '1 day' + g * interval '1 ms'
FROM generate_series(1, 990000) AS g;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', 'agg-' || (g % 1000), CASE WHEN g % 3 = 0 THEN 'email.sent' ELSE 'order.changed' END,
       jsonb_build_object('n', g)
FROM generate_series(0, 9999) AS g;
UPDATE outbox SET status = 'dead', attempts = 12, last_error = 'permanent: rejected'
WHERE id BETWEEN 990001 AND 990020;
UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_owner = 'elsewhere',
                  lease_until = now() + interval '1 hour'
WHERE id BETWEEN 990021 AND 990040;
"#;

/// Scenario 2: a hot aggregate's 5,000 pending rows ahead of the spread backlog (replaces 5,000
/// done rows, so the table keeps 1,000,000 rows).
const HOT: &str = r#"
UPDATE outbox SET aggregate_id = 'hot', status = 'pending', available_at = now() - interval '1 hour',
                  attempts = 0, lease_version = 0, done_at = NULL
WHERE id BETWEEN 985001 AND 990000;
"#;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut conn = common::open(DEFAULT_URL).await?;
    let took = common::fill(&mut conn, FILL).await?;
    println!("filled 1,000,000 rows in {:.1} s", took.as_secs_f64());
    println!("{}", table_summary(&mut conn).await?);

    let mut scanned = false;
    println!("\n=== scenario 1: 10,000 pending rows spread over 1,000 aggregates ===");
    scanned |= scenario(&mut conn).await?;

    conn.batch_execute(HOT).await?;
    conn.batch_execute("VACUUM ANALYZE outbox").await?;
    println!("\n=== scenario 2: plus one hot aggregate with 5,000 pending rows ahead of the others ===");
    println!("{}", table_summary(&mut conn).await?);
    scanned |= scenario(&mut conn).await?;

    if scanned {
        eprintln!("\nFAIL: a plan scans the outbox table sequentially");
        std::process::exit(1);
    }
    println!("\nOK: no plan scans the outbox table");
    Ok(())
}

/// Prints the plans and timings of one table state; returns whether any plan has a seq scan.
async fn scenario(conn: &mut AsyncPgConnection) -> Result<bool, Box<dyn std::error::Error>> {
    let types = Fifo::event_types(["order.changed"]);
    let mut scanned = false;
    for (name, fifo) in [("gate on all types", &Fifo::All), ("gate on order.changed only", &types)] {
        let params = params(fifo);
        let plan = actix_outbox::testing::explain_claim(conn, &params, true).await?;
        println!("\n--- EXPLAIN (ANALYZE, BUFFERS), {name} ---");
        for line in &plan {
            println!("{line}");
        }
        scanned |= plan.iter().any(|l| l.contains("Seq Scan on outbox"));
    }
    println!("\n--- claim of up to 50 rows, {RUNS} runs each, rolled back (client round trip) ---");
    for (name, fifo) in [("no gate", &Fifo::Off), ("gate on all types", &Fifo::All), ("gate on order.changed", &types)]
    {
        let (claimed, times) = time_claim(conn, &params(fifo)).await?;
        println!(
            "{name:<24} claimed {claimed:>2} rows   median {:>7.2} ms   min {:>7.2} ms   max {:>7.2} ms",
            ms(times[times.len() / 2]),
            ms(times[0]),
            ms(times[times.len() - 1])
        );
    }
    Ok(scanned)
}

fn params(fifo: &Fifo) -> ClaimParams<'_> {
    common::claim_params(fifo, 50)
}

/// Runs the claim `RUNS` times (after 3 warm-ups), each in a transaction rolled back; returns
/// the rows one claim takes and the sorted durations.
async fn time_claim(
    conn: &mut AsyncPgConnection,
    params: &ClaimParams<'_>,
) -> Result<(usize, Vec<Duration>), Box<dyn std::error::Error>> {
    let mut times = Vec::with_capacity(RUNS);
    let mut claimed = 0;
    for run in 0..RUNS + 3 {
        AnsiTransactionManager::begin_transaction(conn).await?;
        let started = Instant::now();
        let claim = actix_outbox::testing::claim(conn, params).await;
        let took = started.elapsed();
        AnsiTransactionManager::rollback_transaction(conn).await?;
        claimed = claim?.messages.len();
        if run >= 3 {
            times.push(took);
        }
    }
    times.sort();
    Ok((claimed, times))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn table_summary(conn: &mut AsyncPgConnection) -> Result<String, Box<dyn std::error::Error>> {
    use diesel::QueryableByName;
    use diesel::sql_types::{BigInt, Text};
    use diesel_async::RunQueryDsl;
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = Text)]
        status: String,
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let counts: Vec<Count> =
        diesel::sql_query("SELECT status, count(*) AS n FROM outbox GROUP BY status ORDER BY status")
            .load(conn)
            .await?;
    Ok(counts.iter().map(|c| format!("{}={}", c.status, c.n)).collect::<Vec<_>>().join("  "))
}
