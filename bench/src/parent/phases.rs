//! The phases of one run (broker ceiling, database ceiling, end to end, idle latency, loaded
//! latency, history) and what each cost; with a pooler, the dispatcher phases (end to end and
//! both latencies) run a second time with the dispatchers behind it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use diesel::sql_types::{BigInt, Int4, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::Names;
use super::bouncer::Bouncer;
use super::drain_curve::CURVE_STEP;
use super::kids::Kids;
use super::meter::{DbCounters, WindowCost};
use super::producer::{Plan, insert_row};
use super::report::{Cost, Loaded, Pair, PoolerRun, RunResult, Way};
use super::stats::{Spread, percentile};
use super::steady::Steady;
use super::tally::{Tally, tally_of};
use crate::procstat::{Server, ServerTicks, machine_busy_seconds};
use crate::{BoxError, EVENT_TYPE, Opts, Phase, RAW_ID_BASE, REPORT_PERIOD, RetentionArg, SETTLE};

#[derive(Debug, Clone)]
pub(super) struct Spent {
    wall: Duration,
    cpu_seconds: Option<f64>,
    /// CPU time of the dispatcher processes alone (dispatcher phases only).
    dispatcher_cpu_seconds: Option<f64>,
    /// Most rows done but not yet seen by the consumer at once (end to end only).
    consumer_lag: Option<u64>,
    /// CPU seconds of the PostgreSQL and of the RabbitMQ processes over the phase.
    postgres_cpu_seconds: f64,
    rabbitmq_cpu_seconds: f64,
    /// Per message: PostgreSQL's CPU, and the pooler's (dispatcher phases only).
    cost: Cost,
    /// Rows done so far, every [`CURVE_STEP`] from `go` (dispatcher phases only).
    pub(super) curve: Vec<u64>,
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
            cost: Cost::default(),
            curve: Vec::new(),
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

/// Which way a phase's dispatcher children reach the database.
#[derive(Clone, Copy)]
pub(super) enum Via<'a> {
    /// Straight to the server.
    Direct,
    /// Through the transaction pooler (`Pooler::Transaction`), the listener straight to the
    /// server.
    Pooler(&'a Bouncer),
}

/// What a phase costs the servers, read when it starts: PostgreSQL's CPU and, through a
/// pooler, the bouncer's CPU and transaction count.
struct Meter {
    servers: ServerTicks,
    bouncer_cpu: Option<f64>,
    bouncer_xacts: Option<u64>,
}

impl Meter {
    async fn start(via: Via<'_>, names: &Names) -> Self {
        let bouncer_xacts = match via {
            Via::Direct => None,
            Via::Pooler(bouncer) => bouncer.xact_count(&names.database).await,
        };
        let bouncer_cpu = match via {
            Via::Direct => None,
            Via::Pooler(bouncer) => bouncer.cpu_seconds(),
        };
        Self { servers: ServerTicks::read(), bouncer_cpu, bouncer_xacts }
    }

    /// The cost per message of the `n` messages since [`Meter::start`].
    async fn cost(&self, via: Via<'_>, names: &Names, n: usize) -> Cost {
        let postgres = self.servers.spent_since(&ServerTicks::read(), Server::Postgres);
        let (cpu, xacts) = match via {
            Via::Direct => (None, None),
            Via::Pooler(bouncer) => (bouncer.cpu_seconds(), bouncer.xact_count(&names.database).await),
        };
        let per = |v: f64| v / n as f64;
        Cost {
            postgres_us_per_msg: Spent::server_us_per_message(postgres, n),
            bouncer_us_per_msg: self.bouncer_cpu.zip(cpu).map(|(a, b)| per((b - a) * 1e6)),
            bouncer_xacts_per_msg: self.bouncer_xacts.zip(xacts).map(|(a, b)| per(b.saturating_sub(a) as f64)),
        }
    }
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
    if let Some(rate) = opts.max_rate {
        args.extend(["--max-rate".to_owned(), rate.to_string()]);
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

fn dispatcher_args(opts: &Opts, names: &Names, via: Via<'_>, sink: &str, report_confirms: bool) -> Vec<String> {
    let mut args = common_args(opts);
    let db = match via {
        Via::Direct => names.database_url.clone(),
        Via::Pooler(bouncer) => bouncer.route(&names.database),
    };
    args.extend(["child-dispatcher", "--db", &db, "--exchange", &names.exchange, "--sink", sink].map(str::to_owned));
    if let Via::Pooler(_) = via {
        args.extend(["--direct-url".to_owned(), names.database_url.clone()]);
    }
    if report_confirms {
        args.push("--report-confirms".to_owned());
    }
    args
}

/// Splits `total` as evenly as possible over `parts`.
fn shares(total: usize, parts: usize) -> impl Iterator<Item = usize> {
    (0..parts).map(move |i| total / parts + usize::from(i < total % parts))
}

/// One run: every phase `--phases` asks for, in order, and the figures they give.
pub(super) async fn one_run(
    opts: &Opts,
    names: &Names,
    source: &str,
    run: usize,
    db: &mut AsyncPgConnection,
    tally: &Arc<Mutex<Tally>>,
    bouncer: Option<&Bouncer>,
) -> Result<RunResult, BoxError> {
    let n = opts.messages;
    let mut result = RunResult::default();
    let mut peak_kib = 0_u64;
    let mut pooler = PoolerRun::default();

    let phase = |p: Phase| opts.phases.contains(&p);

    // 1. Broker ceiling.
    if phase(Phase::Broker) {
        let spent = broker_ceiling(opts, names, source, run, tally).await?;
        result.broker_ceiling_msg_s = Some(spent.rate(n));
        result.broker_cpu_us_per_msg = spent.cpu_us_per_message(n);
    }

    // 2. Database ceiling.
    if phase(Phase::Database) {
        let first = seed(db, n, 0, opts).await?;
        let spent = dispatch(opts, names, Via::Direct, "null", n, tally, first, &mut peak_kib).await?;
        verify_done(db, n, 0, opts.retention == RetentionArg::Delete).await?;
        result.database_ceiling_msg_s = Some(spent.rate(n));
        result.database_cpu_us_per_msg = spent.cpu_us_per_message(n);
        result.database_dispatcher_us_per_msg = spent.dispatcher_us_per_message(n);
    }

    // 3. End to end.
    if phase(Phase::E2e) {
        let first = seed(db, n, 0, opts).await?;
        let wal = wal_position(db).await?;
        let spent = dispatch(opts, names, Via::Direct, "rabbit", n, tally, first, &mut peak_kib).await?;
        result.end_to_end_wal_bytes_per_msg = Some((wal_position(db).await? - wal) / n as f64);
        verify_done(db, n, 0, opts.retention == RetentionArg::Delete).await?;
        result.end_to_end_msg_s = Some(spent.rate(n));
        result.end_to_end_cpu_us_per_msg = spent.cpu_us_per_message(n);
        result.end_to_end_dispatcher_us_per_msg = spent.dispatcher_us_per_message(n);
        result.end_to_end_postgres_us_per_msg = Spent::server_us_per_message(spent.postgres_cpu_seconds, n);
        result.end_to_end_rabbitmq_us_per_msg = Spent::server_us_per_message(spent.rabbitmq_cpu_seconds, n);
        result.end_to_end_consumer_lag = spent.consumer_lag;
        result.end_to_end_duplicates = tally_of(tally).duplicates;
        if let Some(bouncer) = bouncer {
            let direct = Way { msg_s: spent.rate(n), p50_ms: None, p99_ms: None, cost: spent.cost };
            let first = seed(db, n, 0, opts).await?;
            let spent = dispatch(opts, names, Via::Pooler(bouncer), "rabbit", n, tally, first, &mut peak_kib).await?;
            verify_done(db, n, 0, opts.retention == RetentionArg::Delete).await?;
            let duplicates = tally_of(tally).duplicates;
            result.end_to_end_duplicates = result.end_to_end_duplicates.max(duplicates);
            let pooled = Way { msg_s: spent.rate(n), p50_ms: None, p99_ms: None, cost: spent.cost };
            pooler.e2e = Some(Pair::new(direct, pooled));
        }
    }

    // 4. The ratio.
    if let (Some(e2e), Some(broker), Some(database)) =
        (result.end_to_end_msg_s, result.broker_ceiling_msg_s, result.database_ceiling_msg_s)
    {
        result.ratio = Some(e2e / broker.min(database));
    }

    // 5. Idle latency.
    if phase(Phase::Latency) && opts.latency_samples > 0 {
        let latency = idle_latency(opts, names, Via::Direct, db, tally, &mut peak_kib).await?;
        result.latency_confirm_p50_ms = Some(latency.confirm_p50_ms);
        result.latency_confirm_p99_ms = Some(latency.confirm_p99_ms);
        result.latency_delivery_p50_ms = latency.way.p50_ms;
        result.latency_delivery_p99_ms = latency.way.p99_ms;
        if let Some(bouncer) = bouncer {
            let pooled = idle_latency(opts, names, Via::Pooler(bouncer), db, tally, &mut peak_kib).await?;
            pooler.latency = Some(Pair::new(latency.way, pooled.way));
        }
    }

    // 6. Loaded latency.
    if phase(Phase::Loaded) {
        let (loaded, direct) = loaded_latency(opts, names, Via::Direct, db, tally, &mut peak_kib).await?;
        result.loaded = Some(loaded);
        if let Some(bouncer) = bouncer {
            let (_, pooled) = loaded_latency(opts, names, Via::Pooler(bouncer), db, tally, &mut peak_kib).await?;
            pooler.loaded = Some(Pair::new(direct, pooled));
        }
    }
    result.pooler = bouncer.is_some().then_some(pooler);

    // 7. End to end beside a kept history.
    if phase(Phase::History) {
        let first = seed(db, n, opts.kept_done, opts).await?;
        let wal = wal_position(db).await?;
        let spent = dispatch(opts, names, Via::Direct, "rabbit", n, tally, first, &mut peak_kib).await?;
        result.history_wal_bytes_per_msg = Some((wal_position(db).await? - wal) / n as f64);
        verify_done(db, n, opts.kept_done, opts.retention == RetentionArg::Delete).await?;
        let rate = spent.rate(n);
        result.history_msg_s = Some(rate);
        result.history_ratio = result.end_to_end_msg_s.map(|e2e| rate / e2e);
        result.history_postgres_us_per_msg = Spent::server_us_per_message(spent.postgres_cpu_seconds, n);
    }
    result.peak_rss_mib = (peak_kib > 0).then(|| peak_kib as f64 / 1024.0);
    Ok(result)
}

/// The server's WAL insert position, in bytes.
async fn wal_position(db: &mut AsyncPgConnection) -> Result<f64, BoxError> {
    #[derive(diesel::QueryableByName)]
    struct Lsn {
        #[diesel(sql_type = diesel::sql_types::Double)]
        bytes: f64,
    }
    let lsn: Lsn = diesel::sql_query("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS bytes")
        .get_result(db)
        .await?;
    Ok(lsn.bytes)
}

/// Raw lapin publishing of `--messages` messages from `--processes` children; returns msg/s.
async fn broker_ceiling(
    opts: &Opts,
    names: &Names,
    source: &str,
    run: usize,
    tally: &Mutex<Tally>,
) -> Result<Spent, BoxError> {
    let n = opts.messages;
    let first_raw = RAW_ID_BASE + (run * n) as i64;
    let mut args = Vec::new();
    let mut next = first_raw;
    for count in shares(n, opts.processes) {
        let mut child = common_args(opts);
        child.extend(["child-broker", "--exchange", &names.exchange, "--source", source].map(str::to_owned));
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

/// Empties the table, inserts `kept` rows of history (`done` over the last day, one attempt
/// each), then `n` pending rows, each in one statement, and vacuums and analyses it, as
/// autovacuum would have. Returns the first pending id.
pub(super) async fn seed(db: &mut AsyncPgConnection, n: usize, kept: usize, opts: &Opts) -> Result<i64, BoxError> {
    db.batch_execute("TRUNCATE outbox").await?;
    if kept > 0 {
        diesel::sql_query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, status,
                                 available_at, attempts, lease_version, done_at)
             SELECT 'bench', (g % 1000)::text, $3, jsonb_build_object('n', g, 'pad', repeat('x', $2)),
                    t, 'done', t, 1, 1, t + interval '5 milliseconds'
             FROM generate_series(1, $1) AS g,
                  LATERAL (SELECT now() - interval '1 day' + (interval '1 day' / $1) * g) AS s(t)",
        )
        .bind::<BigInt, _>(kept as i64)
        .bind::<Int4, _>(opts.payload_bytes.saturating_sub(24) as i32)
        .bind::<Text, _>(EVENT_TYPE)
        .execute(db)
        .await?;
    }
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
    Ok(range.first)
}

/// Fails unless exactly `n` new rows and `kept` rows of history exist and all are `done` (with
/// `--retention delete`, only the history).
pub(super) async fn verify_done(
    db: &mut AsyncPgConnection,
    n: usize,
    kept: usize,
    deleted: bool,
) -> Result<(), BoxError> {
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
    let expected = if deleted { kept } else { kept + n } as i64;
    if c.done != expected || c.total != expected {
        return Err(format!("expected {expected} rows all done, found {} done of {}", c.done, c.total).into());
    }
    Ok(())
}

/// Runs the dispatcher children with `sink` over the seeded table until `n` rows are done
/// (and, with RabbitMQ, the consumer has every id); returns the time from `go`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn dispatch(
    opts: &Opts,
    names: &Names,
    via: Via<'_>,
    sink: &str,
    n: usize,
    tally: &Mutex<Tally>,
    first: i64,
    peak_kib: &mut u64,
) -> Result<Spent, BoxError> {
    let rabbit = sink == "rabbit";
    tally_of(tally).expect(first, n, false);
    let args: Vec<_> = (0..opts.processes).map(|_| dispatcher_args(opts, names, via, sink, false)).collect();
    let mut kids = Kids::spawn(&args)?;
    kids.ready(Duration::from_secs(30)).await?;
    let meter = Meter::start(via, names).await;
    let servers = ServerTicks::read();
    let busy = machine_busy_seconds();
    let started = Instant::now();
    kids.go();
    let deadline = tokio::time::Instant::now() + opts.phase_timeout;
    let mut confirms = HashMap::new();
    let mut max_lag = 0_u64;
    let mut curve = Vec::new();
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
        while started.elapsed() >= CURVE_STEP * (curve.len() as u32 + 1) {
            curve.push(kids.done());
        }
        let consumed = tally_of(tally).distinct;
        if rabbit {
            max_lag = max_lag.max(kids.done().saturating_sub(consumed as u64));
        }
        if kids.done() >= n as u64 && (!rabbit || consumed == n) {
            break Spent::since(started, busy, &servers);
        }
    };
    spent.cost = meter.cost(via, names, n).await;
    let mut dispatcher_cpu = 0.0;
    for report in kids.stop(Duration::from_secs(30)).await? {
        *peak_kib = (*peak_kib).max(report.get("peak_rss_kib").and_then(|v| v.as_u64()).unwrap_or(0));
        dispatcher_cpu += report.get("cpu_seconds").and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
    }
    spent.dispatcher_cpu_seconds = dispatcher_cpu.is_finite().then_some(dispatcher_cpu);
    spent.consumer_lag = rabbit.then_some(max_lag);
    curve.push(n as u64);
    spent.curve = curve;
    Ok(spent)
}

/// The idle-latency phase's figures.
struct Idle {
    /// Commit → the sink's publisher confirm, milliseconds.
    confirm_p50_ms: f64,
    confirm_p99_ms: f64,
    /// Commit → consumer delivery (p50, p99), the rate and the cost.
    way: Way,
}

/// Inserts rows one at a time (straight to the server) while the dispatcher idles; returns
/// commit → confirm and commit → delivery p50 and p99 in milliseconds, and what it cost.
async fn idle_latency(
    opts: &Opts,
    names: &Names,
    via: Via<'_>,
    db: &mut AsyncPgConnection,
    tally: &Mutex<Tally>,
    peak_kib: &mut u64,
) -> Result<Idle, BoxError> {
    db.batch_execute("TRUNCATE outbox").await?;
    let args: Vec<_> = (0..opts.processes).map(|_| dispatcher_args(opts, names, via, "rabbit", true)).collect();
    let (mut kids, mut confirms) = Kids::settled(&args, SETTLE).await?;
    let meter = Meter::start(via, names).await;

    // The ids are known only once inserted: record every arrival, whatever its id.
    tally_of(tally).expect(0, 0, true);
    let mut commits: Vec<(i64, SystemTime)> = Vec::with_capacity(opts.latency_samples);
    let mut next_tick = tokio::time::Instant::now();
    for sample in 0..opts.latency_samples {
        tokio::time::sleep_until(next_tick).await;
        next_tick += opts.latency_interval;
        let id = insert_row(db, sample, opts.payload_bytes.saturating_sub(24) as i32).await?;
        // The autocommit INSERT has returned: the row is committed and visible.
        let committed = SystemTime::now();
        commits.push((id, committed));
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
    let cost = meter.cost(via, names, opts.latency_samples).await;
    for report in kids.stop(Duration::from_secs(30)).await? {
        *peak_kib = (*peak_kib).max(report.get("peak_rss_kib").and_then(|v| v.as_u64()).unwrap_or(0));
    }
    let arrivals = tally_of(tally).arrivals.take().unwrap_or_default();
    let millis = |from: SystemTime, to: SystemTime| to.duration_since(from).unwrap_or_default().as_secs_f64() * 1e3;
    let mut to_confirm: Vec<f64> = commits.iter().map(|(id, c)| millis(*c, confirms[id])).collect();
    let mut to_delivery: Vec<f64> = commits.iter().map(|(id, c)| millis(*c, arrivals[id])).collect();
    let msg_s = delivered_rate(&commits, &arrivals);
    Ok(Idle {
        confirm_p50_ms: percentile(&mut to_confirm, 0.50),
        confirm_p99_ms: percentile(&mut to_confirm, 0.99),
        way: Way {
            msg_s,
            p50_ms: Some(percentile(&mut to_delivery, 0.50)),
            p99_ms: Some(percentile(&mut to_delivery, 0.99)),
            cost,
        },
    })
}

/// Rows ÷ the time from the first commit to the last delivery: the rate the dispatcher kept up
/// with in a latency phase.
fn delivered_rate(commits: &[(i64, SystemTime)], arrivals: &HashMap<i64, SystemTime>) -> f64 {
    let first = commits.iter().map(|(_, c)| *c).min();
    let last = commits.iter().filter_map(|(id, _)| arrivals.get(id).copied()).max();
    match first.zip(last).and_then(|(first, last)| last.duration_since(first).ok()) {
        Some(span) if !span.is_zero() => commits.len() as f64 / span.as_secs_f64(),
        _ => 0.0,
    }
}

/// Commits single-row transactions at `--rate` for `--seconds` (`--producer`, straight to the
/// server) while the dispatcher runs with its defaults and the consumer reads the queue; returns
/// the achieved rate, the commit → delivery distribution (and the database's own `done_at -
/// created_at`, for comparison), what each message cost over the last two thirds of the
/// production, and the same as a [`Way`], with what it cost.
async fn loaded_latency(
    opts: &Opts,
    names: &Names,
    via: Via<'_>,
    db: &mut AsyncPgConnection,
    tally: &Arc<Mutex<Tally>>,
    peak_kib: &mut u64,
) -> Result<(Loaded, Way), BoxError> {
    let plan = Plan {
        rate: opts.rate(Phase::Loaded),
        seconds: opts.seconds(Phase::Loaded),
        connections: opts.producers,
        pad: opts.payload_bytes.saturating_sub(24),
    };
    let args: Vec<_> = (0..opts.processes).map(|_| dispatcher_args(opts, names, via, "rabbit", false)).collect();
    let mut steady = Steady::start(opts, names, &args, plan, tally).await?;
    let meter = Meter::start(via, names).await;
    let before = DbCounters::read(db).await?;
    let bench_before = steady.bench_xacts();
    // The first third warms up (connections, caches, the table's first pages, autovacuum's
    // first look): the cost per message is measured over the rest of the production.
    let warm_up = f64::from(plan.seconds) / 3.0;
    let mut window = None;
    while let Some(t) = steady.tick().await? {
        if window.is_none() && t >= warm_up {
            window = Some((steady.reading().await?, steady.statements().await?));
        }
    }
    let end = steady.reading().await?;
    let end_statements = steady.statements().await?;
    let cost = window.map(|(start, statements)| {
        let mut cost = WindowCost::between(&start, &end);
        cost.statements = statements.zip(end_statements).map(|(a, b)| a.top(&b, cost.messages)).unwrap_or_default();
        cost
    });
    let produced = steady.produced().cloned().unwrap_or_default();
    let total = produced.rows as usize;
    let undelivered = steady.drain(Duration::from_secs(60)).await?;
    if undelivered > 0 {
        return Err(format!("loaded latency: {undelivered} of {total} rows not delivered within 60 s").into());
    }
    let pooled_cost = meter.cost(via, names, total).await;
    let samples = steady.with_join(|j| j.samples().to_vec());
    let bench_xacts = steady.bench_xacts() - bench_before;
    for report in steady.stop().await? {
        *peak_kib = (*peak_kib).max(report.get("peak_rss_kib").and_then(|v| v.as_u64()).unwrap_or(0));
    }
    // The dispatchers have exited, so every one of their backends has reported its statistics.
    let after = DbCounters::read(db).await?;
    // Of the commits, the producers' (one a row, their connections closed), the bench's own
    // first read here and its sampling connections' are not the dispatchers'.
    let dispatcher_xacts = after.xact_commit - before.xact_commit - total as i64 - 1 - bench_xacts as i64;
    let per_row = |v: f64| v / total.max(1) as f64;
    let latency = Spread::of(samples.iter().map(|s| s.latency_ms()).collect()).unwrap_or_default();
    // Rows ÷ the time from the first commit to the last delivery.
    let first = samples.iter().map(|s| s.commit_s).fold(f64::INFINITY, f64::min);
    let last = samples.iter().map(|s| s.arrival_s).fold(f64::NEG_INFINITY, f64::max);
    let msg_s = if last > first { samples.len() as f64 / (last - first) } else { 0.0 };

    #[derive(diesel::QueryableByName)]
    struct DbLatency {
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Double>)]
        p50: Option<f64>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Double>)]
        p99: Option<f64>,
    }
    // The database's own clock: from the row's `created_at` (its transaction's start) to the
    // finalize that marked it done. Nothing with `--retention delete`.
    let on_db: DbLatency = diesel::sql_query(
        "SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY ms) AS p50,
                percentile_disc(0.99) WITHIN GROUP (ORDER BY ms) AS p99
         FROM (SELECT (extract(epoch FROM done_at - created_at) * 1e3)::float8 AS ms
               FROM outbox WHERE status = 'done') AS d",
    )
    .get_result(db)
    .await?;
    let loaded = Loaded {
        target_rate: f64::from(plan.rate),
        seconds: plan.seconds,
        producer: opts.producer,
        achieved_rate: total as f64 / produced.last_commit_s.max(1e-9),
        rows: total,
        p50_ms: latency.p50_ms,
        p99_ms: latency.p99_ms,
        p999_ms: latency.p999_ms,
        max_ms: latency.max_ms,
        db_done_p50_ms: on_db.p50,
        db_done_p99_ms: on_db.p99,
        dispatcher_xacts_per_row: per_row(dispatcher_xacts as f64),
        blks_hit_per_row: per_row((after.blks_hit - before.blks_hit) as f64),
        wal_bytes_per_row: per_row(after.wal_bytes - before.wal_bytes),
        cost,
        pgbench: produced.summary,
    };
    let way = Way { msg_s, p50_ms: Some(loaded.p50_ms), p99_ms: Some(loaded.p99_ms), cost: pooled_cost };
    Ok((loaded, way))
}
