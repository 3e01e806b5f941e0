//! The benchmark: the dispatcher's throughput and latency beside the raw ceilings of the same
//! machine, all measured in one run.
//!
//! ```text
//! cargo run --release --example bench -- --messages 100000
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
//!
//! Beside the rates it prints where the CPU went: the busy time of the whole machine per
//! message in each throughput phase (`/proc/stat`: PostgreSQL, RabbitMQ, the dispatcher, the
//! consumer and anything else running), the dispatcher processes' own CPU per message, and,
//! end to end, the share of the machine's PostgreSQL and RabbitMQ server processes
//! (`/proc/<pid>/stat` of every `postgres` and `beam.smp` process). On a machine where
//! everything shares a few cores, end to end costs about the sum of the two ceilings' CPU per
//! message, and these columns show it.
//!
//! `--phases` picks phases (`broker,database,e2e,latency`); `--json` prints one JSON document.
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

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child as Process, ChildStdin, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix_outbox::sink::{RabbitConfig, RabbitSink};
use actix_outbox::{
    DispatcherConfig, GetMetrics, MetricsSnapshot, OutboxMessage, OutboxSupervisor, PublishFuture, Publisher, Shutdown,
};
use clap::{Args, Parser, Subcommand};
use diesel::sql_types::{BigInt, Int4, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use serde::Serialize;
use tokio::sync::mpsc;

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
    /// Claim actors per dispatcher process.
    #[arg(long, default_value_t = actix_outbox::config::DEFAULT_WORKERS)]
    workers: usize,
    /// Rows one claim takes at most.
    #[arg(long, default_value_t = actix_outbox::config::DEFAULT_BATCH)]
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
    /// Bound on every phase (a phase that takes longer fails the benchmark).
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "as_millis")]
    phase_timeout: Duration,
    /// Print one JSON document instead of the tables.
    #[arg(long)]
    json: bool,
    /// Server and name prefix of the benchmark's database (`_<pid>` is appended).
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    #[serde(skip)]
    database_url: String,
    /// The RabbitMQ broker.
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL)]
    #[serde(skip)]
    amqp_url: String,
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
        config
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
    #[command(hide = true)]
    ChildDispatcher(DispatcherChild),
    /// One raw-lapin publishing process (the broker ceiling).
    #[command(hide = true)]
    ChildBroker(BrokerChild),
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
}

#[derive(Args, Debug)]
struct BrokerChild {
    #[arg(long)]
    exchange: String,
    #[arg(long)]
    first_id: i64,
    #[arg(long)]
    count: usize,
}

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
        Some(ChildRole::ChildDispatcher(role)) => {
            actix::System::new().block_on(child::dispatcher(role, cli.opts)).map(|()| ExitCode::SUCCESS)
        }
        Some(ChildRole::ChildBroker(role)) => runtime().and_then(|rt| rt.block_on(child::broker(role, cli.opts))),
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

/// Busy CPU time of the whole machine so far (every core, every process: `/proc/stat` minus
/// idle and iowait), in seconds; `None` off Linux. Read at both ends of a phase, it says how
/// much CPU the phase cost, whoever spent it (PostgreSQL, RabbitMQ, the dispatcher, the
/// consumer, and anything else running on the machine meanwhile).
fn machine_busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|t| t.parse().ok()).collect();
    let (idle, iowait) = (*ticks.get(3)?, *ticks.get(4)?);
    Some((ticks.iter().sum::<u64>() - idle - iowait) as f64 / USER_HZ)
}

/// The unit of the CPU times in `/proc`: 100 ticks a second on every Linux that matters.
const USER_HZ: f64 = 100.0;

/// The name and the CPU time so far (user + system, in ticks) of the process whose
/// `/proc/<pid>/stat` line is `stat`.
fn process_cpu_ticks(stat: &str) -> Option<(&str, u64)> {
    // `pid (name) state ...`: a name may hold spaces, so it ends at the last parenthesis.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    // utime and stime are the 14th and 15th fields, the 12th and 13th after the name.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some((name, fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?))
}

/// The database and broker servers whose CPU the report shows on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Postgres,
    Rabbitmq,
}

/// CPU ticks so far of every PostgreSQL (`postgres`) and RabbitMQ (`beam.smp`) process on the
/// machine, by pid; empty off Linux.
struct ServerTicks(HashMap<u32, (Server, u64)>);

impl ServerTicks {
    fn read() -> Self {
        let mut ticks = HashMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            let Some((name, cpu)) = process_cpu_ticks(&stat) else { continue };
            let server = match name {
                "postgres" => Server::Postgres,
                "beam.smp" => Server::Rabbitmq,
                _ => continue,
            };
            ticks.insert(pid, (server, cpu));
        }
        Self(ticks)
    }

    /// CPU seconds `server` spent since `self` was read: of the processes alive now, what each
    /// spent since then (all of it for one started since). A process that exited in between
    /// is missed; the dispatchers' connections are all open before a phase's clock starts.
    fn spent_since(&self, now: &Self, server: Server) -> f64 {
        let ticks: u64 = now
            .0
            .iter()
            .filter(|(_, (s, _))| *s == server)
            .map(|(pid, (_, t))| t.saturating_sub(self.0.get(pid).map_or(0, |(_, before)| *before)))
            .sum();
        ticks as f64 / USER_HZ
    }
}

/// A phase's wall time and the machine's busy CPU time over it.
#[derive(Debug, Clone, Copy)]
struct Spent {
    wall: Duration,
    cpu_seconds: Option<f64>,
    /// CPU time of the dispatcher processes alone (dispatcher phases only).
    dispatcher_cpu_seconds: Option<f64>,
    /// Most rows done but not yet seen by the consumer at once (end to end only).
    consumer_lag: Option<u64>,
    /// CPU seconds of the PostgreSQL and of the RabbitMQ processes over the phase.
    postgres_cpu_seconds: f64,
    rabbitmq_cpu_seconds: f64,
}

impl Spent {
    fn since(started: Instant, busy_before: Option<f64>, servers_before: &ServerTicks) -> Self {
        let wall = started.elapsed();
        let cpu_seconds = busy_before.zip(machine_busy_seconds()).map(|(before, after)| after - before);
        let servers = ServerTicks::read();
        Self {
            wall,
            cpu_seconds,
            dispatcher_cpu_seconds: None,
            consumer_lag: None,
            postgres_cpu_seconds: servers_before.spent_since(&servers, Server::Postgres),
            rabbitmq_cpu_seconds: servers_before.spent_since(&servers, Server::Rabbitmq),
        }
    }

    /// A server's CPU per message, when any was seen (none off Linux).
    fn server_us_per_message(seconds: f64, n: usize) -> Option<f64> {
        (seconds > 0.0).then(|| seconds * 1e6 / n as f64)
    }

    fn rate(&self, n: usize) -> f64 {
        n as f64 / self.wall.as_secs_f64()
    }

    fn cpu_us_per_message(&self, n: usize) -> Option<f64> {
        self.cpu_seconds.map(|s| s * 1e6 / n as f64)
    }

    fn dispatcher_us_per_message(&self, n: usize) -> Option<f64> {
        self.dispatcher_cpu_seconds.map(|s| s * 1e6 / n as f64)
    }
}

fn unix_nanos(t: SystemTime) -> i128 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128)
}

/// The body of message `n`: what the seeded rows' `payload` serialises to.
fn body(n: i64, pad: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "n": n, "pad": pad })).expect("a JSON value serialises")
}

/// The properties and headers the RabbitMQ sink sets (see `RabbitSink`), for the raw publisher;
/// without the header table when `outbox_headers` is false (`--no-outbox-headers`).
fn properties(id: i64, aggregate_id: &str, outbox_headers: bool) -> BasicProperties {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(id.to_string().into())
        .with_type(EVENT_TYPE.into())
        .with_timestamp(now)
        .with_app_id(actix_outbox::sink::DEFAULT_APP_ID.into());
    if !outbox_headers {
        return properties;
    }
    let mut headers = FieldTable::default();
    headers.insert("x-outbox-id".into(), AMQPValue::LongLongInt(id));
    headers.insert("x-deduplication-header".into(), AMQPValue::LongString(id.to_string().as_str().into()));
    headers.insert("x-aggregate-type".into(), AMQPValue::LongString("bench".into()));
    headers.insert("x-aggregate-id".into(), AMQPValue::LongString(aggregate_id.into()));
    headers.insert("x-attempt".into(), AMQPValue::LongInt(1));
    properties.with_headers(headers)
}

/// Names of everything the benchmark creates, derived from its pid.
struct Names {
    database_url: String,
    admin_url: String,
    database: String,
    exchange: String,
    queue: String,
}

impl Names {
    fn new(opts: &Opts) -> Result<Self, BoxError> {
        let base = opts.database_url.split('?').next().unwrap_or_default();
        let (server, prefix) = base.rsplit_once('/').ok_or("DATABASE_URL has no database name")?;
        if prefix.is_empty() || !server.contains("://") {
            return Err("DATABASE_URL must look like postgres://user@host:port/name".into());
        }
        let database = format!("{prefix}_{}", std::process::id());
        let name = format!("outbox_bench_{}", std::process::id());
        Ok(Self {
            database_url: format!("{server}/{database}"),
            admin_url: format!("{server}/postgres"),
            database,
            exchange: name.clone(),
            queue: name,
        })
    }
}

/// Child processes: the dispatcher and the raw publisher. They talk to the parent in lines:
/// stdout `ready`, `done <n>`, `confirm <id> <nanos>`, `final <json>`; stdin `go`, `stop`
/// (or end of file, which also means stop).
mod child {
    use super::*;

    fn emit(line: &str) {
        let mut out = std::io::stdout().lock();
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            // The parent is gone.
            std::process::exit(3);
        }
    }

    /// Lines from stdin, read on a thread of their own; end of file becomes `stop`.
    fn commands() -> mpsc::UnboundedReceiver<String> {
        let (tx, rx) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line.trim().to_owned()).is_err() {
                    return;
                }
            }
            let _ = tx.send("stop".to_owned());
        });
        rx
    }

    async fn wait_for(commands: &mut mpsc::UnboundedReceiver<String>, word: &str, timeout: Duration) -> bool {
        let found = async {
            while let Some(line) = commands.recv().await {
                if line == word {
                    return true;
                }
                if line == "stop" {
                    return false;
                }
            }
            false
        };
        tokio::time::timeout(timeout, found).await.unwrap_or(false)
    }

    /// `VmHWM` (peak resident set) of this process, in KiB.
    fn peak_rss_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    }

    /// A sink that does nothing: the database ceiling.
    #[derive(Debug)]
    struct NullSink;

    impl Publisher for NullSink {
        fn publish(&self, _: Arc<OutboxMessage>) -> PublishFuture {
            Box::pin(std::future::ready(Ok(())))
        }
    }

    /// Reports the instant each publish was confirmed (latency phase).
    #[derive(Debug)]
    struct Timed<P>(P);

    impl<P: Publisher> Publisher for Timed<P> {
        fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
            let id = message.id;
            let publish = self.0.publish(message);
            Box::pin(async move {
                let result = publish.await;
                if result.is_ok() {
                    emit(&format!("confirm {id} {}", unix_nanos(SystemTime::now())));
                }
                result
            })
        }
    }

    #[derive(Serialize)]
    struct Final {
        peak_rss_kib: u64,
        /// CPU time this process spent from `go` to `stop`, in seconds.
        cpu_seconds: Option<f64>,
        metrics: Option<MetricsSnapshot>,
    }

    /// CPU time (user + system) this process has used so far, in seconds.
    fn own_cpu_seconds() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        Some(process_cpu_ticks(&stat)?.1 as f64 / USER_HZ)
    }

    pub(super) async fn dispatcher(role: DispatcherChild, opts: Opts) -> Result<(), BoxError> {
        let mut commands = commands();
        let config = opts.dispatcher_config();
        let pool_size = config.workers + 2;
        let pool = actix_outbox::connect_pool(&role.db, pool_size as u32).await?;
        // Open every connection now, so that start-up is not timed.
        let warm = futures_util::future::join_all((0..pool_size).map(|_| pool.get())).await;
        for conn in warm {
            conn?;
        }
        let rabbit = match role.sink.as_str() {
            "null" => None,
            "rabbit" => Some(
                RabbitSink::connect(
                    RabbitConfig::new(&opts.amqp_url)
                        .exchange(&role.exchange)
                        .connection_name("actix-outbox bench")
                        .outbox_headers(!opts.no_outbox_headers),
                )
                .await?,
            ),
            other => return Err(format!("unknown sink {other:?}").into()),
        };
        emit("ready");
        let deadline = opts.phase_timeout + Duration::from_secs(60);
        if !wait_for(&mut commands, "go", deadline).await {
            return Ok(());
        }
        let cpu_at_go = own_cpu_seconds();
        let supervisor = match (&rabbit, role.report_confirms) {
            (None, _) => OutboxSupervisor::start(config, pool, NullSink)?,
            (Some(sink), false) => OutboxSupervisor::start(config, pool, sink.clone())?,
            (Some(sink), true) => OutboxSupervisor::start(config, pool, Timed(sink.clone()))?,
        };
        let mut reported = u64::MAX;
        let mut tick = tokio::time::interval(REPORT_PERIOD);
        let stop_at = tokio::time::Instant::now() + deadline;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let done = supervisor.send(GetMetrics).await?.done;
                    if done != reported {
                        emit(&format!("done {done}"));
                        reported = done;
                    }
                }
                line = commands.recv() => if matches!(line.as_deref(), None | Some("stop")) { break },
                () = tokio::time::sleep_until(stop_at) => break,
            }
        }
        let cpu_seconds = cpu_at_go.zip(own_cpu_seconds()).map(|(go, stop)| stop - go);
        supervisor.send(Shutdown).await?;
        let metrics = supervisor.send(GetMetrics).await.ok();
        if let Some(sink) = &rabbit {
            sink.close().await;
        }
        let report = Final { peak_rss_kib: peak_rss_kib(), cpu_seconds, metrics };
        emit(&format!("final {}", serde_json::to_string(&report)?));
        Ok(())
    }

    /// Publishes ids `first_id ..` with the dispatcher's in-flight depth, one connection and one
    /// confirm channel, like the sink; reports when the last confirm is in.
    pub(super) async fn broker(role: BrokerChild, opts: Opts) -> Result<ExitCode, BoxError> {
        let mut commands = commands();
        let conn = Connection::connect(&opts.amqp_url, ConnectionProperties::default()).await?;
        let mut channels = Vec::new();
        for _ in 0..opts.raw_channels.max(1) {
            let channel = conn.create_channel().await?;
            channel.confirm_select(ConfirmSelectOptions::default()).await?;
            channels.push(channel);
        }
        let pad = opts.pad();
        let depth = opts.depth_per_process();
        let exchange: ShortString = role.exchange.as_str().into();
        emit("ready");
        if !wait_for(&mut commands, "go", opts.phase_timeout).await {
            return Ok(ExitCode::FAILURE);
        }
        let mut in_flight = FuturesUnordered::new();
        let (mut acked, mut failed) = (0_usize, 0_usize);
        let mut settle = |outcome: Result<Confirmation, lapin::Error>| match outcome {
            Ok(Confirmation::Ack(None)) => acked += 1,
            _ => failed += 1,
        };
        let publish_all = async {
            for n in 0..role.count {
                if in_flight.len() >= depth
                    && let Some(outcome) = in_flight.next().await
                {
                    settle(outcome);
                }
                let id = role.first_id + n as i64;
                let channel = channels[n % channels.len()].clone();
                let (exchange, payload) = (exchange.clone(), body(id, &pad));
                let aggregate = (id % 1000).to_string();
                let outbox_headers = !opts.no_outbox_headers;
                in_flight.push(async move {
                    let options = BasicPublishOptions { mandatory: true, immediate: false };
                    let confirm = channel
                        .basic_publish(
                            exchange,
                            EVENT_TYPE.into(),
                            options,
                            &payload,
                            properties(id, &aggregate, outbox_headers),
                        )
                        .await?;
                    confirm.await
                });
            }
            while let Some(outcome) = in_flight.next().await {
                settle(outcome);
            }
        };
        tokio::time::timeout(opts.phase_timeout, publish_all).await.map_err(|_| "raw publishing timed out")?;
        emit(&format!("final {{\"acked\":{acked},\"failed\":{failed}}}"));
        let _ = conn.close(200, "bench done".into()).await;
        Ok(ExitCode::SUCCESS)
    }
}

/// The parent: sets up, runs the phases, reports, cleans up.
mod parent {
    use super::*;

    /// One child process, its stdin, and its last reported `done`.
    struct Kid {
        process: Process,
        stdin: Option<ChildStdin>,
        done: u64,
        last: Option<serde_json::Value>,
    }

    impl Kid {
        fn send(&mut self, line: &str) {
            if let Some(stdin) = &mut self.stdin {
                let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
            }
        }
    }

    impl Drop for Kid {
        fn drop(&mut self) {
            // Closing stdin tells the child to stop; kill it if it has not within a few seconds.
            self.stdin.take();
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.process.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
    }

    /// A message from a child: its index and one line (`None` at end of output).
    type KidLine = (usize, Option<String>);

    /// Children of one phase and the stream of their output lines.
    struct Kids {
        kids: Vec<Kid>,
        lines: mpsc::UnboundedReceiver<KidLine>,
    }

    impl Kids {
        fn spawn(args: &[Vec<String>]) -> Result<Self, BoxError> {
            let exe = std::env::current_exe()?;
            let (tx, lines) = mpsc::unbounded_channel();
            let mut kids = Vec::new();
            for (i, args) in args.iter().enumerate() {
                let mut process = Command::new(&exe).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
                let stdout = process.stdout.take().ok_or("child without stdout")?;
                let stdin = process.stdin.take();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        if tx.send((i, Some(line))).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send((i, None));
                });
                kids.push(Kid { process, stdin, done: 0, last: None });
            }
            Ok(Self { kids, lines })
        }

        /// Waits until every child said `ready`.
        async fn ready(&mut self, timeout: Duration) -> Result<(), BoxError> {
            let mut ready = vec![false; self.kids.len()];
            let deadline = tokio::time::Instant::now() + timeout;
            while !ready.iter().all(|r| *r) {
                match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                    Ok(Some((i, Some(line)))) if line == "ready" => ready[i] = true,
                    Ok(Some((_, Some(_)))) => {}
                    Ok(Some((i, None))) => return Err(format!("child {i} failed to start (see its stderr)").into()),
                    Ok(None) => return Err("children failed to start".into()),
                    Err(_) => return Err("children did not get ready in time".into()),
                }
            }
            Ok(())
        }

        fn go(&mut self) {
            for kid in &mut self.kids {
                kid.send("go");
            }
        }

        fn done(&self) -> u64 {
            self.kids.iter().map(|k| k.done).sum()
        }

        /// Applies one line; returns `Err` when a child ended early.
        fn apply(&mut self, (i, line): KidLine, confirms: &mut HashMap<i64, SystemTime>) -> Result<(), BoxError> {
            let Some(line) = line else {
                if self.kids[i].last.is_none() {
                    return Err(format!("child {i} ended unexpectedly (see its stderr above)").into());
                }
                return Ok(());
            };
            let mut words = line.splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("done"), Some(n), None) => self.kids[i].done = n.parse()?,
                (Some("confirm"), Some(id), Some(nanos)) => {
                    let nanos: u64 = nanos.parse()?;
                    confirms.insert(id.parse()?, UNIX_EPOCH + Duration::from_nanos(nanos));
                }
                (Some("final"), Some(_), _) => {
                    self.kids[i].last = Some(serde_json::from_str(line.trim_start_matches("final "))?);
                }
                _ => {}
            }
            Ok(())
        }

        /// Tells every child to stop and collects their `final` reports.
        async fn stop(mut self, timeout: Duration) -> Result<Vec<serde_json::Value>, BoxError> {
            for kid in &mut self.kids {
                kid.send("stop");
            }
            let deadline = tokio::time::Instant::now() + timeout;
            let mut ignore = HashMap::new();
            while self.kids.iter().any(|k| k.last.is_none()) {
                match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                    Ok(Some(line)) => self.apply(line, &mut ignore)?,
                    Ok(None) => break,
                    Err(_) => return Err("children did not stop in time".into()),
                }
            }
            Ok(self.kids.iter_mut().filter_map(|k| k.last.take()).collect())
        }
    }

    /// What the consumer has seen of the current phase's id range.
    #[derive(Default)]
    struct Tally {
        first: i64,
        seen: Vec<bool>,
        distinct: usize,
        duplicates: usize,
        /// Messages outside the range (another phase's stragglers).
        stray: usize,
        /// First arrival of every id, whatever its range, recorded only in the latency phase.
        arrivals: Option<HashMap<i64, SystemTime>>,
    }

    impl Tally {
        fn expect(&mut self, first: i64, count: usize, record_arrivals: bool) {
            *self = Tally {
                first,
                seen: vec![false; count],
                arrivals: record_arrivals.then(HashMap::new),
                ..Tally::default()
            };
        }

        fn record(&mut self, id: i64) {
            if let Some(arrivals) = &mut self.arrivals {
                arrivals.entry(id).or_insert_with(SystemTime::now);
            }
            let Some(slot) = usize::try_from(id - self.first).ok().and_then(|i| self.seen.get_mut(i)) else {
                self.stray += 1;
                return;
            };
            if std::mem::replace(slot, true) {
                self.duplicates += 1;
            } else {
                self.distinct += 1;
            }
        }
    }

    /// One run's figures.
    #[derive(Debug, Clone, Default, Serialize)]
    struct RunResult {
        broker_ceiling_msg_s: Option<f64>,
        database_ceiling_msg_s: Option<f64>,
        end_to_end_msg_s: Option<f64>,
        ratio: Option<f64>,
        /// Busy CPU time of the whole machine per message, in microseconds, for the broker
        /// ceiling, the database ceiling and end to end.
        broker_cpu_us_per_msg: Option<f64>,
        database_cpu_us_per_msg: Option<f64>,
        end_to_end_cpu_us_per_msg: Option<f64>,
        /// CPU time of the dispatcher processes alone per message, in microseconds, in the
        /// database-ceiling and end-to-end phases.
        database_dispatcher_us_per_msg: Option<f64>,
        end_to_end_dispatcher_us_per_msg: Option<f64>,
        /// CPU time of the PostgreSQL and of the RabbitMQ processes per message end to end, in
        /// microseconds (parts of `end_to_end_cpu_us_per_msg`).
        end_to_end_postgres_us_per_msg: Option<f64>,
        end_to_end_rabbitmq_us_per_msg: Option<f64>,
        latency_confirm_p50_ms: Option<f64>,
        latency_confirm_p99_ms: Option<f64>,
        latency_delivery_p50_ms: Option<f64>,
        latency_delivery_p99_ms: Option<f64>,
        /// Largest `VmHWM` of the dispatcher processes, over the phases that ran them.
        peak_rss_mib: Option<f64>,
        /// Duplicate deliveries the consumer saw in the end-to-end phase (at-least-once).
        end_to_end_duplicates: usize,
        /// Most messages confirmed (rows done) but not yet at the consumer at once, end to end:
        /// a consumer that falls behind makes the broker queue (and store) messages.
        end_to_end_consumer_lag: Option<u64>,
    }

    #[derive(Serialize)]
    struct Report<'a> {
        date: String,
        machine: Machine,
        options: &'a Opts,
        in_flight_per_process: usize,
        runs: Vec<RunResult>,
        median: RunResult,
    }

    #[derive(Serialize)]
    struct Machine {
        cores: usize,
        postgres: String,
        note: &'static str,
    }

    pub(super) async fn main(opts: Opts) -> Result<ExitCode, BoxError> {
        if opts.messages == 0 || opts.runs == 0 || opts.processes == 0 {
            return Err("--messages, --runs and --processes must be at least 1".into());
        }
        opts.dispatcher_config().validate()?;
        let names = Names::new(&opts)?;
        // Ctrl-C still cleans up: the children see their stdin close and stop.
        let result = tokio::select! {
            result = bench(&opts, &names) => result,
            _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
        };
        let cleanup = cleanup(&opts, &names).await;
        let report = result?;
        if let Err(e) = cleanup {
            eprintln!("bench: cleanup failed: {e}");
        }
        if opts.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print_report(&report);
        }
        Ok(ExitCode::SUCCESS)
    }

    async fn cleanup(opts: &Opts, names: &Names) -> Result<(), BoxError> {
        let mut admin = AsyncPgConnection::establish(&names.admin_url).await?;
        admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", names.database)).await?;
        let conn = Connection::connect(&opts.amqp_url, ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        channel.queue_delete(names.queue.as_str().into(), QueueDeleteOptions::default()).await?;
        channel.exchange_delete(names.exchange.as_str().into(), ExchangeDeleteOptions::default()).await?;
        let _ = conn.close(200, "bench cleanup".into()).await;
        Ok(())
    }

    async fn bench<'a>(opts: &'a Opts, names: &Names) -> Result<Report<'a>, BoxError> {
        actix_outbox::ensure_database(&names.database_url).await?;
        actix_outbox::migrate(&names.database_url).await?;
        let mut db = AsyncPgConnection::establish(&names.database_url).await?;
        #[derive(diesel::QueryableByName)]
        struct Version {
            #[diesel(sql_type = Text)]
            v: String,
        }
        let postgres: Version =
            diesel::sql_query("SELECT current_setting('server_version') AS v").get_result(&mut db).await?;

        // The exchange (as the sink declares it) and a durable queue that takes everything.
        let amqp = Connection::connect(&opts.amqp_url, ConnectionProperties::default()).await?;
        let channel = amqp.create_channel().await?;
        let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        channel
            .exchange_declare(names.exchange.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
            .await?;
        let queue_options = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        channel.queue_declare(names.queue.as_str().into(), queue_options, FieldTable::default()).await?;
        channel
            .queue_bind(
                names.queue.as_str().into(),
                names.exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let tally = Arc::new(Mutex::new(Tally::default()));
        let mut deliveries = channel
            .basic_consume(
                names.queue.as_str().into(),
                "bench".into(),
                BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() },
                FieldTable::default(),
            )
            .await?;
        let consumer = {
            let tally = tally.clone();
            tokio::spawn(async move {
                while let Some(Ok(delivery)) = deliveries.next().await {
                    let id = delivery.properties.message_id().as_ref().and_then(|m| m.as_str().parse::<i64>().ok());
                    let mut tally = tally.lock().unwrap_or_else(|e| e.into_inner());
                    match id {
                        Some(id) => tally.record(id),
                        None => tally.stray += 1,
                    }
                }
            })
        };

        let mut runs = Vec::new();
        for run in 0..opts.runs {
            if !opts.json {
                eprintln!("run {}/{}...", run + 1, opts.runs);
            }
            runs.push(one_run(opts, names, run, &mut db, &tally).await?);
        }
        consumer.abort();
        let _ = amqp.close(200, "bench done".into()).await;
        let median = median_of(&runs);
        Ok(Report {
            date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            machine: Machine {
                cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
                postgres: postgres.v,
                note: "PostgreSQL, RabbitMQ, the dispatcher and the benchmark share these cores",
            },
            options: opts,
            in_flight_per_process: opts.depth_per_process(),
            runs,
            median,
        })
    }

    /// The options a child needs, before its subcommand (clap reads them at the top level).
    fn common_args(opts: &Opts) -> Vec<String> {
        let mut args = vec![
            "--workers".to_owned(),
            opts.workers.to_string(),
            "--batch".to_owned(),
            opts.batch.to_string(),
            "--payload-bytes".to_owned(),
            opts.payload_bytes.to_string(),
            "--amqp-url".to_owned(),
            opts.amqp_url.clone(),
            "--phase-timeout".to_owned(),
            humantime::format_duration(opts.phase_timeout).to_string(),
            "--raw-channels".to_owned(),
            opts.raw_channels.to_string(),
        ];
        if let Some(n) = opts.max_in_flight {
            args.extend(["--max-in-flight".to_owned(), n.to_string()]);
        }
        if opts.fifo {
            args.push("--fifo".to_owned());
        }
        if opts.retention == RetentionArg::Delete {
            args.extend(["--retention".to_owned(), "delete".to_owned()]);
        }
        if opts.no_outbox_headers {
            args.push("--no-outbox-headers".to_owned());
        }
        args
    }

    fn dispatcher_args(opts: &Opts, names: &Names, sink: &str, report_confirms: bool) -> Vec<String> {
        let mut args = common_args(opts);
        args.extend(
            ["child-dispatcher", "--db", &names.database_url, "--exchange", &names.exchange, "--sink", sink]
                .map(str::to_owned),
        );
        if report_confirms {
            args.push("--report-confirms".to_owned());
        }
        args
    }

    /// Splits `total` as evenly as possible over `parts`.
    fn shares(total: usize, parts: usize) -> impl Iterator<Item = usize> {
        (0..parts).map(move |i| total / parts + usize::from(i < total % parts))
    }

    fn tally_of(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
        tally.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn one_run(
        opts: &Opts,
        names: &Names,
        run: usize,
        db: &mut AsyncPgConnection,
        tally: &Mutex<Tally>,
    ) -> Result<RunResult, BoxError> {
        let n = opts.messages;
        let mut result = RunResult::default();
        let mut peak_kib = 0_u64;

        let phase = |p: Phase| opts.phases.contains(&p);

        // 1. Broker ceiling.
        if phase(Phase::Broker) {
            let spent = broker_ceiling(opts, names, run, tally).await?;
            result.broker_ceiling_msg_s = Some(spent.rate(n));
            result.broker_cpu_us_per_msg = spent.cpu_us_per_message(n);
        }

        // 2. Database ceiling.
        if phase(Phase::Database) {
            let (first, _) = seed(db, n, opts).await?;
            let spent = dispatch(opts, names, "null", n, tally, first, &mut peak_kib).await?;
            verify_done(db, n, opts.retention == RetentionArg::Delete).await?;
            result.database_ceiling_msg_s = Some(spent.rate(n));
            result.database_cpu_us_per_msg = spent.cpu_us_per_message(n);
            result.database_dispatcher_us_per_msg = spent.dispatcher_us_per_message(n);
        }

        // 3. End to end.
        if phase(Phase::E2e) {
            let (first, _) = seed(db, n, opts).await?;
            let spent = dispatch(opts, names, "rabbit", n, tally, first, &mut peak_kib).await?;
            verify_done(db, n, opts.retention == RetentionArg::Delete).await?;
            result.end_to_end_msg_s = Some(spent.rate(n));
            result.end_to_end_cpu_us_per_msg = spent.cpu_us_per_message(n);
            result.end_to_end_dispatcher_us_per_msg = spent.dispatcher_us_per_message(n);
            result.end_to_end_postgres_us_per_msg = Spent::server_us_per_message(spent.postgres_cpu_seconds, n);
            result.end_to_end_rabbitmq_us_per_msg = Spent::server_us_per_message(spent.rabbitmq_cpu_seconds, n);
            result.end_to_end_consumer_lag = spent.consumer_lag;
            result.end_to_end_duplicates = tally_of(tally).duplicates;
        }

        // 4. The ratio.
        if let (Some(e2e), Some(broker), Some(database)) =
            (result.end_to_end_msg_s, result.broker_ceiling_msg_s, result.database_ceiling_msg_s)
        {
            result.ratio = Some(e2e / broker.min(database));
        }

        // 5. Idle latency.
        if phase(Phase::Latency) && opts.latency_samples > 0 {
            let latency = idle_latency(opts, names, db, tally, &mut peak_kib).await?;
            result.latency_confirm_p50_ms = Some(latency.0);
            result.latency_confirm_p99_ms = Some(latency.1);
            result.latency_delivery_p50_ms = Some(latency.2);
            result.latency_delivery_p99_ms = Some(latency.3);
        }
        result.peak_rss_mib = (peak_kib > 0).then(|| peak_kib as f64 / 1024.0);
        Ok(result)
    }

    /// Raw lapin publishing of `--messages` messages from `--processes` children; returns msg/s.
    async fn broker_ceiling(opts: &Opts, names: &Names, run: usize, tally: &Mutex<Tally>) -> Result<Spent, BoxError> {
        let n = opts.messages;
        let first_raw = RAW_ID_BASE + (run * n) as i64;
        let mut args = Vec::new();
        let mut next = first_raw;
        for count in shares(n, opts.processes) {
            let mut child = common_args(opts);
            child.extend(["child-broker", "--exchange", &names.exchange].map(str::to_owned));
            child.extend(["--first-id".to_owned(), next.to_string(), "--count".to_owned(), count.to_string()]);
            args.push(child);
            next += count as i64;
        }
        tally_of(tally).expect(first_raw, n, false);
        let mut kids = Kids::spawn(&args)?;
        kids.ready(Duration::from_secs(30)).await?;
        let servers = ServerTicks::read();
        let busy = machine_busy_seconds();
        let started = Instant::now();
        kids.go();
        let deadline = tokio::time::Instant::now() + opts.phase_timeout;
        let mut confirms = HashMap::new();
        let mut ended = None;
        let mut open = true;
        while ended.is_none() {
            tokio::select! {
                // The children exit once their last confirm is in; the consumer may still be busy.
                line = kids.lines.recv(), if open => match line {
                    Some(line) => kids.apply(line, &mut confirms)?,
                    None => open = false,
                },
                () = tokio::time::sleep(REPORT_PERIOD) => {}
                () = tokio::time::sleep_until(deadline) => return Err("broker ceiling phase timed out".into()),
            }
            if kids.kids.iter().all(|k| k.last.is_some()) && tally_of(tally).distinct == n {
                ended = Some(Spent::since(started, busy, &servers));
            }
        }
        let failed: u64 = kids.kids.iter().filter_map(|k| k.last.as_ref()?.get("failed")?.as_u64()).sum();
        if failed > 0 {
            return Err(format!("broker ceiling: {failed} publishes were not acked").into());
        }
        drop(kids);
        ended.ok_or_else(|| "broker ceiling ended without a time".into())
    }

    /// Empties the table, inserts `n` pending rows in one statement, vacuums and analyses it.
    /// Returns the first id and the count.
    async fn seed(db: &mut AsyncPgConnection, n: usize, opts: &Opts) -> Result<(i64, usize), BoxError> {
        db.batch_execute("TRUNCATE outbox").await?;
        #[derive(diesel::QueryableByName)]
        struct Range {
            #[diesel(sql_type = BigInt)]
            first: i64,
            #[diesel(sql_type = BigInt)]
            last: i64,
        }
        let range: Range = diesel::sql_query(
            "WITH inserted AS (
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'bench', (g % 1000)::text, $3, jsonb_build_object('n', g, 'pad', repeat('x', $2))
                 FROM generate_series(1, $1) AS g
                 RETURNING id)
             SELECT min(id) AS first, max(id) AS last FROM inserted",
        )
        .bind::<BigInt, _>(n as i64)
        .bind::<Int4, _>(opts.payload_bytes.saturating_sub(24) as i32)
        .bind::<Text, _>(EVENT_TYPE)
        .get_result(db)
        .await?;
        if range.last - range.first + 1 != n as i64 {
            return Err(format!("seeded ids are not contiguous: {}..={}", range.first, range.last).into());
        }
        db.batch_execute("VACUUM ANALYZE outbox").await?;
        Ok((range.first, n))
    }

    /// Fails unless exactly `n` rows exist and all are `done` (none at all with `--retention delete`).
    async fn verify_done(db: &mut AsyncPgConnection, n: usize, deleted: bool) -> Result<(), BoxError> {
        #[derive(diesel::QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            done: i64,
            #[diesel(sql_type = BigInt)]
            total: i64,
        }
        let c: Count =
            diesel::sql_query("SELECT count(*) FILTER (WHERE status = 'done') AS done, count(*) AS total FROM outbox")
                .get_result(db)
                .await?;
        if deleted {
            if c.total != 0 {
                return Err(format!("expected every row deleted, found {} rows ({} done)", c.total, c.done).into());
            }
        } else if c.done != n as i64 || c.total != n as i64 {
            return Err(format!("expected {n} rows all done, found {} done of {}", c.done, c.total).into());
        }
        Ok(())
    }

    /// Runs the dispatcher children with `sink` over the seeded table until `n` rows are done
    /// (and, with RabbitMQ, the consumer has every id); returns the time from `go`.
    #[allow(clippy::too_many_arguments)]
    async fn dispatch(
        opts: &Opts,
        names: &Names,
        sink: &str,
        n: usize,
        tally: &Mutex<Tally>,
        first: i64,
        peak_kib: &mut u64,
    ) -> Result<Spent, BoxError> {
        let rabbit = sink == "rabbit";
        tally_of(tally).expect(first, n, false);
        let args: Vec<_> = (0..opts.processes).map(|_| dispatcher_args(opts, names, sink, false)).collect();
        let mut kids = Kids::spawn(&args)?;
        kids.ready(Duration::from_secs(30)).await?;
        let servers = ServerTicks::read();
        let busy = machine_busy_seconds();
        let started = Instant::now();
        kids.go();
        let deadline = tokio::time::Instant::now() + opts.phase_timeout;
        let mut confirms = HashMap::new();
        let mut max_lag = 0_u64;
        let mut spent = loop {
            tokio::select! {
                line = kids.lines.recv() => match line {
                    Some(line) => kids.apply(line, &mut confirms)?,
                    None => return Err("dispatcher children vanished".into()),
                },
                () = tokio::time::sleep(REPORT_PERIOD) => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Err(format!("{sink} phase timed out with {} of {n} rows done", kids.done()).into());
                }
            }
            let consumed = tally_of(tally).distinct;
            if rabbit {
                max_lag = max_lag.max(kids.done().saturating_sub(consumed as u64));
            }
            if kids.done() >= n as u64 && (!rabbit || consumed == n) {
                break Spent::since(started, busy, &servers);
            }
        };
        let mut dispatcher_cpu = 0.0;
        for report in kids.stop(Duration::from_secs(30)).await? {
            *peak_kib = (*peak_kib).max(report.get("peak_rss_kib").and_then(|v| v.as_u64()).unwrap_or(0));
            dispatcher_cpu += report.get("cpu_seconds").and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
        }
        spent.dispatcher_cpu_seconds = dispatcher_cpu.is_finite().then_some(dispatcher_cpu);
        spent.consumer_lag = rabbit.then_some(max_lag);
        Ok(spent)
    }

    /// Inserts rows one at a time while the dispatcher idles; returns commit → confirm p50, p99
    /// and commit → delivery p50, p99 in milliseconds.
    async fn idle_latency(
        opts: &Opts,
        names: &Names,
        db: &mut AsyncPgConnection,
        tally: &Mutex<Tally>,
        peak_kib: &mut u64,
    ) -> Result<(f64, f64, f64, f64), BoxError> {
        db.batch_execute("TRUNCATE outbox").await?;
        let args: Vec<_> = (0..opts.processes).map(|_| dispatcher_args(opts, names, "rabbit", true)).collect();
        let mut kids = Kids::spawn(&args)?;
        kids.ready(Duration::from_secs(30)).await?;
        kids.go();
        let mut confirms = HashMap::new();
        let settle = tokio::time::Instant::now() + SETTLE;
        while let Ok(Some(line)) = tokio::time::timeout_at(settle, kids.lines.recv()).await {
            kids.apply(line, &mut confirms)?;
        }

        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = BigInt)]
            id: i64,
        }
        let insert = |n: usize| {
            diesel::sql_query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('bench', $1, $2, jsonb_build_object('n', $3::bigint, 'pad', repeat('x', $4)))
                 RETURNING id",
            )
            .bind::<Text, _>((n % 1000).to_string())
            .bind::<Text, _>(EVENT_TYPE)
            .bind::<BigInt, _>(n as i64)
            .bind::<Int4, _>(opts.payload_bytes.saturating_sub(24) as i32)
        };
        // The ids are known only once inserted: record every arrival, whatever its id.
        tally_of(tally).expect(0, 0, true);
        let mut commits: Vec<(i64, SystemTime)> = Vec::with_capacity(opts.latency_samples);
        let mut next_tick = tokio::time::Instant::now();
        for sample in 0..opts.latency_samples {
            tokio::time::sleep_until(next_tick).await;
            next_tick += opts.latency_interval;
            let id: Id = insert(sample).get_result(db).await?;
            // The autocommit INSERT has returned: the row is committed and visible.
            let committed = SystemTime::now();
            commits.push((id.id, committed));
            while let Ok(line) = kids.lines.try_recv() {
                kids.apply(line, &mut confirms)?;
            }
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let all_in = |confirms: &HashMap<i64, SystemTime>, tally: &Tally| {
            let arrivals = tally.arrivals.as_ref();
            commits.iter().all(|(id, _)| confirms.contains_key(id) && arrivals.is_some_and(|a| a.contains_key(id)))
        };
        while !all_in(&confirms, &tally_of(tally)) {
            match tokio::time::timeout_at(deadline, kids.lines.recv()).await {
                Ok(Some(line)) => kids.apply(line, &mut confirms)?,
                Ok(None) => return Err("dispatcher children vanished".into()),
                Err(_) => return Err("latency rows were not all confirmed within 30 s".into()),
            }
        }
        for report in kids.stop(Duration::from_secs(30)).await? {
            *peak_kib = (*peak_kib).max(report.get("peak_rss_kib").and_then(|v| v.as_u64()).unwrap_or(0));
        }
        let arrivals = tally_of(tally).arrivals.take().unwrap_or_default();
        let millis = |from: SystemTime, to: SystemTime| to.duration_since(from).unwrap_or_default().as_secs_f64() * 1e3;
        let mut to_confirm: Vec<f64> = commits.iter().map(|(id, c)| millis(*c, confirms[id])).collect();
        let mut to_delivery: Vec<f64> = commits.iter().map(|(id, c)| millis(*c, arrivals[id])).collect();
        Ok((
            percentile(&mut to_confirm, 0.50),
            percentile(&mut to_confirm, 0.99),
            percentile(&mut to_delivery, 0.50),
            percentile(&mut to_delivery, 0.99),
        ))
    }

    /// Nearest-rank percentile.
    fn percentile(values: &mut [f64], p: f64) -> f64 {
        values.sort_by(f64::total_cmp);
        let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
        values[rank - 1]
    }

    fn median(mut values: Vec<f64>) -> f64 {
        values.sort_by(f64::total_cmp);
        let mid = values.len() / 2;
        if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 }
    }

    fn median_of(runs: &[RunResult]) -> RunResult {
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
            latency_confirm_p50_ms: m(|r| r.latency_confirm_p50_ms),
            latency_confirm_p99_ms: m(|r| r.latency_confirm_p99_ms),
            latency_delivery_p50_ms: m(|r| r.latency_delivery_p50_ms),
            latency_delivery_p99_ms: m(|r| r.latency_delivery_p99_ms),
            peak_rss_mib: m(|r| r.peak_rss_mib),
            end_to_end_duplicates: runs.iter().map(|r| r.end_to_end_duplicates).max().unwrap_or(0),
            end_to_end_consumer_lag: runs.iter().filter_map(|r| r.end_to_end_consumer_lag).max(),
        }
    }

    fn print_report(report: &Report<'_>) {
        let o = report.options;
        println!(
            "actix-outbox bench  {}  {} cores (shared by PostgreSQL {}, RabbitMQ, the dispatcher and the bench)",
            report.date, report.machine.cores, report.machine.postgres
        );
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
        println!(
            "with the RabbitMQ sink, to every row done and every id at the consumer; ratio = e2e / min(broker, db);"
        );
        println!("cpu:* = busy CPU time of the whole machine per message in that phase (us, all processes);");
        println!("disp:* = CPU time of the dispatcher processes alone per message (us);");
        println!("pg:e2e, mq:e2e = CPU time of the PostgreSQL, of the RabbitMQ processes per message end to end (us);");
        println!(
            "conf/dlv = idle latency (ms, {} rows {} apart) from the producer's commit to the sink's publisher confirm / to",
            o.latency_samples,
            humantime::format_duration(o.latency_interval)
        );
        println!(
            "the consumer's delivery; rss = largest peak RSS (VmHWM) of one dispatcher process; dups = duplicate deliveries."
        );
    }
}
