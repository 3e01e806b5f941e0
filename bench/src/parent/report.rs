//! One run's figures, their median over the runs, and the report: a table, or `--json`.

use serde::Serialize;

use super::drain_curve::DrainCurve;
use super::horizon::Horizon;
use super::meter::{WindowCost, median_cost, print_cost_header, print_cost_legend, print_cost_row};
use super::soak::Soak;
use super::statements;
use super::stats::median;
use crate::{Opts, Phase, ProducerKind, RetentionArg};

/// One run's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct RunResult {
    pub(super) broker_ceiling_msg_s: Option<f64>,
    pub(super) database_ceiling_msg_s: Option<f64>,
    pub(super) end_to_end_msg_s: Option<f64>,
    pub(super) ratio: Option<f64>,
    /// Busy CPU time of the whole machine per message, in microseconds, for the broker
    /// ceiling, the database ceiling and end to end.
    pub(super) broker_cpu_us_per_msg: Option<f64>,
    pub(super) database_cpu_us_per_msg: Option<f64>,
    pub(super) end_to_end_cpu_us_per_msg: Option<f64>,
    /// CPU time of the dispatcher processes alone per message, in microseconds, in the
    /// database-ceiling and end-to-end phases.
    pub(super) database_dispatcher_us_per_msg: Option<f64>,
    pub(super) end_to_end_dispatcher_us_per_msg: Option<f64>,
    /// CPU time of the PostgreSQL and of the RabbitMQ processes per message end to end, in
    /// microseconds (parts of `end_to_end_cpu_us_per_msg`).
    pub(super) end_to_end_postgres_us_per_msg: Option<f64>,
    pub(super) end_to_end_rabbitmq_us_per_msg: Option<f64>,
    /// WAL the server wrote per message end to end, in bytes (`pg_current_wal_lsn()` before
    /// and after: the whole cluster's, so the benchmark's own bookkeeping is in it too).
    pub(super) end_to_end_wal_bytes_per_msg: Option<f64>,
    pub(super) latency_confirm_p50_ms: Option<f64>,
    pub(super) latency_confirm_p99_ms: Option<f64>,
    pub(super) latency_delivery_p50_ms: Option<f64>,
    pub(super) latency_delivery_p99_ms: Option<f64>,
    /// Largest `VmHWM` of the dispatcher processes, over the phases that ran them.
    pub(super) peak_rss_mib: Option<f64>,
    /// Duplicate deliveries the consumer saw in the end-to-end phase (at-least-once).
    pub(super) end_to_end_duplicates: usize,
    /// Most messages confirmed (rows done) but not yet at the consumer at once, end to end:
    /// a consumer that falls behind makes the broker queue (and store) messages.
    pub(super) end_to_end_consumer_lag: Option<u64>,
    /// The loaded-latency phase.
    pub(super) loaded: Option<Loaded>,
    /// The history phase: end to end beside `--kept-done` kept rows.
    pub(super) history_msg_s: Option<f64>,
    /// History ÷ end to end, same run.
    pub(super) history_ratio: Option<f64>,
    pub(super) history_postgres_us_per_msg: Option<f64>,
    pub(super) history_wal_bytes_per_msg: Option<f64>,
    /// With `--pgbouncer` or `--pooler-url`: the dispatcher phases direct and through the pooler.
    pub(super) pooler: Option<PoolerRun>,
}

/// What a phase cost per message: PostgreSQL's CPU, and through a pooler the bouncer's CPU and
/// the transactions it passed to the server.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct Cost {
    /// CPU time of every `postgres` process over the phase ÷ its messages, microseconds.
    pub(super) postgres_us_per_msg: Option<f64>,
    /// CPU time of the bench's own PgBouncer over the phase ÷ its messages, microseconds.
    pub(super) bouncer_us_per_msg: Option<f64>,
    /// `SHOW STATS` `total_xact_count` of the bench's database over the phase ÷ its messages.
    pub(super) bouncer_xacts_per_msg: Option<f64>,
}

/// One dispatcher phase on one way to the database (direct, or through the pooler).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct Way {
    /// Messages a second the dispatcher delivered: end to end, rows ÷ the phase's time; in the
    /// latency phases, rows ÷ the time from the first commit to the last delivery.
    pub(super) msg_s: f64,
    /// Commit → consumer delivery, milliseconds (latency phases).
    pub(super) p50_ms: Option<f64>,
    pub(super) p99_ms: Option<f64>,
    #[serde(flatten)]
    pub(super) cost: Cost,
}

/// One phase run direct, then through the pooler, in the same run.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct Pair {
    pub(super) direct: Way,
    pub(super) pooled: Way,
    /// pooled ÷ direct of the rate.
    pub(super) rate_ratio: f64,
    /// pooled ÷ direct of the p99 (latency phases).
    pub(super) p99_ratio: Option<f64>,
}

impl Pair {
    pub(super) fn new(direct: Way, pooled: Way) -> Self {
        Self {
            direct,
            pooled,
            rate_ratio: pooled.msg_s / direct.msg_s,
            p99_ratio: direct.p99_ms.zip(pooled.p99_ms).map(|(d, p)| p / d),
        }
    }
}

/// The phases `--pgbouncer` (or `--pooler-url`) runs twice, of one run.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct PoolerRun {
    pub(super) e2e: Option<Pair>,
    pub(super) latency: Option<Pair>,
    pub(super) loaded: Option<Pair>,
}

/// Latency under a steady load: single-row commits at `--rate` for `--seconds`.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Loaded {
    pub(super) target_rate: f64,
    pub(super) seconds: u32,
    pub(super) producer: ProducerKind,
    /// Rows committed ÷ the time from the first slot to the last commit.
    pub(super) achieved_rate: f64,
    pub(super) rows: usize,
    /// Commit → consumer delivery, milliseconds.
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) p999_ms: f64,
    pub(super) max_ms: f64,
    /// The database's own `done_at - created_at` (the finalize's clock), milliseconds.
    pub(super) db_done_p50_ms: Option<f64>,
    pub(super) db_done_p99_ms: Option<f64>,
    /// What the database did per row over the phase (`pg_stat_database` of the bench's
    /// database), the producers' own commits taken out: the dispatchers' transactions.
    pub(super) dispatcher_xacts_per_row: f64,
    /// Buffer hits per row, everyone's (producers' inserts included).
    pub(super) blks_hit_per_row: f64,
    /// WAL bytes per row, everyone's.
    pub(super) wal_bytes_per_row: f64,
    /// What each message cost over the production's last two thirds.
    pub(super) cost: Option<WindowCost>,
    /// pgbench's own summary lines (with `--producer pgbench`).
    pub(super) pgbench: Vec<String>,
}

#[derive(Serialize)]
pub(super) struct Report<'a> {
    pub(super) date: String,
    pub(super) machine: Machine,
    pub(super) options: &'a Opts,
    pub(super) in_flight_per_process: usize,
    /// The transaction pooler the pooled phases went through.
    pub(super) pooler: Option<String>,
    pub(super) runs: Vec<RunResult>,
    pub(super) median: RunResult,
    /// The drain phase's two curves, unpaced then paced.
    pub(super) drain: Option<Vec<DrainCurve>>,
    /// The held-horizon phase.
    pub(super) horizon: Option<Horizon>,
    /// The soak phase.
    pub(super) soak: Option<Soak>,
}

#[derive(Serialize)]
pub(super) struct Machine {
    pub(super) cores: usize,
    pub(super) postgres: String,
    pub(super) note: &'static str,
    /// The broker and the queue: one node, or the bench's cluster.
    pub(super) broker: &'static str,
    /// The PostgreSQL server: the bench's own, or `--database-url`'s, and its `autovacuum`.
    pub(super) server: String,
    pub(super) autovacuum: String,
}

pub(super) fn median_of(runs: &[RunResult]) -> RunResult {
    let m = |f: fn(&RunResult) -> Option<f64>| {
        let values: Vec<f64> = runs.iter().filter_map(f).collect();
        (!values.is_empty()).then(|| median(values))
    };
    RunResult {
        broker_ceiling_msg_s: m(|r| r.broker_ceiling_msg_s),
        database_ceiling_msg_s: m(|r| r.database_ceiling_msg_s),
        end_to_end_msg_s: m(|r| r.end_to_end_msg_s),
        ratio: m(|r| r.ratio),
        broker_cpu_us_per_msg: m(|r| r.broker_cpu_us_per_msg),
        database_cpu_us_per_msg: m(|r| r.database_cpu_us_per_msg),
        end_to_end_cpu_us_per_msg: m(|r| r.end_to_end_cpu_us_per_msg),
        database_dispatcher_us_per_msg: m(|r| r.database_dispatcher_us_per_msg),
        end_to_end_dispatcher_us_per_msg: m(|r| r.end_to_end_dispatcher_us_per_msg),
        end_to_end_postgres_us_per_msg: m(|r| r.end_to_end_postgres_us_per_msg),
        end_to_end_rabbitmq_us_per_msg: m(|r| r.end_to_end_rabbitmq_us_per_msg),
        end_to_end_wal_bytes_per_msg: m(|r| r.end_to_end_wal_bytes_per_msg),
        history_msg_s: m(|r| r.history_msg_s),
        history_ratio: m(|r| r.history_ratio),
        history_postgres_us_per_msg: m(|r| r.history_postgres_us_per_msg),
        history_wal_bytes_per_msg: m(|r| r.history_wal_bytes_per_msg),
        latency_confirm_p50_ms: m(|r| r.latency_confirm_p50_ms),
        latency_confirm_p99_ms: m(|r| r.latency_confirm_p99_ms),
        latency_delivery_p50_ms: m(|r| r.latency_delivery_p50_ms),
        latency_delivery_p99_ms: m(|r| r.latency_delivery_p99_ms),
        peak_rss_mib: m(|r| r.peak_rss_mib),
        end_to_end_duplicates: runs.iter().map(|r| r.end_to_end_duplicates).max().unwrap_or(0),
        end_to_end_consumer_lag: runs.iter().filter_map(|r| r.end_to_end_consumer_lag).max(),
        pooler: median_pooler(runs),
        loaded: {
            let loaded: Vec<&Loaded> = runs.iter().filter_map(|r| r.loaded.as_ref()).collect();
            let m = |f: fn(&Loaded) -> f64| median(loaded.iter().map(|l| f(l)).collect());
            let o = |f: fn(&Loaded) -> Option<f64>| {
                let v: Vec<f64> = loaded.iter().filter_map(|l| f(l)).collect();
                (!v.is_empty()).then(|| median(v))
            };
            (!loaded.is_empty()).then(|| Loaded {
                target_rate: m(|l| l.target_rate),
                seconds: loaded[0].seconds,
                producer: loaded[0].producer,
                achieved_rate: m(|l| l.achieved_rate),
                rows: loaded[0].rows,
                p50_ms: m(|l| l.p50_ms),
                p99_ms: m(|l| l.p99_ms),
                p999_ms: m(|l| l.p999_ms),
                max_ms: m(|l| l.max_ms),
                db_done_p50_ms: o(|l| l.db_done_p50_ms),
                db_done_p99_ms: o(|l| l.db_done_p99_ms),
                dispatcher_xacts_per_row: m(|l| l.dispatcher_xacts_per_row),
                blks_hit_per_row: m(|l| l.blks_hit_per_row),
                wal_bytes_per_row: m(|l| l.wal_bytes_per_row),
                cost: median_cost(&loaded.iter().filter_map(|l| l.cost.as_ref()).collect::<Vec<_>>()),
                pgbench: Vec::new(),
            })
        },
    }
}

/// Picks one phase's comparison out of a run's.
type PhaseOf = fn(&PoolerRun) -> Option<Pair>;

/// The median of each figure of the runs' pooler comparisons.
fn median_pooler(runs: &[RunResult]) -> Option<PoolerRun> {
    let pooler: Vec<&PoolerRun> = runs.iter().filter_map(|r| r.pooler.as_ref()).collect();
    if pooler.is_empty() {
        return None;
    }
    let pair = |phase: PhaseOf| {
        let pairs: Vec<Pair> = pooler.iter().filter_map(|p| phase(p)).collect();
        if pairs.is_empty() {
            return None;
        }
        let way = |side: fn(&Pair) -> Way| {
            let ways: Vec<Way> = pairs.iter().map(side).collect();
            let o = |f: fn(&Way) -> Option<f64>| {
                let v: Vec<f64> = ways.iter().filter_map(f).collect();
                (!v.is_empty()).then(|| median(v))
            };
            Way {
                msg_s: median(ways.iter().map(|w| w.msg_s).collect()),
                p50_ms: o(|w| w.p50_ms),
                p99_ms: o(|w| w.p99_ms),
                cost: Cost {
                    postgres_us_per_msg: o(|w| w.cost.postgres_us_per_msg),
                    bouncer_us_per_msg: o(|w| w.cost.bouncer_us_per_msg),
                    bouncer_xacts_per_msg: o(|w| w.cost.bouncer_xacts_per_msg),
                },
            }
        };
        let ratios: Vec<f64> = pairs.iter().filter_map(|p| p.p99_ratio).collect();
        Some(Pair {
            direct: way(|p| p.direct),
            pooled: way(|p| p.pooled),
            // The median of the runs' ratios, not the ratio of the medians.
            rate_ratio: median(pairs.iter().map(|p| p.rate_ratio).collect()),
            p99_ratio: (!ratios.is_empty()).then(|| median(ratios)),
        })
    };
    Some(PoolerRun { e2e: pair(|p| p.e2e), latency: pair(|p| p.latency), loaded: pair(|p| p.loaded) })
}

pub(super) fn print_report(report: &Report<'_>) {
    println!(
        "actix-outbox bench  {}  {} cores (shared by PostgreSQL {}, RabbitMQ, the dispatcher and the bench)",
        report.date, report.machine.cores, report.machine.postgres
    );
    println!("broker: {}", report.machine.broker);
    println!("database: {} (autovacuum {})", report.machine.server, report.machine.autovacuum);
    if !report.runs.is_empty() {
        print_runs(report);
    }
    if report.runs.iter().any(|r| r.loaded.is_some()) {
        print_loaded(report);
    }
    if report.runs.iter().any(|r| r.history_msg_s.is_some()) {
        print_history(report);
    }
    if report.runs.iter().any(|r| r.pooler.is_some()) {
        print_pooler(report);
    }
    if let Some(curves) = &report.drain {
        super::drain_curve::print(curves, report.options.messages);
    }
    if let Some(horizon) = &report.horizon {
        super::horizon::print(horizon);
    }
    if let Some(soak) = &report.soak {
        super::soak::print(soak);
    }
}

/// The phases of every run: a line a run, and their median.
fn print_runs(report: &Report<'_>) {
    let o = report.options;
    println!(
        "messages {}  payload ~{} B  workers {}  batch {}  in flight {}/process  processes {}  fifo {}  retention {}  headers {}  runs {}",
        o.messages,
        o.payload_bytes,
        o.workers,
        o.batch,
        report.in_flight_per_process,
        o.processes,
        if o.fifo { "on (1,000 aggregates)" } else { "off" },
        if o.retention == RetentionArg::Delete { "delete" } else { "keep" },
        if o.no_outbox_headers { "none" } else { "outbox" },
        o.runs
    );
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    let rate = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{:.0}%", v * 100.0));
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    let columns = [
        ("run", 8),
        ("broker/s", 9),
        ("db/s", 9),
        ("e2e/s", 9),
        ("ratio", 6),
        ("cpu:broker", 10),
        ("cpu:db", 7),
        ("cpu:e2e", 8),
        ("disp:db", 8),
        ("disp:e2e", 8),
        ("pg:e2e", 7),
        ("mq:e2e", 7),
        ("wal:e2e", 7),
        ("conf p50", 9),
        ("conf p99", 9),
        ("dlv p50", 8),
        ("dlv p99", 8),
        ("rss MiB", 8),
        ("dups", 5),
    ];
    let line = |cells: &[String]| {
        let text: Vec<String> = cells
            .iter()
            .zip(columns)
            .enumerate()
            .map(|(i, (cell, (_, w)))| if i == 0 { format!("{cell:<w$}") } else { format!("{cell:>w$}") })
            .collect();
        println!("{}", text.join(" "));
    };
    line(&columns.map(|(name, _)| name.to_owned()));
    let row = |name: &str, r: &RunResult| {
        line(&[
            name.to_owned(),
            rate(r.broker_ceiling_msg_s),
            rate(r.database_ceiling_msg_s),
            rate(r.end_to_end_msg_s),
            pct(r.ratio),
            us(r.broker_cpu_us_per_msg),
            us(r.database_cpu_us_per_msg),
            us(r.end_to_end_cpu_us_per_msg),
            us(r.database_dispatcher_us_per_msg),
            us(r.end_to_end_dispatcher_us_per_msg),
            us(r.end_to_end_postgres_us_per_msg),
            us(r.end_to_end_rabbitmq_us_per_msg),
            us(r.end_to_end_wal_bytes_per_msg),
            ms(r.latency_confirm_p50_ms),
            ms(r.latency_confirm_p99_ms),
            ms(r.latency_delivery_p50_ms),
            ms(r.latency_delivery_p99_ms),
            ms(r.peak_rss_mib),
            r.end_to_end_duplicates.to_string(),
        ])
    };
    for (i, r) in report.runs.iter().enumerate() {
        row(&format!("{}", i + 1), r);
    }
    row(&format!("median/{}", report.runs.len()), &report.median);
    println!(
        "broker = raw lapin, no database (msg/s); db = the dispatcher with a do-nothing sink; e2e = the dispatcher"
    );
    println!("with the RabbitMQ sink, to every row done and every id at the consumer; ratio = e2e / min(broker, db);");
    println!("cpu:* = busy CPU time of the whole machine per message in that phase (us, all processes);");
    println!("disp:* = CPU time of the dispatcher processes alone per message (us);");
    println!("pg:e2e, mq:e2e = CPU time of the PostgreSQL, of the RabbitMQ processes per message end to end (us);");
    println!("wal:e2e = WAL bytes the server wrote per message end to end;");
    println!(
        "conf/dlv = idle latency (ms, {} rows {} apart) from the producer's commit to the sink's publisher confirm / to",
        o.latency_samples,
        humantime::format_duration(o.latency_interval)
    );
    println!(
        "the consumer's delivery; rss = largest peak RSS (VmHWM) of one dispatcher process; dups = duplicate deliveries."
    );
}

/// The pooled phases beside the direct ones: one line per phase and run, direct and pooled side
/// by side.
fn print_pooler(report: &Report<'_>) {
    println!();
    println!("through a transaction pooler: {}", report.pooler.as_deref().unwrap_or("-"));
    let header = [
        "phase", "run", "direct/s", "pooled/s", "rate x", "p50 dir", "p50 pool", "p99 dir", "p99 pool", "p99 x",
        "pg:dir", "pg:pool", "pgb:pool", "xact/msg",
    ];
    let widths = [7, 8, 9, 9, 7, 8, 8, 8, 8, 6, 7, 7, 8, 8];
    let line = |cells: &[String]| {
        let text: Vec<String> = cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (cell, w))| if i < 2 { format!("{cell:<w$}") } else { format!("{cell:>w$}") })
            .collect();
        println!("{}", text.join(" "));
    };
    line(&header.map(str::to_owned));
    let f = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"));
    let x = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}x"));
    let row = |phase: &str, run: &str, p: &Pair| {
        line(&[
            phase.to_owned(),
            run.to_owned(),
            f(Some(p.direct.msg_s), 0),
            f(Some(p.pooled.msg_s), 0),
            x(Some(p.rate_ratio)),
            f(p.direct.p50_ms, 1),
            f(p.pooled.p50_ms, 1),
            f(p.direct.p99_ms, 1),
            f(p.pooled.p99_ms, 1),
            x(p.p99_ratio),
            f(p.direct.cost.postgres_us_per_msg, 0),
            f(p.pooled.cost.postgres_us_per_msg, 0),
            f(p.pooled.cost.bouncer_us_per_msg, 0),
            f(p.pooled.cost.bouncer_xacts_per_msg, 2),
        ])
    };
    let phases: [(&str, PhaseOf); 3] = [("e2e", |p| p.e2e), ("latency", |p| p.latency), ("loaded", |p| p.loaded)];
    for (name, phase) in phases {
        for (i, r) in report.runs.iter().enumerate() {
            if let Some(pair) = r.pooler.as_ref().and_then(phase) {
                row(name, &format!("{}", i + 1), &pair);
            }
        }
        if let Some(pair) = report.median.pooler.as_ref().and_then(phase) {
            row(name, &format!("median/{}", report.runs.len()), &pair);
        }
    }
    println!("each phase runs direct, then through the pooler, in the same run; direct/s, pooled/s = messages a");
    println!("second the dispatcher delivered (e2e: rows ÷ the phase; latency, loaded: rows ÷ first commit to last");
    println!("delivery); p50/p99 = commit → consumer delivery (ms); rate x, p99 x = pooled ÷ direct (medians: of");
    println!("the runs' ratios); pg = PostgreSQL CPU (us/msg), pgb = the bouncer's own CPU (us/msg); xact/msg =");
    println!("transactions the bouncer passed to the server per message (SHOW STATS). Seeding, the latency rows and");
    println!("the loaded producers go direct; the dispatcher's listener goes direct (its --direct-url). The first");
    println!("table's dups and rss count the pooled halves too.");
}

fn print_history(report: &Report<'_>) {
    let o = report.options;
    println!();
    println!(
        "history: {} new rows beside {} kept done rows, with the RabbitMQ sink and the consumer",
        o.messages, o.kept_done
    );
    println!(
        "{:<8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "run", "e2e/s", "hist/s", "vs e2e", "pg:e2e", "pg:hist", "wal:e2e", "wal:hist"
    );
    let cell = |v: Option<f64>, f: fn(f64) -> String| v.map_or_else(|| "-".to_owned(), f);
    let row = |name: &str, r: &RunResult| {
        println!(
            "{:<8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
            name,
            cell(r.end_to_end_msg_s, |v| format!("{v:.0}")),
            cell(r.history_msg_s, |v| format!("{v:.0}")),
            cell(r.history_ratio, |v| format!("{v:.2}x")),
            cell(r.end_to_end_postgres_us_per_msg, |v| format!("{v:.0}")),
            cell(r.history_postgres_us_per_msg, |v| format!("{v:.0}")),
            cell(r.end_to_end_wal_bytes_per_msg, |v| format!("{v:.0}")),
            cell(r.history_wal_bytes_per_msg, |v| format!("{v:.0}")),
        )
    };
    for (i, r) in report.runs.iter().enumerate() {
        row(&format!("{}", i + 1), r);
    }
    row(&format!("median/{}", report.runs.len()), &report.median);
    println!("vs e2e = hist/s ÷ e2e/s of the same run; pg = PostgreSQL CPU (us/msg); wal = WAL bytes/msg.");
}

fn print_loaded(report: &Report<'_>) {
    let o = report.options;
    println!();
    println!(
        "loaded latency: {} rows/s for {} s, one row per transaction on {} {} connections, {} dispatcher process(es)",
        o.rate(Phase::Loaded),
        o.seconds(Phase::Loaded),
        o.producers,
        match o.producer {
            ProducerKind::Bench => "producer",
            ProducerKind::Pgbench => "pgbench",
        },
        o.processes
    );
    println!(
        "{:<8} {:>9} {:>7} {:>8} {:>8} {:>9} {:>8} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "run",
        "rows/s",
        "rows",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
        "db p50 ms",
        "db p99 ms",
        "xact/row",
        "hits/row",
        "wal/row"
    );
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    let row = |name: &str, l: &Loaded| {
        println!(
            "{:<8} {:>9.0} {:>7} {:>8.1} {:>8.1} {:>9.1} {:>8.1} {:>10} {:>10} {:>8.2} {:>8.1} {:>8.0}",
            name,
            l.achieved_rate,
            l.rows,
            l.p50_ms,
            l.p99_ms,
            l.p999_ms,
            l.max_ms,
            ms(l.db_done_p50_ms),
            ms(l.db_done_p99_ms),
            l.dispatcher_xacts_per_row,
            l.blks_hit_per_row,
            l.wal_bytes_per_row
        )
    };
    for (i, r) in report.runs.iter().enumerate() {
        if let Some(l) = &r.loaded {
            row(&format!("{}", i + 1), l);
        }
    }
    if let Some(l) = &report.median.loaded {
        row(&format!("median/{}", report.runs.len()), l);
    }
    println!(
        "rows/s = achieved (rows ÷ first slot to last commit); p* = commit ({}) → consumer",
        match o.producer {
            ProducerKind::Bench => "the INSERT returned",
            ProducerKind::Pgbench => "the row's created_at",
        }
    );
    println!("delivery; db = done_at − created_at on the database clock (to the finalize's commit); xact/row =");
    println!("the dispatchers' transactions per row (pg_stat_database xact_commit less the producers' commits and");
    println!("the bench's own), hits/row = buffer hits per row (blks_hit), wal/row = WAL bytes per row, over the");
    println!("whole phase.");
    if let Some(l) = report.runs.iter().rev().find_map(|r| r.loaded.as_ref().filter(|l| !l.pgbench.is_empty())) {
        for line in &l.pgbench {
            println!("pgbench, last run: {line}");
        }
    }
    let costs: Vec<(String, &WindowCost)> = report
        .runs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((format!("{}", i + 1), r.loaded.as_ref()?.cost.as_ref()?)))
        .collect();
    if costs.is_empty() {
        return;
    }
    println!();
    println!("loaded latency, cost per message over the production's last two thirds (the first warms up):");
    print_cost_header();
    for (name, cost) in &costs {
        print_cost_row(name, cost);
    }
    if let Some(cost) = report.median.loaded.as_ref().and_then(|l| l.cost.as_ref()) {
        print_cost_row(&format!("median/{}", report.runs.len()), cost);
    }
    let last = costs.last().map(|(_, c)| *c);
    print_cost_legend(last.and_then(|c| c.pg_rest.as_ref()));
    if let Some(last) = last.filter(|c| !c.statements.is_empty()) {
        println!("statements of the last run's window:");
        statements::print(&last.statements);
    }
}
