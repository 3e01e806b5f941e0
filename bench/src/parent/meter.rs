//! What a steady phase costs, between two instants: every counter read at one instant (a
//! [`Reading`]), and what two readings say per message (a [`WindowCost`]).
//!
//! CPU comes from `/proc`: PostgreSQL's by role ([`PgProcs`]), the relay processes', RabbitMQ's
//! (`beam.smp`), the bench's own and the whole machine's. The database's counters come from
//! its statistics views, which each backend updates when its transactions end (at most a
//! second late), so over a window of many seconds they are a fair account.

use std::time::Instant;

use diesel::sql_types::{BigInt, Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::Serialize;

use super::bench_conn::BenchConn;
use super::pg_procs::{PgProcs, RoleSeconds};
use super::statements::StatementCost;
use super::stats::median;
use crate::BoxError;
use crate::procstat::{Server, ServerTicks, machine_busy_seconds, own_cpu_seconds, process_cpu_seconds, rss_kib};

/// The bench database's counters: its transactions and buffer hits (`pg_stat_database`, as its
/// backends have reported them), and the server's WAL position.
#[derive(Debug, Clone, Copy, diesel::QueryableByName)]
pub(super) struct DbCounters {
    #[diesel(sql_type = BigInt)]
    pub(super) xact_commit: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) blks_hit: i64,
    #[diesel(sql_type = Double)]
    pub(super) wal_bytes: f64,
}

impl DbCounters {
    pub(super) async fn read(db: &mut AsyncPgConnection) -> Result<Self, BoxError> {
        // A snapshot of the statistics is cached for the transaction: clear it to read them now.
        db.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
        Ok(diesel::sql_query(
            "SELECT xact_commit, blks_hit, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS wal_bytes
             FROM pg_stat_database WHERE datname = current_database()",
        )
        .get_result(db)
        .await?)
    }
}

/// The outbox table's counters (`pg_stat_user_tables`) and sizes.
#[derive(Debug, Clone, diesel::QueryableByName)]
pub(super) struct TableStats {
    #[diesel(sql_type = BigInt)]
    pub(super) n_tup_upd: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) n_tup_hot_upd: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) n_live_tup: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) n_dead_tup: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) autovacuum_count: i64,
    /// `pg_relation_size` (the heap) and `pg_indexes_size` (every index), bytes.
    #[diesel(sql_type = BigInt)]
    pub(super) table_bytes: i64,
    #[diesel(sql_type = BigInt)]
    pub(super) indexes_bytes: i64,
    /// Each index as `name=bytes`, comma-separated.
    #[diesel(sql_type = Text)]
    pub(super) index_sizes: String,
}

impl TableStats {
    async fn read(db: &mut AsyncPgConnection) -> Result<Self, BoxError> {
        Ok(diesel::sql_query(
            "SELECT t.n_tup_upd, t.n_tup_hot_upd, t.n_live_tup, t.n_dead_tup, t.autovacuum_count,
                    pg_relation_size(t.relid) AS table_bytes, pg_indexes_size(t.relid) AS indexes_bytes,
                    coalesce((SELECT string_agg(i.indexrelid::regclass::text || '=' || pg_relation_size(i.indexrelid),
                                                ',' ORDER BY i.indexrelid::regclass::text)
                              FROM pg_index i WHERE i.indrelid = t.relid), '') AS index_sizes
             FROM pg_stat_user_tables t WHERE t.relid = 'outbox'::regclass",
        )
        .get_result(db)
        .await?)
    }

    /// Each index's size, bytes.
    pub(super) fn indexes(&self) -> Vec<(String, i64)> {
        self.index_sizes
            .split(',')
            .filter_map(|pair| {
                let (name, bytes) = pair.rsplit_once('=')?;
                Some((name.to_owned(), bytes.parse().ok()?))
            })
            .collect()
    }
}

/// Every counter a window is measured by, at one instant.
pub(super) struct Reading {
    at: Instant,
    /// PostgreSQL's CPU by role so far (`None`: the server is not on this machine).
    pg: Option<RoleSeconds>,
    /// CPU seconds of the relay processes so far.
    relay_cpu: f64,
    rabbitmq: ServerTicks,
    bench_cpu: Option<f64>,
    machine_busy: Option<f64>,
    pub(super) db: DbCounters,
    pub(super) table: TableStats,
    /// Rows committed and deliveries so far (the tally's join).
    pub(super) committed: u64,
    pub(super) delivered: u64,
    /// Transactions of the bench's own connections so far.
    bench_xacts: u64,
    /// The relay processes' resident set now, KiB (summed).
    pub(super) relay_rss_kib: u64,
}

/// What the reading needs to know besides the database.
pub(super) struct Now<'a> {
    pub(super) procs: Option<&'a PgProcs>,
    pub(super) relay_pids: &'a [u32],
    pub(super) committed: u64,
    pub(super) delivered: u64,
    pub(super) bench_xacts: u64,
}

impl Reading {
    /// Reads everything now (the caller has just sampled `procs`).
    pub(super) async fn take(conn: &mut BenchConn, now: Now<'_>) -> Result<Self, BoxError> {
        let at = Instant::now();
        let pg = now.procs.map(PgProcs::so_far);
        let pids = now.relay_pids.to_vec();
        // Off the bench's thread (a walk over every process), so that its consumer keeps noting
        // arrivals meanwhile.
        let (relay_cpu, relay_rss_kib, rabbitmq, bench_cpu, machine_busy) = tokio::task::spawn_blocking(move || {
            let relay_cpu: f64 = pids.iter().filter_map(|p| process_cpu_seconds(*p)).sum();
            let relay_rss_kib: u64 = pids.iter().map(|p| rss_kib(*p)).sum();
            (relay_cpu, relay_rss_kib, ServerTicks::read(), own_cpu_seconds(), machine_busy_seconds())
        })
        .await?;
        // Two statements each.
        conn.count();
        let db = DbCounters::read(conn.one()).await?;
        let table = TableStats::read(conn.one()).await?;
        Ok(Self {
            at,
            pg,
            relay_cpu,
            rabbitmq,
            bench_cpu,
            machine_busy,
            db,
            table,
            committed: now.committed,
            delivered: now.delivered,
            bench_xacts: now.bench_xacts,
            relay_rss_kib,
        })
    }

    /// Seconds from `earlier` to this reading.
    pub(super) fn since(&self, earlier: &Self) -> f64 {
        self.at.duration_since(earlier.at).as_secs_f64()
    }
}

/// What a window cost per message (a message: a delivery at the consumer in the window).
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct WindowCost {
    pub(super) seconds: f64,
    pub(super) messages: u64,
    pub(super) msg_s: f64,
    /// CPU per message, microseconds: PostgreSQL's backends of the relay, and the rest of
    /// PostgreSQL (its parts in `pg_rest`); the relay processes; RabbitMQ; the bench process
    /// (its producer, consumer and meters); the whole machine.
    pub(super) pg_relay_us: Option<f64>,
    pub(super) pg_rest_us: Option<f64>,
    pub(super) pg_rest: Option<RoleSeconds>,
    pub(super) relay_us: f64,
    pub(super) rabbitmq_us: Option<f64>,
    pub(super) bench_us: Option<f64>,
    pub(super) machine_us: Option<f64>,
    /// WAL bytes and shared-buffer hits per message (the server's WAL, the database's hits).
    pub(super) wal_bytes: f64,
    pub(super) blks_hit: f64,
    /// The relay's transactions per message: the database's commits less the producers' (one a
    /// row) and the bench's own.
    pub(super) relay_xacts: f64,
    /// Updates of the outbox table per message, and the share of them that were HOT (no index
    /// entry written).
    pub(super) updates: f64,
    pub(super) hot_share: Option<f64>,
    /// The outbox's dead tuples at the window's end, and autovacuum's runs on it in the window.
    pub(super) dead_tuples: i64,
    pub(super) autovacuums: i64,
    /// `pg_stat_statements` over the window, the costliest first (where the server has it).
    pub(super) statements: Vec<StatementCost>,
}

impl WindowCost {
    /// The window from `a` to `b`.
    pub(super) fn between(a: &Reading, b: &Reading) -> Self {
        let messages = b.delivered.saturating_sub(a.delivered);
        let per = 1e6 / messages.max(1) as f64;
        let seconds = b.since(a);
        let pg = a.pg.zip(b.pg).map(|(a, b)| b.since(&a));
        let pg_rest = pg.map(|p| RoleSeconds { relay: 0.0, ..p }.scaled(per));
        let count = |f: fn(&Reading) -> f64| (f(b) - f(a)) / messages.max(1) as f64;
        let updates = b.table.n_tup_upd - a.table.n_tup_upd;
        let hot = b.table.n_tup_hot_upd - a.table.n_tup_hot_upd;
        let commits = (b.db.xact_commit - a.db.xact_commit) as f64;
        let others = (b.committed - a.committed + b.bench_xacts - a.bench_xacts) as f64;
        Self {
            seconds,
            messages,
            msg_s: messages as f64 / seconds.max(1e-9),
            pg_relay_us: pg.map(|p| p.relay * per),
            pg_rest_us: pg_rest.map(|p| p.total()),
            pg_rest,
            relay_us: (b.relay_cpu - a.relay_cpu) * per,
            rabbitmq_us: Some(a.rabbitmq.spent_since(&b.rabbitmq, Server::Rabbitmq) * per).filter(|v| *v > 0.0),
            bench_us: a.bench_cpu.zip(b.bench_cpu).map(|(a, b)| (b - a) * per),
            machine_us: a.machine_busy.zip(b.machine_busy).map(|(a, b)| (b - a) * per),
            wal_bytes: count(|r| r.db.wal_bytes),
            blks_hit: count(|r| r.db.blks_hit as f64),
            relay_xacts: (commits - others) / messages.max(1) as f64,
            updates: updates as f64 / messages.max(1) as f64,
            hot_share: (updates > 0).then(|| hot as f64 / updates as f64),
            dead_tuples: b.table.n_dead_tup,
            autovacuums: b.table.autovacuum_count - a.table.autovacuum_count,
            statements: Vec::new(),
        }
    }
}

/// The median of each figure of `costs` (the statements are not: each run lists its own).
pub(super) fn median_cost(costs: &[&WindowCost]) -> Option<WindowCost> {
    if costs.is_empty() {
        return None;
    }
    let m = |f: fn(&WindowCost) -> f64| median(costs.iter().map(|c| f(c)).collect());
    let o = |f: fn(&WindowCost) -> Option<f64>| {
        let v: Vec<f64> = costs.iter().filter_map(|c| f(c)).collect();
        (!v.is_empty()).then(|| median(v))
    };
    Some(WindowCost {
        seconds: m(|c| c.seconds),
        messages: m(|c| c.messages as f64) as u64,
        msg_s: m(|c| c.msg_s),
        pg_relay_us: o(|c| c.pg_relay_us),
        pg_rest_us: o(|c| c.pg_rest_us),
        pg_rest: None,
        relay_us: m(|c| c.relay_us),
        rabbitmq_us: o(|c| c.rabbitmq_us),
        bench_us: o(|c| c.bench_us),
        machine_us: o(|c| c.machine_us),
        wal_bytes: m(|c| c.wal_bytes),
        blks_hit: m(|c| c.blks_hit),
        relay_xacts: m(|c| c.relay_xacts),
        updates: m(|c| c.updates),
        hot_share: o(|c| c.hot_share),
        dead_tuples: m(|c| c.dead_tuples as f64) as i64,
        autovacuums: m(|c| c.autovacuums as f64) as i64,
        statements: Vec::new(),
    })
}

/// The header of [`print_cost_row`]'s lines.
pub(super) fn print_cost_header() {
    println!(
        "{:<8} {:>6} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>6} {:>6} {:>9} {:>4}",
        "run",
        "window",
        "msgs/s",
        "pg:relay",
        "pg:rest",
        "relay",
        "mq",
        "bench",
        "machine",
        "wal B",
        "hits",
        "xact",
        "upd",
        "hot",
        "dead",
        "av"
    );
}

/// One window's cost on a line.
pub(super) fn print_cost_row(name: &str, c: &WindowCost) {
    let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    println!(
        "{:<8} {:>5.0}s {:>7.0} {:>8} {:>8} {:>8.0} {:>8} {:>8} {:>8} {:>8.0} {:>7.1} {:>8.2} {:>6.2} {:>6} {:>9} {:>4}",
        name,
        c.seconds,
        c.msg_s,
        us(c.pg_relay_us),
        us(c.pg_rest_us),
        c.relay_us,
        us(c.rabbitmq_us),
        us(c.bench_us),
        us(c.machine_us),
        c.wal_bytes,
        c.blks_hit,
        c.relay_xacts,
        c.updates,
        c.hot_share.map_or_else(|| "-".to_owned(), |h| format!("{:.0}%", h * 100.0)),
        c.dead_tuples,
        c.autovacuums
    );
}

/// What the CPU columns of the held-horizon and soak tables mean.
pub(super) fn print_cpu_legend() {
    println!(
        "pg:relay, pg:rest, relay = CPU µs per message delivered: PostgreSQL's backends of the relay (every backend"
    );
    println!("of the bench's database but the producers' and the bench's own), the rest of PostgreSQL (producers,");
    println!(
        "autovacuum, checkpointer, WAL writer, ...), the relay processes; --json has the rest of each window's cost."
    );
}

/// What the cost columns mean, and where the rest of PostgreSQL's CPU went.
pub(super) fn print_cost_legend(rest: Option<&RoleSeconds>) {
    println!("per message delivered in the window (µs of CPU): pg:relay = PostgreSQL's backends of the relay (every");
    println!(
        "backend of the bench's database but the producers' and the bench's own), pg:rest = the rest of PostgreSQL"
    );
    println!("(producers, autovacuum, checkpointer, WAL writer, ...), relay = the relay processes, mq = RabbitMQ");
    println!("(beam.smp), bench = this process (producer, consumer, meters), machine = every core's busy time;");
    println!("wal B = WAL bytes, hits = shared-buffer hits, xact = the relay's transactions, upd = updates of the");
    println!(
        "outbox, hot = their HOT share; dead = the outbox's dead tuples at the window's end, av = autovacuums of it."
    );
    if let Some(r) = rest {
        println!(
            "pg:rest of the last run, µs/msg: producers {:.0}, autovacuum {:.0}, background {:.0}, exited between samples {:.0}, bench {:.0}, other databases {:.0}",
            r.producers, r.autovacuum, r.background, r.exited, r.bench, r.others
        );
    }
}
