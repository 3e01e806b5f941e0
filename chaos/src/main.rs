//! `actix-outbox-chaos`: a seeded chaos run of the dispatcher, one command.
//!
//! Several real `actix-outbox run` processes share one fresh database and one exchange, each
//! reaching PostgreSQL and RabbitMQ through TCP proxies of its own, while a producer commits
//! rows and a consumer records every delivery. Faults from a schedule the seed fixes kill,
//! stop and restart the processes, cut, blackhole, delay and slow their links, play the
//! broker's memory alarm and insert rows the sink rejects. At the end everything drains, the
//! dispatchers stop gracefully, and the run checks what the dispatcher promises: no committed
//! row lost, none dead but the poisoned, none left processing, duplicates within what each
//! fault allows, no stale write past a fence, and under `--fifo` each aggregate's first
//! deliveries in id order. See docs/chaos.md.
//!
//! Only the proxies are faulted, never the services: other work shares them.

mod fleet;
mod plan;
mod verdict;
mod world;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::sync::{mpsc, watch};

use crate::fleet::{RunFlags, Slot};
use crate::plan::{Fault, Kind, Service, Shape, Window};

/// A seeded chaos run of actix-outbox against the real PostgreSQL and RabbitMQ.
#[derive(Debug, Clone, Parser)]
#[command(after_help = "Example:\n  cargo run --release -p actix-outbox-chaos -- --minutes 10 --seed 42 --fifo\n\n\
                  Exit status: 0 when every check passed, 1 on a violation (the seed to replay it is printed), \
                  2 when the run could not be carried out.")]
struct Args {
    /// Minutes of production and faults (the drain comes on top)
    #[arg(long, value_name = "N", conflicts_with = "seconds")]
    minutes: Option<u64>,
    /// Seconds of production and faults, for short runs
    #[arg(long, value_name = "N")]
    seconds: Option<u64>,
    /// Seed of the fault schedule and of the producer (default: random, printed)
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Run the dispatchers with `--fifo` and check per-aggregate order
    #[arg(long)]
    fifo: bool,
    /// Dispatcher processes
    #[arg(long, value_name = "P", default_value_t = 3)]
    processes: usize,
    /// The actix-outbox executable (default: built next to this tool, in its profile)
    #[arg(long, value_name = "PATH")]
    bin: Option<PathBuf>,
    /// Producer transactions a second
    #[arg(long, value_name = "N", default_value_t = 40)]
    rate: u32,
    /// Aggregates the producer spreads its rows over
    #[arg(long, value_name = "N", default_value_t = 64)]
    aggregates: u64,
    /// `run --workers` of each process
    #[arg(long, value_name = "N", default_value_t = 2)]
    workers: u64,
    /// `run --batch` of each process
    #[arg(long, value_name = "N", default_value_t = 20)]
    batch: u64,
    /// `run --max-in-flight` of each process
    #[arg(long, value_name = "N", default_value_t = 40)]
    max_in_flight: u64,
    /// `run --lease`: short, so that takeovers happen within the run
    #[arg(long, value_name = "DURATION", default_value = "2s")]
    lease: humantime::Duration,
    /// `run --publish-timeout` (shorter than the lease)
    #[arg(long, value_name = "DURATION", default_value = "1s")]
    publish_timeout: humantime::Duration,
    /// Mean pause between the starts of two faults
    #[arg(long, value_name = "DURATION", default_value = "3s")]
    fault_gap: humantime::Duration,
    /// How long the drain may take once production stops
    #[arg(long, value_name = "DURATION", default_value = "3m")]
    drain: humantime::Duration,
    /// Against a three-node RabbitMQ cluster of the run's own (started as the tests start it,
    /// on free ports), the queue a quorum queue led by node 1: the schedule adds node losses
    /// (node 1 or 2 killed with SIGKILL, started again after a pause). Each process reaches
    /// node 1 or 2 through its proxy and is given the other nodes too; node 0 serves the run's
    /// consumer and is never killed
    #[arg(long)]
    cluster: bool,
}

impl Args {
    fn run_length(&self) -> Duration {
        match (self.minutes, self.seconds) {
            (Some(m), _) => Duration::from_secs(m * 60),
            (None, Some(s)) => Duration::from_secs(s),
            (None, None) => Duration::from_secs(120),
        }
    }

    /// The command that replays this run.
    fn replay(&self, seed: u64) -> String {
        let mut cmd = format!(
            "cargo run --release -p actix-outbox-chaos -- --seconds {} --seed {seed} --processes {}",
            self.run_length().as_secs(),
            self.processes
        );
        if self.fifo {
            cmd += " --fifo";
        }
        if self.cluster {
            cmd += " --cluster";
        }
        cmd
    }
}

/// Rows committed at once just before a process fault.
const BURST: u64 = 300;
/// How long a process fault waits for its target to hold rows before it strikes anyway.
const BURST_WAIT: Duration = Duration::from_millis(1500);

/// What a fault did, for the table.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// How long it actually lasted.
    pub lasted: Duration,
    /// What happened, for the table.
    pub note: String,
    /// Promises it saw broken.
    pub violations: Vec<String>,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(random_seed);
    let code = tokio::select! {
        code = run(&args, seed) => code,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("chaos: interrupted (seed {seed}); the run's database and exchange may be left behind");
            130
        }
    };
    std::process::exit(code);
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    // Short enough to type.
    h.finish() % 1_000_000
}

async fn run(args: &Args, seed: u64) -> i32 {
    if args.processes == 0 || args.publish_timeout.as_ref() >= args.lease.as_ref() {
        eprintln!("chaos: need at least one process and a publish timeout shorter than the lease");
        return 2;
    }
    let bin = match fleet::find_binary(args.bin.as_deref()) {
        Ok(bin) => bin,
        Err(e) => {
            eprintln!("chaos: {e}");
            return 2;
        }
    };
    let tag = format!("{}_{seed}", std::process::id());
    // The run's own cluster, if asked for: stopped (its folder removed) when the run ends.
    let cluster = match args.cluster {
        true => {
            println!("chaos: starting a three-node RabbitMQ cluster");
            Some(actix_outbox_test_support::RabbitCluster::start().await)
        }
        false => None,
    };
    let broker = match &cluster {
        Some(cluster) => world::Broker { url: cluster.url(0), quorum: true },
        None => world::Broker::default(),
    };
    let world = match world::World::create(&tag, broker).await {
        Ok(w) => w,
        Err(e) => {
            eprintln!("chaos: {e}");
            return 2;
        }
    };
    let log_dir = std::env::temp_dir().join(format!("actix-outbox-chaos-{tag}"));
    let _ = std::fs::create_dir_all(&log_dir);
    let nodes: Vec<fleet::Node> = match &cluster {
        Some(cluster) => (0..actix_outbox_test_support::cluster::NODES)
            .map(|i| fleet::Node { addr: format!("127.0.0.1:{}", cluster.port(i)), url: cluster.url(i) })
            .collect(),
        None => vec![fleet::Node { addr: "127.0.0.1:5672".into(), url: world::AMQP.into() }],
    };
    if let Some(cluster) = &cluster {
        // Led by a node that a fault may kill.
        cluster.transfer_leadership(&world.queue, 1).await;
    }
    let cluster = cluster.map(|c| Arc::new(tokio::sync::Mutex::new(c)));
    let code = match drive(args, seed, &bin, &world, &log_dir, nodes, cluster.clone()).await {
        Ok(verdict) if verdict.passed() => {
            let _ = std::fs::remove_dir_all(&log_dir);
            0
        }
        Ok(_) => {
            eprintln!("chaos: dispatcher logs kept in {}", log_dir.display());
            1
        }
        Err(e) => {
            eprintln!("chaos: the run could not be carried out: {e} (seed {seed}; logs in {})", log_dir.display());
            2
        }
    };
    world.remove().await;
    code
}

async fn drive(
    args: &Args,
    seed: u64,
    bin: &std::path::Path,
    world: &world::World,
    log_dir: &std::path::Path,
    nodes: Vec<fleet::Node>,
    cluster: Option<Cluster>,
) -> Result<verdict::Verdict, String> {
    let length = args.run_length();
    let lease: Duration = args.lease.into();
    let publish_timeout: Duration = args.publish_timeout.into();
    let shape =
        Shape { run: length, processes: args.processes, lease, mean_gap: args.fault_gap.into(), cluster: args.cluster };
    let faults = plan::schedule(seed, &shape);
    let window = Window { workers: args.workers, max_in_flight: args.max_in_flight, publish_timeout, lease };
    println!(
        "chaos: seed {seed}, {} processes, {}s of production, {} faults scheduled{}",
        args.processes,
        length.as_secs(),
        faults.len(),
        if args.fifo { ", --fifo" } else { "" },
    );
    if args.cluster {
        println!("chaos: a three-node RabbitMQ cluster, a quorum queue; node losses scheduled among the faults");
    }
    println!(
        "chaos: database {}, exchange {}, dispatcher {} (workers {}, batch {}, max in flight {}, lease {}, publish timeout {})",
        world.database,
        world.exchange,
        bin.display(),
        args.workers,
        args.batch,
        args.max_in_flight,
        args.lease,
        args.publish_timeout
    );

    let flags = RunFlags {
        bin: bin.to_owned(),
        database_url: world.url.clone(),
        exchange: world.exchange.clone(),
        workers: args.workers,
        batch: args.batch,
        max_in_flight: args.max_in_flight,
        lease,
        publish_timeout,
        fifo: args.fifo,
        log_dir: log_dir.to_owned(),
        nodes,
    };
    let started = Instant::now();
    let mut slots = Vec::new();
    for i in 0..args.processes {
        let slot = Slot::new(i, flags.clone(), started).await;
        slot.spawn().map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        slots.push(slot);
    }

    let log: world::Log = Default::default();
    // A full queue stops the consumer for its duration.
    let (pause, paused) = watch::channel(false);
    let consumer =
        tokio::spawn(world::consume(world.broker.url.clone(), world.queue.clone(), log.clone(), started, paused));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (poison_tx, poison_rx) = mpsc::unbounded_channel();
    let producer = tokio::spawn(world::produce(
        world.url.clone(),
        seed,
        args.rate,
        args.aggregates,
        args.fifo,
        poison_rx,
        stop_rx,
    ));

    let mut tasks = Vec::new();
    for (index, fault) in faults.iter().cloned().enumerate() {
        let slot = slots[fault.process].clone();
        let others: Vec<Arc<Slot>> = slots.iter().filter(|s| s.index != fault.process).cloned().collect();
        let poison = poison_tx.clone();
        let url = world.url.clone();
        let cluster = cluster.clone();
        let pause = pause.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((started + fault.at).into()).await;
            let ctx = Context {
                requests: &poison,
                url: &url,
                stop_allowance: lease + publish_timeout,
                cluster,
                pause: &pause,
            };
            inflict(index, &fault, &slot, &others, &ctx).await
        }));
    }

    // The audit needs each process's connections named after it: check once they are up.
    tokio::time::sleep(Duration::from_secs(3).min(length)).await;
    let names = world::session_names(&world.url, &world.database).await?;
    let unnamed: Vec<_> = names.iter().filter(|n| !n.starts_with("chaos-p")).cloned().collect();

    tokio::time::sleep_until((started + length).into()).await;
    let _ = stop_tx.send(true);
    let produced = producer.await.map_err(|e| e.to_string())??;
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.map_err(|e| e.to_string())?);
    }
    println!(
        "chaos: production stopped at {:.1}s ({} rows committed, {} poison, {} rolled back); draining",
        started.elapsed().as_secs_f64(),
        produced.committed.len(),
        produced.poison.len(),
        produced.rolled_back.len()
    );

    let drained = drain(&world.url, &log, args.drain.into()).await?;
    let drain_took = drained.1;
    if consumer.is_finished() {
        let why = match consumer.await {
            Ok(Err(e)) => e,
            other => format!("{other:?}"),
        };
        return Err(format!("the consumer stopped during the run: {why}"));
    }

    // The last graceful stop: every process at once, as a deploy would.
    let mut stops = Vec::new();
    for slot in &slots {
        let slot = slot.clone();
        stops.push(tokio::spawn(async move {
            let owner = slot.owner();
            let status = slot.end(libc::SIGTERM, Duration::from_secs(30)).await;
            slot.close();
            (owner, status)
        }));
    }
    let mut final_stops = Vec::new();
    for stop in stops {
        final_stops.push(stop.await.map_err(|e| e.to_string())?);
    }
    // Duplicates still on their way from the broker.
    tokio::time::sleep(Duration::from_secs(2)).await;
    consumer.abort();

    let rows = world::rows(&world.url).await?;
    let stale = world::stale_writes(&world.url).await?;
    let deliveries = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let unexpected = slots.iter().flat_map(|s| s.unexpected()).collect();
    let verdict = verdict::Verdict::judge(verdict::Evidence {
        fifo: args.fifo,
        processes: args.processes,
        faults: &faults,
        outcomes: &outcomes,
        window,
        slack: lease + publish_timeout + Duration::from_secs(10),
        produced: &produced,
        rows: &rows,
        deliveries: &deliveries,
        stale: &stale,
        unexpected,
        final_stops,
        unnamed,
        drained: drained.0,
        drain_took,
    });
    verdict.print(seed, &args.replay(seed));
    Ok(verdict)
}

/// Waits until no row is pending or processing and every `done` row has been delivered, or
/// until `deadline`: whether it drained, and how long it took.
async fn drain(url: &str, log: &world::Log, deadline: Duration) -> Result<(bool, Duration), String> {
    let begun = Instant::now();
    loop {
        let rows = world::rows(url).await?;
        let delivered: std::collections::HashSet<i64> =
            log.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|d| d.id).collect();
        let mut open = BTreeMap::<&str, usize>::new();
        for r in &rows {
            if r.status == "pending" || r.status == "processing" || (r.status == "done" && !delivered.contains(&r.id)) {
                *open.entry(r.status.as_str()).or_default() += 1;
            }
        }
        if open.is_empty() {
            return Ok((true, begun.elapsed()));
        }
        if begun.elapsed() > deadline {
            println!("chaos: not drained after {}s: {open:?}", deadline.as_secs());
            return Ok((false, begun.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The run's cluster, which node losses kill nodes of and start them again.
type Cluster = Arc<tokio::sync::Mutex<actix_outbox_test_support::RabbitCluster>>;

/// What a fault reaches besides its process.
struct Context<'a> {
    /// The producer, for bursts and poison rows.
    requests: &'a mpsc::UnboundedSender<world::Request>,
    /// The run's database.
    url: &'a str,
    /// How long a graceful stop may take.
    stop_allowance: Duration,
    /// The run's cluster, with `--cluster`.
    cluster: Option<Cluster>,
    /// Stops (`true`) and resumes the run's consumer.
    pause: &'a watch::Sender<bool>,
}

/// Carries out fault `index` on `slot` and says how it went.
async fn inflict(index: usize, fault: &Fault, slot: &Arc<Slot>, others: &[Arc<Slot>], ctx: &Context<'_>) -> Outcome {
    let (requests, url, stop_allowance) = (ctx.requests, ctx.url, ctx.stop_allowance);
    let begun = Instant::now();
    let mut out = Outcome::default();
    let proxy = |service| match service {
        Service::Db => &slot.db,
        Service::Broker => &slot.broker,
    };
    let on_db = |kind: Kind| kind.holds_db();
    if on_db(fault.kind) {
        slot.db_faulted.store(true, Ordering::Relaxed);
    }
    // A process fault is aimed at a process holding rows: an idle one would test nothing.
    let mut held = None;
    if matches!(fault.kind, Kind::Kill | Kind::Stop | Kind::Term | Kind::StaleWake) {
        let _ = requests.send(world::Request::Burst(BURST));
        held = Some(wait_loaded(url, &slot.owner(), BURST_WAIT).await);
    }
    let held = held.map_or(String::new(), |n| format!(" holding {n} rows"));
    match fault.kind {
        Kind::Kill => {
            let owner = slot.owner();
            let status = slot.end(libc::SIGKILL, Duration::from_secs(10)).await;
            tokio::time::sleep(fault.duration).await;
            out.note = match status {
                Some(_) => format!("{owner} killed{held}, restarted"),
                None => format!("{owner} was not running; restarted"),
            };
            restart(slot, &mut out);
        }
        Kind::Stop => {
            let owner = slot.owner();
            slot.signal(libc::SIGSTOP);
            tokio::time::sleep(fault.duration).await;
            slot.signal(libc::SIGCONT);
            out.note = format!("{owner} stopped{held} past its lease, continued");
        }
        Kind::StaleWake => {
            let owner = slot.owner();
            for other in others {
                other.broker.delay(plan::STALE_WAKE_LATENCY);
            }
            slot.signal(libc::SIGSTOP);
            tokio::time::sleep(fault.duration).await;
            slot.signal(libc::SIGCONT);
            tokio::time::sleep(plan::STALE_WAKE_TAIL).await;
            for other in others {
                other.broker.delay(Duration::ZERO);
            }
            out.note = format!("{owner} stopped{held} past its lease, woke while the others' broker links were slow");
        }
        Kind::Term => {
            let owner = slot.owner();
            // The documented drain is bounded by the publish timeout; a faulted link may hold
            // it for a lease more, and a blocked broker until the alarm ends.
            let within = stop_allowance + Duration::from_secs(20);
            let db_was_faulted = slot.db_faulted.load(Ordering::Relaxed);
            match slot.end(libc::SIGTERM, within).await {
                Some(status) if status.success() => {
                    let left = processing_of(url, &owner).await;
                    out.note = format!("{owner}{held} exit 0 after {:.1}s", begun.elapsed().as_secs_f64());
                    match left {
                        Ok(0) => {}
                        Ok(n) if db_was_faulted || slot.db_faulted.load(Ordering::Relaxed) => {
                            out.note += &format!(", {n} rows left processing (its database link was faulted)");
                        }
                        Ok(n) => out.violations.push(format!(
                            "fault #{}: {owner} left {n} rows processing after a graceful stop",
                            index + 1
                        )),
                        Err(e) => out.note += &format!(" (rows unreadable: {e})"),
                    }
                }
                Some(status) => out.violations.push(format!(
                    "fault #{}: {owner} answered SIGTERM with {}",
                    index + 1,
                    fleet::describe(status)
                )),
                None => out.violations.push(format!(
                    "fault #{}: {owner} did not stop within {}s of SIGTERM (killed)",
                    index + 1,
                    within.as_secs()
                )),
            }
            tokio::time::sleep(fault.duration).await;
            restart(slot, &mut out);
        }
        Kind::Cut(service) => {
            let p = proxy(service);
            p.refuse(true);
            p.sever();
            tokio::time::sleep(fault.duration).await;
            p.refuse(false);
            out.note = "connections closed and refused".into();
        }
        Kind::Blackhole { service, downstream_only } => {
            let p = proxy(service);
            if downstream_only {
                p.stall_downstream()
            } else {
                p.blackhole()
            }
            tokio::time::sleep(fault.duration).await;
            p.resume();
            out.note = "held bytes released".into();
        }
        Kind::Delay { service, latency } => {
            proxy(service).delay(latency);
            tokio::time::sleep(fault.duration).await;
            proxy(service).delay(Duration::ZERO);
        }
        Kind::Slow { service, bytes_per_second } => {
            proxy(service).slow_reads(Some(bytes_per_second));
            tokio::time::sleep(fault.duration).await;
            proxy(service).slow_reads(None);
        }
        Kind::Freeze(service) => {
            let p = proxy(service);
            p.freeze();
            tokio::time::sleep(fault.duration).await;
            p.thaw();
            out.note = "the connections open then frozen, thawed at the end".into();
        }
        Kind::FullQueue => {
            let _ = ctx.pause.send(true);
            tokio::time::sleep(fault.duration).await;
            let _ = ctx.pause.send(false);
            out.note = format!("consumer stopped, queue capped at {}", plan::QUEUE_LIMIT);
        }
        Kind::Alarm => {
            slot.broker.amqp_block();
            tokio::time::sleep(fault.duration).await;
            slot.broker.amqp_unblock();
        }
        Kind::PoisonUnroutable | Kind::PoisonHeader => {
            let _ = requests.send(world::Request::Poison(fault.kind, index));
            out.note = "row inserted".into();
        }
        Kind::NodeLoss { node } => match &ctx.cluster {
            Some(cluster) => {
                cluster.lock().await.kill(node).await;
                tokio::time::sleep(fault.duration).await;
                cluster.lock().await.start_node(node).await;
                out.note = format!("node {node} killed, back after {:.1}s", begun.elapsed().as_secs_f64());
            }
            None => out.violations.push(format!("fault #{}: a node loss without a cluster", index + 1)),
        },
    }
    if on_db(fault.kind) {
        slot.db_faulted.store(false, Ordering::Relaxed);
    }
    out.lasted = begun.elapsed();
    out
}

fn restart(slot: &Arc<Slot>, out: &mut Outcome) {
    if let Err(e) = slot.spawn() {
        out.violations.push(format!("cannot restart p{}: {e}", slot.index + 1));
    }
}

/// Polls until `owner` holds rows (or `within` passes): how many it held then.
async fn wait_loaded(url: &str, owner: &str, within: Duration) -> i64 {
    let until = Instant::now() + within;
    let Ok(mut conn) = actix_outbox::admin::connect(&world::tool_url(url)).await else { return 0 };
    loop {
        let held = processing_count(&mut conn, owner).await.unwrap_or(0);
        if held > 0 || Instant::now() >= until {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Rows `processing` under any worker of `owner`.
async fn processing_of(url: &str, owner: &str) -> Result<i64, String> {
    let mut conn = actix_outbox::admin::connect(&world::tool_url(url)).await.map_err(|e| e.to_string())?;
    processing_count(&mut conn, owner).await
}

async fn processing_count(conn: &mut diesel_async::AsyncPgConnection, owner: &str) -> Result<i64, String> {
    use diesel::prelude::*;
    use diesel_async::RunQueryDsl;
    actix_outbox::schema::outbox::table
        .filter(actix_outbox::schema::outbox::status.eq(actix_outbox::admin::Status::Processing))
        .filter(actix_outbox::schema::outbox::lease_owner.like(format!("{owner}:%")))
        .count()
        .get_result(conn)
        .await
        .map_err(|e| e.to_string())
}
