//! The parent: sets up, runs the phases, reports, cleans up.
//!
//! It owns everything the run creates (the database, the exchange, the queue and the consumer
//! on it, with `--pg-own` the server itself: `own_server`) and starts the children of each
//! phase (`kids`); `phases` measures, `tally` is what the consumer saw, `report` prints it.
//! The steady phases (loaded latency, `horizon`, `soak`) run on `steady`: a `producer`, the
//! `latencies` of its rows, and `meter` readings of what they cost (`pg_procs` splits
//! PostgreSQL's CPU by role, `statements` reads `pg_stat_statements`).

mod bench_conn;
mod bouncer;
mod drain;
mod drain_curve;
mod horizon;
mod kids;
mod latencies;
mod meter;
mod own_server;
mod pg_procs;
mod phases;
mod producer;
mod report;
mod soak;
mod statements;
mod stats;
mod steady;
mod tally;

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};

use crate::{BoxError, Opts, Phase};
use bench_conn::{BENCH_APP, named};
use bouncer::Bouncer;
use own_server::OwnServer;
use phases::one_run;
use report::{Machine, Report, median_of, print_report};
use tally::Tally;

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

/// The whole benchmark: every run, the report, and the cleanup whatever happened.
pub(crate) async fn main(opts: Opts) -> Result<ExitCode, BoxError> {
    if opts.messages == 0 || opts.runs == 0 || opts.processes == 0 {
        return Err("--messages, --runs and --processes must be at least 1".into());
    }
    opts.dispatcher_config().validate()?;
    let pooled = opts.pgbouncer || opts.pooler_url.is_some();
    if pooled && ![Phase::E2e, Phase::Latency, Phase::Loaded].iter().any(|p| opts.phases.contains(p)) {
        return Err("--pgbouncer and --pooler-url compare the e2e, latency and loaded phases: --phases has none".into());
    }
    // The bench's own server, stopped (its folder removed) when this returns.
    let own = match opts.pg_own {
        true => {
            eprintln!("starting a PostgreSQL of the bench's own...");
            Some(OwnServer::start()?)
        }
        false => None,
    };
    let opts = match &own {
        Some(own) => {
            let prefix = opts.database_url.split('?').next().unwrap_or_default().rsplit_once('/').map(|(_, p)| p);
            Opts { database_url: own.url(prefix.filter(|p| !p.is_empty()).unwrap_or("actix_outbox_bench")), ..opts }
        }
        None => opts,
    };
    let names = Names::new(&opts)?;
    if opts.phases.iter().any(|p| matches!(p, Phase::Horizon | Phase::Soak)) {
        // `run`'s own parser, before anything is started: a mistyped --relay-arg fails now.
        crate::child::parse_run(&steady::run_args(&opts, &names)).map_err(|e| format!("--relay-arg: {e}"))?;
    }
    let server = own.as_ref().map_or_else(|| "the server of --database-url".to_owned(), OwnServer::description);
    // The bench's own cluster, stopped (its folder removed) when this returns.
    let cluster = match opts.cluster {
        true => {
            eprintln!("starting a three-node RabbitMQ cluster...");
            Some(actix_outbox_test_support::RabbitCluster::start().await)
        }
        false => None,
    };
    let opts = match &cluster {
        Some(cluster) => Opts { amqp_url: cluster.urls().join(","), ..opts },
        None => opts,
    };
    let opts = &opts;
    // Ctrl-C still cleans up: the children see their stdin close and stop.
    let result = tokio::select! {
        result = bench(opts, &names, server) => result,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };
    let cleanup = cleanup(opts, &names).await;
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
    let conn = Connection::connect(opts.first_amqp_url(), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel.queue_delete(names.queue.as_str().into(), QueueDeleteOptions::default()).await?;
    channel.exchange_delete(names.exchange.as_str().into(), ExchangeDeleteOptions::default()).await?;
    let _ = conn.close(200, "bench cleanup".into()).await;
    Ok(())
}

async fn bench<'a>(opts: &'a Opts, names: &Names, server: String) -> Result<Report<'a>, BoxError> {
    actix_outbox::admin::ensure_database(&names.database_url).await?;
    actix_outbox::migrate(&names.database_url).await?;
    let mut db = AsyncPgConnection::establish(&named(&names.database_url, BENCH_APP)).await?;
    #[derive(diesel::QueryableByName)]
    struct Version {
        #[diesel(sql_type = Text)]
        v: String,
        #[diesel(sql_type = Text)]
        autovacuum: String,
    }
    let postgres: Version =
        diesel::sql_query("SELECT current_setting('server_version') AS v, current_setting('autovacuum') AS autovacuum")
            .get_result(&mut db)
            .await?;
    // What the dispatchers will stamp their messages with, for the raw publisher to do the same.
    let source = actix_outbox::admin::outbox_source(&mut db).await?;
    // The pooler of the pooled phases; the bench's own is killed when this returns, whatever
    // the outcome (and so before the database is dropped).
    let bouncer = match &opts.pooler_url {
        Some(url) => Some(Bouncer::existing(url)?),
        // Enough server connections that the bouncer never queues the dispatchers' transactions.
        None if opts.pgbouncer => {
            Some(Bouncer::start(&names.database_url, (opts.processes * (opts.workers + 2)) as u32).await?)
        }
        None => None,
    };

    // The exchange (as the sink declares it) and a durable queue that takes everything.
    let amqp = Connection::connect(opts.first_amqp_url(), ConnectionProperties::default()).await?;
    let channel = amqp.create_channel().await?;
    let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
    channel
        .exchange_declare(names.exchange.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
        .await?;
    let queue_options = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    let mut queue_arguments = FieldTable::default();
    if opts.cluster {
        queue_arguments.insert("x-queue-type".into(), lapin::types::AMQPValue::LongString("quorum".into()));
    }
    channel.queue_declare(names.queue.as_str().into(), queue_options, queue_arguments).await?;
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
    // Only the phases measured in every run; the drain, the held horizon and the soak run once.
    let runs_wanted = if opts.phases.iter().any(|p| p.per_run()) { opts.runs } else { 0 };
    for run in 0..runs_wanted {
        if !opts.json {
            eprintln!("run {}/{}...", run + 1, opts.runs);
        }
        runs.push(one_run(opts, names, &source, run, &mut db, &tally, bouncer.as_ref()).await?);
    }
    let drain = match opts.phases.contains(&Phase::Drain) {
        true => {
            if !opts.json {
                eprintln!("drain, unpaced then at {}/s...", opts.drain_rate);
            }
            Some(drain::drain(opts, names, &mut db, &tally).await?)
        }
        false => None,
    };
    if let (Some(curves), Some(path)) = (&drain, &opts.drain_svg) {
        std::fs::write(path, drain_curve::svg(curves, opts.messages))?;
    }
    let horizon = match opts.phases.contains(&Phase::Horizon) {
        true => {
            eprintln!(
                "held horizon: {} rows/s for {} s, the snapshot held from {} s for {} s...",
                opts.rate(Phase::Horizon),
                opts.seconds(Phase::Horizon),
                opts.hold_from,
                opts.hold
            );
            Some(horizon::horizon(opts, names, &tally).await?)
        }
        false => None,
    };
    let soak = match opts.phases.contains(&Phase::Soak) {
        true => {
            eprintln!("soak: {} rows/s for {} minutes...", opts.rate(Phase::Soak), opts.minutes);
            Some(soak::soak(opts, names, &tally).await?)
        }
        false => None,
    };
    consumer.abort();
    let _ = amqp.close(200, "bench done".into()).await;
    let median = median_of(&runs);
    Ok(Report {
        date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        machine: Machine {
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            postgres: postgres.v,
            note: "PostgreSQL, RabbitMQ, the dispatcher and the benchmark share these cores",
            broker: if opts.cluster {
                "a three-node RabbitMQ cluster on this machine, a quorum queue"
            } else {
                "one RabbitMQ node, a classic queue"
            },
            server,
            autovacuum: postgres.autovacuum,
        },
        options: opts,
        in_flight_per_process: opts.depth_per_process(),
        pooler: bouncer.as_ref().map(|b| b.description().to_owned()),
        runs,
        median,
        drain,
        horizon,
        soak,
    })
}
