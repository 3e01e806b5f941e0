//! The soak phase: a steady production for `--minutes`, the relay on its defaults, and a line
//! a minute of what time does to it: the rate delivered, commit → consumer of the rows
//! delivered in that minute, the outbox's table and index sizes, its dead tuples, the relay's
//! resident memory and what each message cost. `bench/plot_soak.py` draws the lines.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use super::Names;
use super::meter::{Reading, TableStats, WindowCost, print_cpu_legend};
use super::producer::{Plan, Produced};
use super::statements::{self, StatementCost};
use super::stats::Spread;
use super::steady::{Steady, run_child};
use super::tally::Tally;
use crate::{BoxError, Opts, Phase, ProducerKind};

/// How long after a minute's end its line waits for the deliveries of that minute to be
/// matched with their commits (pgbench's are read from the table every half second).
const GRACE_S: f64 = 2.0;

/// How long the rows still undelivered when the production ends have to arrive.
const DRAIN_WITHIN: Duration = Duration::from_secs(120);

const MIB: f64 = 1048576.0;

/// The soak's figures.
#[derive(Debug, Serialize)]
pub(super) struct Soak {
    pub(super) rate: u32,
    pub(super) minutes: u32,
    pub(super) producer: ProducerKind,
    /// `actix-outbox run`'s arguments beyond the database, broker and exchange.
    pub(super) relay_args: Vec<String>,
    pub(super) lines: Vec<SoakMinute>,
    /// Rows committed and not delivered when the production ended, and still not delivered
    /// [`DRAIN_WITHIN`] later.
    pub(super) backlog_at_end: usize,
    pub(super) undelivered: usize,
    /// Deliveries that matched no commit: redeliveries (at-least-once), or rows whose commit
    /// the producer never reported.
    pub(super) unmatched: usize,
    pub(super) produced: Produced,
    /// `pg_stat_statements` over the whole soak (where the server keeps them).
    pub(super) statements: Vec<StatementCost>,
}

/// One minute of the soak.
#[derive(Debug, Clone, Serialize)]
pub(super) struct SoakMinute {
    /// 1 for the first.
    pub(super) minute: u32,
    pub(super) committed_per_s: f64,
    pub(super) delivered_per_s: f64,
    /// Commit → consumer of the rows delivered in the minute.
    pub(super) latency: Option<Spread>,
    /// Rows committed and not delivered at the minute's end.
    pub(super) backlog: usize,
    /// The outbox at the minute's end: `pg_relation_size`, `pg_indexes_size` and each index.
    pub(super) table_bytes: i64,
    pub(super) indexes_bytes: i64,
    pub(super) indexes: BTreeMap<String, i64>,
    pub(super) live_tuples: i64,
    pub(super) dead_tuples: i64,
    /// The relay processes' resident memory at the minute's end (`VmRSS`, summed), MiB.
    pub(super) relay_rss_mib: f64,
    /// What the minute cost per message.
    pub(super) cost: WindowCost,
}

/// A minute whose counters are read and whose latencies may still be coming in.
struct Closing {
    minute: u32,
    cost: WindowCost,
    table: TableStats,
    rss_kib: u64,
    backlog: usize,
    committed: u64,
}

impl Closing {
    /// Minute `minute`, from `last` to `now`.
    fn new(steady: &Steady<'_>, last: &Reading, now: &Reading, minute: u32) -> Self {
        Self {
            minute,
            cost: WindowCost::between(last, now),
            table: now.table.clone(),
            rss_kib: now.relay_rss_kib,
            backlog: steady.with_join(|j| j.backlog()),
            committed: now.committed.saturating_sub(last.committed),
        }
    }

    fn line(self, latencies: Vec<f64>) -> SoakMinute {
        SoakMinute {
            minute: self.minute,
            committed_per_s: self.committed as f64 / self.cost.seconds.max(1e-9),
            delivered_per_s: self.cost.msg_s,
            latency: Spread::of(latencies),
            backlog: self.backlog,
            table_bytes: self.table.table_bytes,
            indexes_bytes: self.table.indexes_bytes,
            indexes: self.table.indexes().into_iter().collect(),
            live_tuples: self.table.n_live_tup,
            dead_tuples: self.table.n_dead_tup,
            relay_rss_mib: self.rss_kib as f64 / 1024.0,
            cost: self.cost,
        }
    }
}

/// Runs the phase, printing each minute's line on stderr as it closes.
pub(super) async fn soak(opts: &Opts, names: &Names, tally: &Arc<Mutex<Tally>>) -> Result<Soak, BoxError> {
    let (rate, seconds) = (opts.rate(Phase::Soak), opts.seconds(Phase::Soak));
    let plan = Plan { rate, seconds, connections: opts.producers, pad: opts.payload_bytes.saturating_sub(24) };
    let args: Vec<_> = (0..opts.processes).map(|_| run_child(opts, names)).collect();
    let mut steady = Steady::start(opts, names, &args, plan, tally).await?;
    let first_statements = steady.statements().await?;
    let mut last: Reading = steady.reading().await?;
    // Latencies by the minute of their delivery (0 for the first).
    let mut by_minute: HashMap<u32, Vec<f64>> = HashMap::new();
    let mut closing: Vec<Closing> = Vec::new();
    let mut lines = Vec::new();
    let mut done_minutes = 0;
    while let Some(t) = steady.tick().await? {
        sort(&steady, opts.minutes, &mut by_minute);
        // The last minute closes with the production, which a late producer may prolong.
        if done_minutes + 1 < opts.minutes && t >= f64::from((done_minutes + 1) * 60) {
            let now = steady.reading().await?;
            done_minutes += 1;
            closing.push(Closing::new(&steady, &last, &now, done_minutes));
            last = now;
        }
        while closing.first().is_some_and(|c| t >= f64::from(c.minute * 60) + GRACE_S) {
            let c = closing.remove(0);
            let latencies = by_minute.remove(&(c.minute - 1)).unwrap_or_default();
            let line = c.line(latencies);
            eprintln!("{}", live_line(&line));
            lines.push(line);
        }
    }
    if done_minutes < opts.minutes {
        let now = steady.reading().await?;
        closing.push(Closing::new(&steady, &last, &now, opts.minutes));
    }
    let backlog_at_end = steady.with_join(|j| j.backlog());
    sort(&steady, opts.minutes, &mut by_minute);
    for c in closing {
        let latencies = by_minute.remove(&(c.minute - 1)).unwrap_or_default();
        let line = c.line(latencies);
        eprintln!("{}", live_line(&line));
        lines.push(line);
    }
    let last_statements = steady.statements().await?;
    let undelivered = steady.drain(DRAIN_WITHIN).await?;
    let produced = steady.produced().cloned().unwrap_or_default();
    let (delivered, unmatched) = steady.with_join(|j| (j.arrivals, j.unmatched()));
    steady.stop().await?;
    Ok(Soak {
        rate,
        minutes: opts.minutes,
        producer: opts.producer,
        relay_args: opts.relay_args(),
        lines,
        backlog_at_end,
        undelivered,
        unmatched,
        produced,
        statements: first_statements.zip(last_statements).map(|(a, b)| a.top(&b, delivered)).unwrap_or_default(),
    })
}

/// Files the latencies matched since the last call by the minute of their delivery (the last
/// of the `minutes` takes every later one: a producer that fell behind commits after its end).
fn sort(steady: &Steady<'_>, minutes: u32, by_minute: &mut HashMap<u32, Vec<f64>>) {
    for s in steady.with_join(|j| j.take_samples()) {
        if s.arrival_s >= 0.0 {
            let minute = ((s.arrival_s / 60.0) as u32).min(minutes - 1);
            by_minute.entry(minute).or_default().push(s.latency_ms());
        }
    }
}

fn live_line(l: &SoakMinute) -> String {
    let ms = |f: fn(&Spread) -> f64| l.latency.as_ref().map_or_else(|| "-".to_owned(), |s| format!("{:.1}", f(s)));
    format!(
        "soak minute {}: {:.0}/s committed, {:.0}/s delivered, p50 {} ms, p99 {} ms, backlog {}, table {:.1} MiB, \
         indexes {:.1} MiB, {} dead tuples, relay RSS {:.1} MiB",
        l.minute,
        l.committed_per_s,
        l.delivered_per_s,
        ms(|s| s.p50_ms),
        ms(|s| s.p99_ms),
        l.backlog,
        l.table_bytes as f64 / MIB,
        l.indexes_bytes as f64 / MIB,
        l.dead_tuples,
        l.relay_rss_mib
    )
}

/// The phase's report: a line a minute.
pub(super) fn print(s: &Soak) {
    println!();
    println!(
        "soak: {} rows/s for {} minutes (producer: {}), relay: actix-outbox run {}",
        s.rate,
        s.minutes,
        match s.producer {
            ProducerKind::Bench => "the bench",
            ProducerKind::Pgbench => "pgbench",
        },
        if s.relay_args.is_empty() { "with its defaults".to_owned() } else { s.relay_args.join(" ") }
    );
    println!(
        "{:>4} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>8} {:>8} {:>6}",
        "min",
        "commit/s",
        "dlvr/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "backlog",
        "table MiB",
        "index MiB",
        "live",
        "dead",
        "rss MiB",
        "pg:relay",
        "pg:rest",
        "relay"
    );
    let ms = |l: &SoakMinute, f: fn(&Spread) -> f64| {
        l.latency.as_ref().map_or_else(|| "-".to_owned(), |s| format!("{:.1}", f(s)))
    };
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    for l in &s.lines {
        println!(
            "{:>4} {:>8.0} {:>8.0} {:>8} {:>8} {:>8} {:>8} {:>9.1} {:>9.1} {:>9} {:>9} {:>7.1} {:>8} {:>8} {:>6.0}",
            l.minute,
            l.committed_per_s,
            l.delivered_per_s,
            ms(l, |s| s.p50_ms),
            ms(l, |s| s.p99_ms),
            ms(l, |s| s.max_ms),
            l.backlog,
            l.table_bytes as f64 / MIB,
            l.indexes_bytes as f64 / MIB,
            l.live_tuples,
            l.dead_tuples,
            l.relay_rss_mib,
            us(l.cost.pg_relay_us),
            us(l.cost.pg_rest_us),
            l.cost.relay_us
        );
    }
    println!(
        "at the production's end: backlog {} rows, {} still undelivered {} s later; {} deliveries matched no commit",
        s.backlog_at_end,
        s.undelivered,
        DRAIN_WITHIN.as_secs(),
        s.unmatched
    );
    for line in &s.produced.summary {
        println!("pgbench: {line}");
    }
    println!(
        "commit/s = rows committed a second in the minute, dlvr/s = delivered; p* = commit → consumer of the rows"
    );
    println!(
        "delivered in the minute; backlog = committed, not yet delivered at its end; table, index = pg_relation_size,"
    );
    println!("pg_indexes_size of the outbox; live, dead = its tuples (pg_stat_user_tables); rss = the relay's VmRSS;");
    print_cpu_legend();
    if !s.statements.is_empty() {
        println!("statements over the soak:");
        statements::print(&s.statements);
    }
}
