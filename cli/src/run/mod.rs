//! `actix-outbox run`: the dispatcher, publishing to RabbitMQ, until SIGINT or SIGTERM.
//!
//! Start-up order: every flag is checked first (bad input exits 2 before anything is touched),
//! then PostgreSQL (unreachable: exit 1 at once, it is a configuration or outage the operator
//! must see), then RabbitMQ (unreachable: retried with capped backoff and logged, so that the
//! dispatcher simply starts once the broker is up, instead of a restart loop).
//!
//! Shutdown protocol: the first SIGINT/SIGTERM sends [`Shutdown`] to the supervisor, which stops
//! claiming, lets every publish already started finish and be finalized (bounded by the publish
//! timeout), and answers; then the broker connection is closed and the process exits 0 with no
//! row left `processing` under its owner. A second signal while draining exits at once with
//! [`EXIT_ABORTED`](crate::EXIT_ABORTED); the rows still held are reclaimed by other workers
//! when their lease expires.
//!
//! Its parts: `args` (the flags and the configurations they describe), `discovery` (which
//! outboxes to relay, found again with `--outbox-schemas`), `relay` (one outbox's dispatcher,
//! started), `broker` (the connections to RabbitMQ), `console` (the web console), `signals`.

mod args;
mod broker;
mod console;
mod discovery;
mod relay;
mod signals;

use std::time::Duration;

use tracing::info;

use crate::{CliError, serve};
use actix_outbox::dispatcher::Shutdown;

pub(crate) use args::LONG_ABOUT;
pub use args::{DEFAULT_AMQP_URL, LogFormat, RunArgs};
use broker::{connect_broker, named, sink_of};
use console::console_of;
use discovery::{outboxes, rediscover};
use relay::{Running, prepare, start_one};
use signals::Signals;

/// `actix-outbox run` with `args`, until a signal stops it (see the module's docs).
pub(super) async fn run(args: RunArgs) -> Result<(), CliError> {
    for database in args.database.each() {
        database.url()?;
    }
    if args.database.database_url.len() > 1 && args.database.direct_url.is_some() {
        return Err(CliError::BadInput(
            "--direct-url names one server, and --database-url is given several times: relay the databases behind a \
             transaction pooler in one run each"
                .into(),
        ));
    }
    let config = args.dispatcher_config()?;
    let rabbit = args.rabbit_config()?;
    let console_token = args.console_token(std::env::var("ACTIX_OUTBOX_CONSOLE_TOKEN").ok())?;
    if args.several() && config.source.is_some() {
        return Err(CliError::BadInput(
            "--source names one outbox; with several, each derives its own (SYSTEM_IDENTIFIER/DATABASE/SCHEMA.outbox)"
                .into(),
        ));
    }
    if let Some(pattern) = &args.outbox_schemas
        && args.database.pooler == actix_outbox::Pooler::Transaction
    {
        return Err(CliError::BadInput(format!(
            "--outbox-schemas {pattern:?} behind a transaction pooler: the pooler refuses the startup parameter that \
             sets each outbox's search_path; run one relay a tenant role instead"
        )));
    }
    // Registered before anything slow, so that a signal during start-up is not lost.
    let mut signals = Signals::register()?;

    let mut ready = Vec::new();
    for (database, name) in outboxes(&args).await? {
        ready.push(prepare(database, &config, name).await?);
    }

    // Before the broker: an orchestrator sees the process live, and not ready until it runs.
    let relayed = serve::SupervisorSlot::default();
    let serving = match &args.metrics_addr {
        Some(addr) => Some(serve::start(addr, serve::install_recorder()?, relayed.clone())?),
        None => None,
    };

    let first_sink = tokio::select! {
        sink = connect_broker(named(&rabbit, ready.first().and_then(|o| o.name.as_deref()))) => sink?,
        signal = signals.recv() => {
            info!(signal, "stopping before the dispatcher started; nothing was claimed");
            if let Some(serving) = serving {
                serving.stop().await;
            }
            return Ok(());
        }
    };
    let mut running: Vec<Running> = Vec::new();
    let mut first_sink = Some(first_sink);
    for outbox in ready {
        let sink = match first_sink.take() {
            Some(sink) => sink,
            None => sink_of(&rabbit, outbox.name.as_deref()).await?,
        };
        running.push(start_one(outbox, sink, &relayed)?);
    }
    // After the dispatchers, whose health and counters the overview shows.
    let console = match &args.console_addr {
        None => None,
        Some(addr) => {
            let console = if args.several() {
                let consoles = actix_outbox_console::Consoles::new();
                for outbox in &running {
                    consoles.insert(outbox.name(), console_of(outbox, &args, console_token.as_deref(), true).await?);
                }
                serve::ConsoleOf::Many { consoles, read_only: console_token.is_none() }
            } else {
                let Some(outbox) = running.first() else { unreachable!("one outbox without --outbox-schemas") };
                serve::ConsoleOf::One(Box::new(console_of(outbox, &args, console_token.as_deref(), false).await?))
            };
            Some(serve::start_console(&args::console_addr(addr)?, console)?)
        }
    };
    let consoles = match &console {
        Some(serving) => serving.consoles(),
        None => None,
    };

    let mut discovery = args.outbox_schemas.as_ref().map(|pattern| {
        let every = Duration::from(args.discover_interval).max(Duration::from_millis(100));
        (pattern.clone(), tokio::time::interval_at(tokio::time::Instant::now() + every, every))
    });
    let signal = loop {
        let tick = async {
            match &mut discovery {
                Some((_, every)) => every.tick().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            signal = signals.recv() => break signal,
            _ = tick => {
                let Some((pattern, _)) = &discovery else { continue };
                let console = consoles.as_ref().map(|c| (c, console_token.as_deref()));
                rediscover(&args, pattern, &config, &rabbit, &relayed, console, &mut running).await;
            }
        }
    };
    info!(
        signal,
        "stopping: claiming stopped, publishes in flight finish and are finalized; signal again to exit at once"
    );
    // Every dispatcher is told at once (a request is sent when made), then each answer awaited.
    let stops: Vec<_> = running.iter().map(|r| r.relayed.supervisor.send(Shutdown)).collect();
    let answered = async {
        for stop in stops {
            stop.await.map_err(|e| CliError::Failed(format!("the dispatcher did not answer the shutdown: {e}")))?;
        }
        Ok::<_, CliError>(())
    };
    tokio::select! {
        answered = answered => answered?,
        signal = signals.recv() => {
            return Err(CliError::Aborted(format!(
                "{signal} again: exiting at once; rows still processing are reclaimed when their lease expires"
            )));
        }
    }
    for outbox in &running {
        outbox.sink.close().await;
    }
    if let Some(console) = console {
        console.stop().await;
    }
    if let Some(serving) = serving {
        serving.stop().await;
    }
    // The supervisors have logged their final counters; this line says the exit is the clean one.
    info!("dispatcher stopped cleanly; exiting 0");
    Ok(())
}
