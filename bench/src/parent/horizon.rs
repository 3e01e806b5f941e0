//! The held-horizon phase: a steady production while, for part of it, a `REPEATABLE READ`
//! transaction in the bench's database holds its snapshot (an analytics query, a forgotten
//! session, a standby with `hot_standby_feedback`), so that vacuum may remove no row version
//! that died since. What a relay's claims cost while dead versions pile up shows as commit →
//! consumer latency by 30-s window, before the hold and during it, beside the dead tuples and
//! PostgreSQL's CPU per message of each window.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::sql_types::{BigInt, Int4, Nullable, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use serde::Serialize;

use super::Names;
use super::bench_conn::BenchConn;
use super::meter::{Reading, WindowCost, print_cpu_legend};
use super::producer::{Plan, Produced};
use super::statements::{self, StatementCost};
use super::stats::Spread;
use super::steady::{Steady, run_child};
use super::tally::Tally;
use crate::{BoxError, Opts, Phase, ProducerKind};

/// The windows' length, seconds.
const WINDOW: u32 = 30;

/// How long the rows still undelivered when the production ends have to arrive.
const DRAIN_WITHIN: Duration = Duration::from_secs(120);

/// The held-horizon phase's figures.
#[derive(Debug, Serialize)]
pub(super) struct Horizon {
    pub(super) rate: u32,
    pub(super) seconds: u32,
    pub(super) producer: ProducerKind,
    /// When the snapshot was taken and released, seconds into the production.
    pub(super) hold_from: u32,
    pub(super) hold_until: u32,
    /// The held transaction's `backend_xmin`, and how many transaction ids the server gave out
    /// while it held it (`age(backend_xmin)` at the release).
    pub(super) held_xmin: Option<String>,
    pub(super) xids_while_held: Option<i64>,
    /// Commit → consumer of every row committed before the hold.
    pub(super) before: Option<Spread>,
    pub(super) windows: Vec<HorizonWindow>,
    /// Rows committed and not delivered when the production ended, and still not delivered
    /// [`DRAIN_WITHIN`] later.
    pub(super) backlog_at_end: usize,
    pub(super) undelivered: usize,
    /// Deliveries that matched no commit: redeliveries (at-least-once), or rows whose commit
    /// the producer never reported.
    pub(super) unmatched: usize,
    /// The outbox at the production's end.
    pub(super) dead_tuples: i64,
    pub(super) live_tuples: i64,
    pub(super) autovacuums: i64,
    pub(super) table_bytes: i64,
    pub(super) indexes_bytes: i64,
    pub(super) produced: Produced,
    /// `pg_stat_statements` before the hold and during it (where the server keeps them).
    pub(super) statements_before: Vec<StatementCost>,
    pub(super) statements_held: Vec<StatementCost>,
}

/// One window of commits.
#[derive(Debug, Serialize)]
pub(super) struct HorizonWindow {
    pub(super) from_s: u32,
    pub(super) to_s: u32,
    /// Whether the snapshot was held through it.
    pub(super) held: bool,
    /// Commit → consumer of the rows committed in it.
    pub(super) latency: Option<Spread>,
    /// Rows committed in it and never delivered.
    pub(super) undelivered: usize,
    /// What the window cost (its end's dead tuples included).
    pub(super) cost: WindowCost,
}

/// Runs the phase.
pub(super) async fn horizon(opts: &Opts, names: &Names, tally: &Arc<Mutex<Tally>>) -> Result<Horizon, BoxError> {
    let (rate, seconds) = (opts.rate(Phase::Horizon), opts.seconds(Phase::Horizon));
    if opts.hold_from >= seconds || opts.hold == 0 {
        return Err(format!(
            "--hold-from ({}) must be within --seconds ({seconds}), --hold at least 1",
            opts.hold_from
        )
        .into());
    }
    let hold_until = (opts.hold_from + opts.hold).min(seconds);
    let bounds = boundaries(seconds, opts.hold_from, hold_until);
    let plan = Plan { rate, seconds, connections: opts.producers, pad: opts.payload_bytes.saturating_sub(24) };
    let args: Vec<_> = (0..opts.processes).map(|_| run_child(opts, names)).collect();
    let mut steady = Steady::start(opts, names, &args, plan, tally).await?;
    let mut readings: Vec<Reading> = vec![steady.reading().await?];
    let mut marks = [steady.statements().await?, None, None];
    let mut holder: Option<Holder> = None;
    let (mut held_xmin, mut xids_while_held, mut released) = (None, None, false);
    while let Some(t) = steady.tick().await? {
        while readings.len() < bounds.len() - 1 && t >= f64::from(bounds[readings.len()]) {
            readings.push(steady.reading().await?);
        }
        if holder.is_none() && !released && t >= f64::from(opts.hold_from) {
            let held = Holder::begin(&mut steady, names).await?;
            held_xmin = Some(held.xmin.clone());
            holder = Some(held);
            marks[1] = steady.statements().await?;
        }
        if t >= f64::from(hold_until)
            && let Some(held) = holder.take()
        {
            xids_while_held = held.release(&mut steady).await?;
            released = true;
            marks[2] = steady.statements().await?;
        }
    }
    // The production's end closes the last windows, and the hold if it lasts that long.
    while readings.len() < bounds.len() {
        readings.push(steady.reading().await?);
    }
    if let Some(held) = holder.take() {
        xids_while_held = held.release(&mut steady).await?;
        marks[2] = steady.statements().await?;
    }
    let backlog_at_end = steady.with_join(|j| j.backlog());
    let undelivered = steady.drain(DRAIN_WITHIN).await?;
    let (samples, waiting, unmatched) =
        steady.with_join(|j| (j.samples().to_vec(), j.waiting().collect::<Vec<_>>(), j.unmatched()));
    let produced = steady.produced().cloned().unwrap_or_default();
    steady.stop().await?;

    let latencies = |from: f64, to: f64| {
        Spread::of(samples.iter().filter(|s| s.commit_s >= from && s.commit_s < to).map(|s| s.latency_ms()).collect())
    };
    let windows = bounds
        .windows(2)
        .zip(readings.windows(2))
        .map(|(b, r)| {
            // The first and last windows take the rows committed a moment before the start
            // or after the nominal end.
            let from = if b[0] == 0 { f64::NEG_INFINITY } else { f64::from(b[0]) };
            let to = if b[1] == seconds { f64::INFINITY } else { f64::from(b[1]) };
            HorizonWindow {
                from_s: b[0],
                to_s: b[1],
                held: b[0] >= opts.hold_from && b[1] <= hold_until,
                latency: latencies(from, to),
                undelivered: waiting.iter().filter(|c| **c >= from && **c < to).count(),
                cost: WindowCost::between(&r[0], &r[1]),
            }
        })
        .collect();
    let window_of = |a: Option<&statements::Statements>, b: Option<&statements::Statements>, r: (usize, usize)| {
        let messages = readings[r.1].delivered.saturating_sub(readings[r.0].delivered);
        a.zip(b).map(|(a, b)| a.top(b, messages)).unwrap_or_default()
    };
    let hold_index = bounds.iter().position(|b| *b == opts.hold_from).unwrap_or(0);
    let until_index = bounds.iter().position(|b| *b == hold_until).unwrap_or(bounds.len() - 1);
    let end = readings.last().expect("a reading at each boundary");
    Ok(Horizon {
        rate,
        seconds,
        producer: opts.producer,
        hold_from: opts.hold_from,
        hold_until,
        held_xmin,
        xids_while_held,
        before: latencies(f64::NEG_INFINITY, f64::from(opts.hold_from)),
        windows,
        backlog_at_end,
        undelivered,
        unmatched,
        dead_tuples: end.table.n_dead_tup,
        live_tuples: end.table.n_live_tup,
        autovacuums: end.table.autovacuum_count - readings[0].table.autovacuum_count,
        table_bytes: end.table.table_bytes,
        indexes_bytes: end.table.indexes_bytes,
        produced,
        statements_before: window_of(marks[0].as_ref(), marks[1].as_ref(), (0, hold_index)),
        statements_held: window_of(marks[1].as_ref(), marks[2].as_ref(), (hold_index, until_index)),
    })
}

/// The windows' ends, seconds: every [`WINDOW`] back from the hold's start to 0, on through
/// the hold from its start to its end, and on after it to the end of the production.
fn boundaries(seconds: u32, hold_from: u32, hold_until: u32) -> Vec<u32> {
    let mut bounds = vec![0, seconds];
    bounds.extend((0..).map(|k| hold_from.saturating_sub(k * WINDOW)).take_while(|b| *b > 0));
    bounds.extend((hold_from..hold_until).step_by(WINDOW as usize));
    bounds.extend((hold_until..seconds).step_by(WINDOW as usize));
    bounds.sort_unstable();
    bounds.dedup();
    bounds
}

/// The transaction that holds the snapshot.
struct Holder {
    conn: BenchConn,
    pid: i32,
    xmin: String,
}

impl Holder {
    /// Begins a `REPEATABLE READ` transaction and runs a query in it (its snapshot is taken by
    /// the first query, not by `BEGIN`); fails unless the server then shows it holding an
    /// xmin.
    async fn begin(steady: &mut Steady<'_>, names: &Names) -> Result<Self, BoxError> {
        let mut conn = steady.connect(names, "holder").await?;
        conn.uncounted().batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ").await?;
        #[derive(diesel::QueryableByName)]
        struct Pid {
            #[diesel(sql_type = Int4)]
            pid: i32,
            #[diesel(sql_type = BigInt)]
            rows: i64,
        }
        let me: Pid = diesel::sql_query(
            "SELECT pg_backend_pid() AS pid, (SELECT count(*) FROM (SELECT 1 FROM outbox LIMIT 1) AS one) AS rows",
        )
        .get_result(conn.uncounted())
        .await?;
        let _ = me.rows;
        #[derive(diesel::QueryableByName)]
        struct Xmin {
            #[diesel(sql_type = Nullable<Text>)]
            xmin: Option<String>,
        }
        let held: Xmin = diesel::sql_query("SELECT backend_xmin::text AS xmin FROM pg_stat_activity WHERE pid = $1")
            .bind::<Int4, _>(me.pid)
            .get_result(steady.sampler().one())
            .await?;
        let xmin = held.xmin.ok_or("the REPEATABLE READ transaction holds no xmin: the horizon is not held")?;
        Ok(Self { conn, pid: me.pid, xmin })
    }

    /// Commits the transaction; returns how many transaction ids were given out meanwhile.
    async fn release(mut self, steady: &mut Steady<'_>) -> Result<Option<i64>, BoxError> {
        #[derive(diesel::QueryableByName)]
        struct Age {
            #[diesel(sql_type = Nullable<BigInt>)]
            age: Option<i64>,
        }
        let age: Age = diesel::sql_query("SELECT age(backend_xmin)::int8 AS age FROM pg_stat_activity WHERE pid = $1")
            .bind::<Int4, _>(self.pid)
            .get_result(steady.sampler().one())
            .await?;
        self.conn.uncounted().batch_execute("COMMIT").await?;
        self.conn.count();
        Ok(age.age)
    }
}

/// The phase's report.
pub(super) fn print(h: &Horizon) {
    println!();
    println!(
        "held horizon: {} rows/s for {} s (producer: {}); a REPEATABLE READ snapshot held from {} s to {} s (xmin {}, {} transaction ids given out meanwhile)",
        h.rate,
        h.seconds,
        match h.producer {
            ProducerKind::Bench => "the bench, commit = the INSERT returned",
            ProducerKind::Pgbench => "pgbench, commit = created_at",
        },
        h.hold_from,
        h.hold_until,
        h.held_xmin.as_deref().unwrap_or("-"),
        h.xids_while_held.map_or_else(|| "-".to_owned(), |x| x.to_string())
    );
    println!(
        "{:<11} {:>4} {:>7} {:>8} {:>8} {:>8} {:>6} {:>8} {:>7} {:>8} {:>5} {:>9} {:>4}",
        "window s",
        "held",
        "rows",
        "p50 ms",
        "p99 ms",
        "max ms",
        "lost",
        "pg:relay",
        "pg:rest",
        "relay",
        "hot",
        "dead",
        "av"
    );
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    let ms = |s: Option<Spread>, f: fn(&Spread) -> f64| s.map_or_else(|| "-".to_owned(), |s| format!("{:.1}", f(&s)));
    if let Some(before) = h.before {
        println!(
            "{:<11} {:>4} {:>7} {:>8.1} {:>8.1} {:>8.1}",
            "before hold", "", before.rows, before.p50_ms, before.p99_ms, before.max_ms
        );
    }
    for w in &h.windows {
        println!(
            "{:<11} {:>4} {:>7} {:>8} {:>8} {:>8} {:>6} {:>8} {:>7} {:>8.0} {:>5} {:>9} {:>4}",
            format!("{}–{}", w.from_s, w.to_s),
            if w.held { "yes" } else { "" },
            w.latency.map_or(0, |s| s.rows),
            ms(w.latency, |s| s.p50_ms),
            ms(w.latency, |s| s.p99_ms),
            ms(w.latency, |s| s.max_ms),
            w.undelivered,
            us(w.cost.pg_relay_us),
            us(w.cost.pg_rest_us),
            w.cost.relay_us,
            w.cost.hot_share.map_or_else(|| "-".to_owned(), |s| format!("{:.0}%", s * 100.0)),
            w.cost.dead_tuples,
            w.cost.autovacuums
        );
    }
    println!(
        "at the production's end: backlog {} rows ({} still undelivered {} s later, {} deliveries matched no commit); \
         the outbox: {} dead tuples, {} live, {} autovacuums in the phase, table {:.1} MiB, indexes {:.1} MiB",
        h.backlog_at_end,
        h.undelivered,
        DRAIN_WITHIN.as_secs(),
        h.unmatched,
        h.dead_tuples,
        h.live_tuples,
        h.autovacuums,
        h.table_bytes as f64 / 1048576.0,
        h.indexes_bytes as f64 / 1048576.0
    );
    for line in &h.produced.summary {
        println!("pgbench: {line}");
    }
    println!("window = rows committed in it; p* = their commit → consumer delivery; lost = of them never delivered;");
    println!("hot = HOT share of the outbox's updates in the window; dead = its dead tuples at the window's end;");
    println!("av = autovacuums of it in the window.");
    print_cpu_legend();
    for (title, list) in [("before the hold", &h.statements_before), ("during the hold", &h.statements_held)] {
        if !list.is_empty() {
            println!("statements {title}:");
            statements::print(list);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_cut_at_the_hold_s_start_and_end() {
        assert_eq!(boundaries(270, 90, 270), vec![0, 30, 60, 90, 120, 150, 180, 210, 240, 270]);
        assert_eq!(boundaries(60, 20, 50), vec![0, 20, 50, 60]);
        assert_eq!(boundaries(100, 45, 80), vec![0, 15, 45, 75, 80, 100]);
        assert_eq!(boundaries(30, 10, 30), vec![0, 10, 30]);
        // A hold that ends early: 30-s windows after it too.
        assert_eq!(boundaries(200, 30, 60), vec![0, 30, 60, 90, 120, 150, 180, 200]);
    }
}
