//! The benchmark: the dispatcher's throughput and latency beside the raw ceilings of the same
//! machine, all measured in one run.
//!
//! ```text
//! cargo run --release -p actix-outbox-bench -- --messages 100000
//! cargo run --release -p actix-outbox-bench -- --phases e2e,latency,loaded --pgbouncer --runs 3
//! cargo run --release -p actix-outbox-bench -- --pg-own --phases horizon
//! cargo run --release -p actix-outbox-bench -- --pg-own --phases soak --minutes 60 --json > soak.json
//! ```
//!
//! It needs PostgreSQL and RabbitMQ (the README's quick-start addresses; `DATABASE_URL` and
//! `AMQP_URL` override them). It creates a database of its own (`<DATABASE_URL's name>_<pid>`),
//! migrates it, declares an exchange and a durable queue of its own (`outbox_bench_<pid>`), and
//! drops all three at the end, also when a phase fails.
//!
//! Every run (`--runs`, default 3; the report shows each run and the median) measures:
//!
//! 1. **broker ceiling**: raw lapin, no database. The same messages (same body, properties and
//!    headers as the RabbitMQ sink sends, persistent, `mandatory`, publisher confirms) with the
//!    same in-flight depth as the dispatcher (`processes × workers × max_in_flight`, one
//!    connection and one confirm channel per process, like the sink; `--raw-channels` tries
//!    more), and the same consumer draining the queue as end to end. Timed from the start to
//!    the last confirm *and* the last delivery at the consumer.
//! 2. **database ceiling**: the dispatcher itself (claim, fenced batched finalize) with a sink
//!    that does nothing, from `--messages` pending rows to every row `done`.
//! 3. **end to end**: the dispatcher with the RabbitMQ sink, from `--messages` pending rows to
//!    every row `done` (so every publish confirmed) and every id received by a consumer that
//!    drains the queue (auto-ack) and counts distinct ids.
//! 4. the ratio end-to-end ÷ min(broker ceiling, database ceiling).
//! 5. **idle latency**: with the dispatcher idle, `--latency-samples` rows are inserted one at a
//!    time, `--latency-interval` apart, each in its own transaction. For each row:
//!    *commit → confirm* = from the instant the producer's `INSERT` (autocommit) returned, to the
//!    instant the dispatcher's sink saw the broker's publisher confirm for that row; and
//!    *commit → delivery* = from the same instant to the consumer receiving the message. Both
//!    ends are read from the system wall clock (`SystemTime`, one clock on one machine): the
//!    producer and consumer run in this process, the dispatcher in a child.
//! 6. **peak RSS**: `VmHWM` of each dispatcher process (`/proc/self/status`), read when it stops;
//!    the dispatcher runs in child processes (this binary re-executed), so the benchmark's own
//!    seeding, consumer and bookkeeping are not counted.
//! 7. **loaded latency** (`--phases loaded`): a producer commits `--rate` single-row
//!    transactions a second for `--seconds` (the bench's own on `--producers` connections, or
//!    `--producer pgbench`) while the dispatcher runs with its defaults; commit → delivery p50 /
//!    p99 / p99.9 / max, and what each message cost over the production's last two thirds (the
//!    first warms up): PostgreSQL's CPU split into the relay's backends and the rest (by
//!    process, from `/proc`, each told apart by `pg_stat_activity`), the relay processes',
//!    RabbitMQ's, the bench's own and the machine's; WAL bytes, buffer hits, the relay's
//!    transactions, the outbox's updates and their HOT share, its dead tuples, and where the
//!    server keeps them, `pg_stat_statements`' costliest statements.
//! 8. **history** (`--phases history`): end to end again, with the `--messages` new rows
//!    inserted after `--kept-done` `done` rows (a day of history, vacuumed as autovacuum would
//!    have), and its rate ÷ the e2e phase's rate of the same run.
//! 9. **through a transaction pooler** (`--pgbouncer`): the bench starts a PgBouncer of its own
//!    (`/usr/sbin/pgbouncer` as the `postgres` user through `runuser`, `pool_mode = transaction`,
//!    `default_pool_size = processes × (workers + 2)` so it never queues the dispatchers, trust
//!    authentication, on a free port of 127.0.0.1, in a temporary folder; killed by the pid in
//!    its pid file when the bench ends, also when a phase fails), and every dispatcher phase of
//!    `--phases` among `e2e`, `latency` and `loaded` runs twice in each run: straight to the
//!    server, then with the dispatcher's pool behind the bouncer (`Pooler::Transaction`, the
//!    direct URL as `direct_url`, so its insert listener still has a session). `--pooler-url
//!    postgres://user@host:port` uses a pooler that already runs instead (it must pass the
//!    bench's database to the bench's server). Seeding, the latency rows and the loaded
//!    producers always go direct: both sides of a comparison then differ only in the
//!    dispatcher's path, and the bouncer's figures are the dispatcher's alone. The report puts
//!    the two side by side per phase and run: the rate the dispatcher delivered, commit →
//!    delivery p50 / p99 (latency phases), pooled ÷ direct of the rate and of the p99,
//!    PostgreSQL's CPU per message on each side, and, through the pooler, the bouncer's own CPU
//!    per message (`/proc/<pid>/stat`, only of the bench's own bouncer) and the transactions
//!    it passed to the server per message (`total_xact_count` of `SHOW STATS` on its admin
//!    console, before and after). The broker, database and history phases run direct only.
//!
//! Beside the rates it prints where the CPU went: the busy time of the whole machine per
//! message in each throughput phase (`/proc/stat`: PostgreSQL, RabbitMQ, the dispatcher, the
//! consumer and anything else running), the dispatcher processes' own CPU per message, and,
//! end to end, the share of the machine's PostgreSQL and RabbitMQ server processes
//! (`/proc/<pid>/stat` of every `postgres` and `beam.smp` process). On a machine where
//! everything shares a few cores, end to end costs about the sum of the two ceilings' CPU per
//! message, and these columns show it.
//!
//! 10. **drain** (`--phases drain`, once, after the runs): `--messages` rows end to end, first
//!     unpaced, then paced at `--drain-rate` (`run --max-rate`, default 2,000 a second): the
//!     rows done in each second of each drain, printed side by side, and with `--drain-svg
//!     PATH` drawn as a plot of both curves.
//!
//! 11. **held horizon** (`--phases horizon`, once): `--rate` (default 800) for `--seconds`
//!     (default 270) with a consumer; from `--hold-from` (90) for `--hold` (180) seconds a
//!     `REPEATABLE READ` transaction in the bench's database holds its snapshot (checked: its
//!     `backend_xmin` is set), so vacuum can remove nothing that died since; commit → consumer
//!     p50 / p99 / max of the rows committed in each 30-s window (before the hold, through it,
//!     after it), each window's dead tuples and CPU per message, the backlog and the outbox at the
//!     end, and the statements before and during the hold.
//! 12. **soak** (`--phases soak`, once): `--rate` (default 2,000) for `--minutes` (default 60);
//!     a line a minute: committed and delivered a second, commit → consumer p50 / p99 of the rows
//!     delivered in it, the backlog, the outbox's `pg_relation_size` and `pg_indexes_size` (and
//!     each index's), live and dead tuples, the relay's resident memory and CPU per message.
//!     `bench/plot_soak.py` draws the `--json` output.
//!
//! The held horizon and the soak relay through `actix-outbox run` itself (the command line's own
//! `run`, in a child process): its defaults, the bench's dispatcher options that differ from
//! them, and `--relay-arg`s, which `run`'s own parser reads (a flag `run` gains works here at
//! once). The other phases start the library's dispatcher directly. `--pg-own` runs everything
//! against a PostgreSQL 15 the bench makes and starts (`initdb`'s defaults, so autovacuum on,
//! plus `pg_stat_statements`; on a free port, as the `postgres` user; stopped and removed at the
//! end, also when a phase fails): what a table does over time depends on vacuum, which a
//! development machine's shared server may have off.
//!
//! `--phases` picks phases (default `broker,database,e2e,latency`); `--json` prints one JSON document
//! (the pooler comparison under each run's `pooler`).
//! Before each dispatcher phase the table is truncated, seeded with one `INSERT ... SELECT` and
//! `VACUUM ANALYZE`d, so every phase starts from the same state. The dispatcher runs with its
//! default settings except those given on the command line, and a pool of `workers + 2`
//! connections per process, like `actix-outbox run`. `--processes N` starts N dispatcher
//! processes against the same table (and N publishing processes for the broker ceiling).
//! Every wait is bounded by `--phase-timeout`; children exit when this process goes away.
//!
//! `--fifo` turns the per-aggregate gate on for every row; the seeded rows belong to 1,000
//! aggregates (`aggregate_id = n % 1000`), so the gate admits at most one row per aggregate at
//! a time. The broker ceiling does not depend on it.
//!
//! The code follows the two roles: [`parent`] sets up, runs the phases ([`parent`]'s `phases`),
//! tallies the consumer and reports; [`child`] is a dispatcher, a raw publisher or `actix-outbox
//! run`, started by the parent as this binary with a hidden subcommand (a dispatcher behind the
//! pooler gets the pooler's URL and `--direct-url`). [`procstat`] reads `/proc`, [`message`] is what both kinds
//! of child send; the parent's `bouncer` starts and reads the pooler.

// The two roles of the binary: the parent orchestrates, the children (this binary re-executed)
// are the processes it measures.
mod child;
mod message;
mod parent;
mod procstat;

use std::process::ExitCode;
use std::time::Duration;

use actix_outbox::DispatcherConfig;
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
type BoxError = Box<dyn std::error::Error>;

const DEFAULT_DATABASE_URL: &str = "postgres://root@127.0.0.1:5432/actix_outbox_bench";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The routing key (event type) of every benchmark message; the queue is bound with `#`.
const EVENT_TYPE: &str = "bench.event";
/// Ids of the broker ceiling's messages start here, far from the table's identity values, so
/// the consumer can never mistake one phase's messages for another's.
const RAW_ID_BASE: i64 = 1 << 40;
/// How often a dispatcher child reports its `done` counter.
const REPORT_PERIOD: Duration = Duration::from_millis(5);
/// How long the dispatcher is left idle before the latency samples start.
const SETTLE: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(about = "Throughput and latency of actix-outbox beside the raw ceilings of this machine")]
struct Cli {
    #[command(subcommand)]
    child: Option<ChildRole>,
    #[command(flatten)]
    opts: Opts,
}

/// The benchmark's options (the dispatcher children receive the relevant ones again).
#[derive(Args, Clone, Debug, Serialize)]
struct Opts {
    /// Rows (messages) per throughput phase.
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Messages a second each dispatcher process publishes at most, as `actix-outbox run
    /// --max-rate` (default: not paced).
    #[arg(long)]
    max_rate: Option<f64>,
    /// Drain phase: the cap of its paced drain, beside the unpaced one.
    #[arg(long, default_value_t = 2000.0)]
    drain_rate: f64,
    /// Drain phase: also write the two curves as an SVG plot to this file.
    #[arg(long)]
    #[serde(skip)]
    drain_svg: Option<std::path::PathBuf>,
    /// Claim actors per dispatcher process.
    #[arg(long, default_value_t = DispatcherConfig::default().workers)]
    workers: usize,
    /// Rows one claim takes at most.
    #[arg(long, default_value_t = DispatcherConfig::default().batch)]
    batch: usize,
    /// Rows one worker holds claimed at once (default: the dispatcher's, 2 × batch).
    #[arg(long)]
    max_in_flight: Option<usize>,
    /// Turn the per-aggregate FIFO gate on for every row (`Fifo::All`); the seeded rows spread
    /// over 1,000 aggregates.
    #[arg(long)]
    fifo: bool,
    /// What becomes of a confirmed row, as `actix-outbox run --retention`: kept `done`, or
    /// deleted (`Retention::Delete`).
    #[arg(long, value_enum, default_value = "keep")]
    retention: RetentionArg,
    /// Confirm channels of each raw publisher (broker ceiling); the sink uses one.
    #[arg(long, default_value_t = 1)]
    raw_channels: usize,
    /// Send no header table, as `actix-outbox run --no-outbox-headers`: the sink without its
    /// own headers, and the raw publisher likewise (the other properties stay).
    #[arg(long)]
    no_outbox_headers: bool,
    /// Dispatcher processes against the same table.
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Phases to run, in this order (the ratio needs the first three).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "broker,database,e2e,latency")]
    phases: Vec<Phase>,
    /// Runs; the report gives each run and the median.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Approximate size of each message body (JSON) in bytes.
    #[arg(long, default_value_t = 256)]
    payload_bytes: usize,
    /// Rows inserted one at a time for the idle-latency figure (0 skips it).
    #[arg(long, default_value_t = 100)]
    latency_samples: usize,
    /// Pause between two latency rows.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "as_millis")]
    latency_interval: Duration,
    /// Loaded latency, held horizon and soak: rows per second the producer commits, one row
    /// per transaction (default: 1,000 loaded, 800 horizon, 2,000 soak).
    #[arg(long)]
    rate: Option<u32>,
    /// Loaded latency and held horizon: how long the producer runs, in seconds (default: 10
    /// loaded, 270 horizon).
    #[arg(long)]
    seconds: Option<u32>,
    /// Loaded latency, held horizon and soak: connections the producer commits on (each row's
    /// slot goes to the next free one, so a slow commit does not hold the rows behind it; with
    /// pgbench, its clients).
    #[arg(long, default_value_t = 16)]
    producers: usize,
    /// Loaded latency, held horizon and soak: who commits the rows. `bench`: this process,
    /// which notes when each commit returned (commit → consumer is exact); `pgbench`:
    /// PostgreSQL's pgbench with `-R` (Poisson arrivals) and `synchronous_commit = off`, which
    /// costs the machine less; commit → consumer then starts at the row's `created_at` (its
    /// transaction's start, a little before its commit).
    #[arg(long, value_enum, default_value = "bench")]
    producer: ProducerKind,
    /// Held horizon: the second of the production at which a `REPEATABLE READ` transaction in
    /// the bench's database takes its snapshot.
    #[arg(long, default_value_t = 90)]
    hold_from: u32,
    /// Held horizon: how long that transaction holds its snapshot, in seconds (it ends with
    /// the production at the latest).
    #[arg(long, default_value_t = 180)]
    hold: u32,
    /// Soak: minutes of steady production.
    #[arg(long, default_value_t = 60)]
    minutes: u32,
    /// Held horizon and soak, whose relay is `actix-outbox run` itself: arguments for it, as
    /// its command line takes them (split at whitespace; repeatable), e.g. `--relay-arg
    /// '--max-in-flight 800'`.
    #[arg(long, allow_hyphen_values = true, value_name = "ARGS")]
    relay_arg: Vec<String>,
    /// Against a PostgreSQL 15 of the bench's own with production defaults instead of
    /// `--database-url`'s server: `initdb`'s settings (autovacuum on, fsync on) and
    /// `pg_stat_statements`, on a free port of 127.0.0.1, as the `postgres` user, in a
    /// temporary folder; stopped and removed at the end, also when a phase fails.
    #[arg(long, conflicts_with = "pooler_url")]
    pg_own: bool,
    /// History phase: `done` rows the table keeps beside the `--messages` new ones, as under
    /// the default `Keep` retention (2,000,000 is about a day of a busy service).
    #[arg(long, default_value_t = 2_000_000)]
    kept_done: usize,
    /// Bound on every phase (a phase that takes longer fails the benchmark).
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "as_millis")]
    phase_timeout: Duration,
    /// Run the dispatcher phases of `--phases` (e2e, latency, loaded) twice each: direct, then
    /// through a PgBouncer in transaction mode that the bench starts (`/usr/sbin/pgbouncer`,
    /// as the `postgres` user, on a free port), and report both side by side.
    #[arg(long, conflicts_with = "pooler_url")]
    pgbouncer: bool,
    /// As `--pgbouncer`, through a transaction pooler that already runs:
    /// `postgres://user@host:port`, which must pass the bench's database (`<name>_<pid>`) to
    /// the bench's server; its admin console (`/pgbouncer`) gives `SHOW STATS` if it allows.
    #[arg(long)]
    #[serde(skip)]
    pooler_url: Option<String>,
    /// Print one JSON document instead of the tables.
    #[arg(long)]
    json: bool,
    /// Server and name prefix of the benchmark's database (`_<pid>` is appended).
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    #[serde(skip)]
    database_url: String,
    /// The RabbitMQ broker (with `--cluster`, the bench's cluster's nodes, comma-separated).
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL)]
    #[serde(skip)]
    amqp_url: String,
    /// Against a three-node RabbitMQ cluster that the bench starts (as the tests do: one
    /// `rabbitmq-server` a node, on free ports, as the `rabbitmq` user) instead of `--amqp-url`:
    /// the queue is a quorum queue, the sink is given every node. Compare with a run without it
    /// (one node, a classic queue) in the same session.
    #[arg(long)]
    cluster: bool,
}

impl Opts {
    /// The broker's first node, for the bench's own connections (declaring, consuming, the raw
    /// publisher).
    fn first_amqp_url(&self) -> &str {
        self.amqp_url.split(',').next().unwrap_or_default()
    }
}

/// `--retention`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum RetentionArg {
    /// Confirmed rows stay `done` (the dispatcher's default).
    Keep,
    /// Confirmed rows are deleted.
    Delete,
}

/// One measurement of a run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Phase {
    /// Raw lapin, no database.
    Broker,
    /// The dispatcher with a do-nothing sink.
    Database,
    /// The dispatcher with the RabbitMQ sink, and a consumer.
    E2e,
    /// Idle latency.
    Latency,
    /// Latency under a steady load of single-row commits (`--rate`, `--seconds`).
    Loaded,
    /// End to end again, the new rows beside `--kept-done` rows of history; the report sets
    /// its rate against the e2e phase's, of the same run.
    History,
    /// A drain of `--messages` rows end to end, unpaced then paced at `--drain-rate`: rows done
    /// per second over time, once (not per run).
    Drain,
    /// A steady `--rate` while a `REPEATABLE READ` transaction holds back vacuum's horizon from
    /// `--hold-from` for `--hold` seconds: commit → consumer by 30-s window, dead tuples; once.
    Horizon,
    /// A steady `--rate` for `--minutes`: a line a minute (latency, table and index sizes, dead
    /// tuples, the relay's RSS); once.
    Soak,
}

impl Phase {
    /// Whether the phase runs in every run (`--runs`), rather than once after them.
    fn per_run(self) -> bool {
        !matches!(self, Phase::Drain | Phase::Horizon | Phase::Soak)
    }
}

/// `--producer`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum ProducerKind {
    /// The bench's own producer: `--producers` connections, each commit's return noted.
    Bench,
    /// pgbench, `-R --rate` with `synchronous_commit = off`.
    Pgbench,
}

fn as_millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_millis() as u64)
}

impl Opts {
    /// The dispatcher configuration every child runs with.
    fn dispatcher_config(&self) -> DispatcherConfig {
        let mut config = DispatcherConfig::default().workers(self.workers).batch(self.batch);
        if self.fifo {
            config = config.fifo(actix_outbox::Fifo::All);
        }
        if let Some(n) = self.max_in_flight {
            config = config.max_in_flight(n);
        }
        if self.retention == RetentionArg::Delete {
            config = config.retention(actix_outbox::Retention::Delete);
        }
        if let Some(rate) = self.max_rate {
            config = config.max_rate(rate);
        }
        config
    }

    /// The rate of `phase`'s producer: `--rate`, or the phase's default.
    fn rate(&self, phase: Phase) -> u32 {
        self.rate.unwrap_or(match phase {
            Phase::Horizon => 800,
            Phase::Soak => 2000,
            _ => 1000,
        })
    }

    /// How long `phase`'s producer runs: `--seconds`, or the phase's default (the soak's is
    /// `--minutes`).
    fn seconds(&self, phase: Phase) -> u32 {
        match phase {
            Phase::Soak => self.minutes.saturating_mul(60),
            Phase::Horizon => self.seconds.unwrap_or(270),
            _ => self.seconds.unwrap_or(10),
        }
    }

    /// `--relay-arg`s, each split at whitespace.
    fn relay_args(&self) -> Vec<String> {
        self.relay_arg.iter().flat_map(|a| a.split_whitespace()).map(str::to_owned).collect()
    }

    /// Publishes one dispatcher process may have in flight at most.
    fn depth_per_process(&self) -> usize {
        self.workers * self.dispatcher_config().in_flight_limit()
    }

    fn pad(&self) -> String {
        "x".repeat(self.payload_bytes.saturating_sub(24))
    }
}

/// Roles this binary plays when it re-executes itself (not for humans).
#[derive(Subcommand)]
enum ChildRole {
    /// One dispatcher process.
    #[command(name = "child-dispatcher", hide = true)]
    Dispatcher(DispatcherChild),
    /// One raw-lapin publishing process (the broker ceiling).
    #[command(name = "child-broker", hide = true)]
    Broker(BrokerChild),
    /// One `actix-outbox run` process (the held-horizon and soak phases' relay).
    #[command(name = "child-run", hide = true)]
    Run(RunChild),
}

#[derive(Args, Debug)]
struct RunChild {
    /// `actix-outbox run`'s arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

#[derive(Args, Debug)]
struct DispatcherChild {
    #[arg(long)]
    db: String,
    #[arg(long)]
    exchange: String,
    /// `null` (do nothing) or `rabbit`.
    #[arg(long)]
    sink: String,
    /// Print `confirm <id> <unix nanos>` for every confirmed publish.
    #[arg(long)]
    report_confirms: bool,
    /// `--db` is a transaction pooler's URL: the pool runs with `Pooler::Transaction`, and this
    /// URL (the server's own) gives the insert listener its session.
    #[arg(long)]
    direct_url: Option<String>,
}

#[derive(Args, Debug)]
struct BrokerChild {
    #[arg(long)]
    exchange: String,
    #[arg(long)]
    first_id: i64,
    #[arg(long)]
    count: usize,
    /// The outbox source the dispatcher derives from the benchmark's database, for the
    /// `x-outbox-source` header and the deduplication key, as the sink sends them.
    #[arg(long)]
    source: String,
}

/// The allocator `actix-outbox run` ships with (see the command line's `main.rs`), so that the
/// dispatcher is measured as it runs there.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal, and not under NO_COLOR.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,lapin=error".into()),
        )
        .init();
    let result = match cli.child {
        Some(ChildRole::Dispatcher(role)) => {
            actix::System::new().block_on(child::dispatcher(role, cli.opts)).map(|()| ExitCode::SUCCESS)
        }
        Some(ChildRole::Broker(role)) => runtime().and_then(|rt| rt.block_on(child::broker(role, cli.opts))),
        Some(ChildRole::Run(role)) => child::run(role).map(|()| ExitCode::SUCCESS),
        None => runtime().and_then(|rt| rt.block_on(parent::main(cli.opts))),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, BoxError> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}
