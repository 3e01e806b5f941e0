//! Where PostgreSQL's time goes, statement by statement: `pg_stat_statements` of the bench's
//! database read at both ends of a measured window, and the difference. Only where the server
//! loads the module (`--pg-own` does); the bench creates the extension in its own database.

use std::collections::HashMap;

use diesel::sql_types::{BigInt, Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::Serialize;

use super::bench_conn::BenchConn;
use crate::BoxError;

/// Statements the report lists, the costliest first.
const TOP: usize = 8;

/// Creates the extension in the bench's database where the server has the module loaded;
/// returns whether it did (whether statements can be read).
pub(super) async fn enable(db: &mut AsyncPgConnection) -> Result<bool, BoxError> {
    #[derive(diesel::QueryableByName)]
    struct Loaded {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        loaded: bool,
    }
    let loaded: Loaded = diesel::sql_query(
        "SELECT 'pg_stat_statements' = ANY(string_to_array(replace(current_setting('shared_preload_libraries'), ' ', ''), ','))
             AS loaded",
    )
    .get_result(db)
    .await?;
    if loaded.loaded {
        db.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await?;
    }
    Ok(loaded.loaded)
}

/// One statement's counters.
#[derive(Debug, Clone, Default, PartialEq)]
struct Counters {
    calls: i64,
    total_ms: f64,
    rows: i64,
    blks_hit: i64,
    blks_read: i64,
    wal_bytes: f64,
}

/// The counters of every statement of the bench's database, by statement (`queryid`).
#[derive(Debug, Default)]
pub(super) struct Statements(HashMap<i64, (String, Counters)>);

impl Statements {
    /// Reads them now.
    pub(super) async fn read(conn: &mut BenchConn) -> Result<Self, BoxError> {
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            queryid: i64,
            #[diesel(sql_type = Text)]
            query: String,
            #[diesel(sql_type = BigInt)]
            calls: i64,
            #[diesel(sql_type = Double)]
            total_ms: f64,
            #[diesel(sql_type = BigInt)]
            rows: i64,
            #[diesel(sql_type = BigInt)]
            blks_hit: i64,
            #[diesel(sql_type = BigInt)]
            blks_read: i64,
            #[diesel(sql_type = Double)]
            wal_bytes: f64,
        }
        // A statement run at top level and nested is two entries of one queryid: summed.
        let rows: Vec<Row> = diesel::sql_query(
            "SELECT queryid, min(query) AS query, sum(calls)::int8 AS calls,
                    sum(total_exec_time)::float8 AS total_ms, sum(rows)::int8 AS rows,
                    sum(shared_blks_hit)::int8 AS blks_hit, sum(shared_blks_read)::int8 AS blks_read,
                    sum(wal_bytes)::float8 AS wal_bytes
             FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND queryid IS NOT NULL
             GROUP BY queryid",
        )
        .get_results(conn.one())
        .await?;
        Ok(Self(
            rows.into_iter()
                .map(|r| {
                    let counters = Counters {
                        calls: r.calls,
                        total_ms: r.total_ms,
                        rows: r.rows,
                        blks_hit: r.blks_hit,
                        blks_read: r.blks_read,
                        wal_bytes: r.wal_bytes,
                    };
                    (r.queryid, (r.query, counters))
                })
                .collect(),
        ))
    }

    /// The costliest statements between `self` (earlier) and `later`, by total time, with
    /// `messages` relayed meanwhile.
    pub(super) fn top(&self, later: &Self, messages: u64) -> Vec<StatementCost> {
        let zero = Counters::default();
        let mut spent: Vec<(&str, Counters)> = later
            .0
            .iter()
            .map(|(id, (query, after))| {
                let before = self.0.get(id).map_or(&zero, |(_, c)| c);
                let delta = Counters {
                    calls: after.calls - before.calls,
                    total_ms: after.total_ms - before.total_ms,
                    rows: after.rows - before.rows,
                    blks_hit: after.blks_hit - before.blks_hit,
                    blks_read: after.blks_read - before.blks_read,
                    wal_bytes: after.wal_bytes - before.wal_bytes,
                };
                (query.as_str(), delta)
            })
            .filter(|(_, d)| d.calls > 0)
            .collect();
        let all_ms: f64 = spent.iter().map(|(_, d)| d.total_ms).sum();
        spent.sort_by(|a, b| b.1.total_ms.total_cmp(&a.1.total_ms));
        spent
            .into_iter()
            .take(TOP)
            .map(|(query, d)| {
                let calls = d.calls as f64;
                StatementCost {
                    query: query.split_whitespace().collect::<Vec<_>>().join(" "),
                    calls: d.calls,
                    calls_per_msg: calls / messages.max(1) as f64,
                    total_ms: d.total_ms,
                    share: if all_ms > 0.0 { d.total_ms / all_ms } else { 0.0 },
                    mean_ms: d.total_ms / calls,
                    rows_per_call: d.rows as f64 / calls,
                    blks_hit_per_call: d.blks_hit as f64 / calls,
                    blks_read_per_call: d.blks_read as f64 / calls,
                    wal_bytes_per_call: d.wal_bytes / calls,
                }
            })
            .collect()
    }
}

/// One statement over a measured window.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(super) struct StatementCost {
    /// Its text as `pg_stat_statements` normalises it (constants as `$n`), on one line.
    pub(super) query: String,
    pub(super) calls: i64,
    pub(super) calls_per_msg: f64,
    /// Execution time, milliseconds, and its share of every statement's of the database.
    pub(super) total_ms: f64,
    pub(super) share: f64,
    pub(super) mean_ms: f64,
    pub(super) rows_per_call: f64,
    /// Shared buffers hit and read per call.
    pub(super) blks_hit_per_call: f64,
    pub(super) blks_read_per_call: f64,
    pub(super) wal_bytes_per_call: f64,
}

/// The statements as lines: share, calls per message, mean, rows, hits and WAL per call, text.
pub(super) fn print(statements: &[StatementCost]) {
    println!(
        "  {:>6} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9}  statement (pg_stat_statements)",
        "time", "calls", "calls/msg", "mean ms", "rows", "hits", "wal B"
    );
    for s in statements {
        let text: String = s.query.chars().take(110).collect();
        println!(
            "  {:>5.1}% {:>9} {:>9.3} {:>9.3} {:>8.1} {:>9.1} {:>9.0}  {text}",
            s.share * 100.0,
            s.calls,
            s.calls_per_msg,
            s.mean_ms,
            s.rows_per_call,
            s.blks_hit_per_call,
            s.wal_bytes_per_call
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(calls: i64, total_ms: f64, rows: i64) -> Counters {
        Counters { calls, total_ms, rows, blks_hit: calls * 10, blks_read: 0, wal_bytes: calls as f64 * 100.0 }
    }

    #[test]
    fn the_window_is_the_difference_costliest_first() {
        let before = Statements(HashMap::from([
            (1, ("UPDATE  outbox\n SET x".to_owned(), counters(10, 5.0, 10))),
            (2, ("SELECT 1".to_owned(), counters(4, 1.0, 4))),
        ]));
        let after = Statements(HashMap::from([
            (1, ("UPDATE  outbox\n SET x".to_owned(), counters(110, 45.0, 210))),
            (2, ("SELECT 1".to_owned(), counters(4, 1.0, 4))),
            (3, ("INSERT INTO outbox".to_owned(), counters(200, 60.0, 200))),
        ]));
        let top = before.top(&after, 200);
        assert_eq!(top.len(), 2, "a statement not run in the window is left out");
        assert_eq!(top[0].query, "INSERT INTO outbox");
        assert_eq!((top[0].calls, top[0].share), (200, 0.6));
        assert_eq!(top[1].query, "UPDATE outbox SET x");
        assert_eq!((top[1].calls, top[1].calls_per_msg, top[1].mean_ms, top[1].rows_per_call), (100, 0.5, 0.4, 2.0));
        assert_eq!((top[1].blks_hit_per_call, top[1].wal_bytes_per_call), (10.0, 100.0));
    }
}
