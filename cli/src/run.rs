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

use std::sync::LazyLock;
use std::time::Duration;

use clap::Args;
use rand::RngExt;
use tracing::{info, warn};

use crate::{CliError, DatabaseArgs, FifoArgs, connect, serve};
use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::{CloudEventsMode, QueueKind, RabbitConfig, RabbitError, RabbitSink};
use actix_outbox::{DispatcherConfig, OutboxSupervisor, Retention};

/// The broker URL when neither `--amqp-url` nor `AMQP_URL` is given.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The library's defaults, which `--help` shows and an option left out keeps.
static DISPATCHER: LazyLock<DispatcherConfig> = LazyLock::new(DispatcherConfig::default);
/// The sink's defaults (the URL aside), for `--exchange`.
static SINK: LazyLock<RabbitConfig> = LazyLock::new(|| RabbitConfig::new(DEFAULT_AMQP_URL));

/// First pause before connecting to an unreachable broker again; it doubles up to
/// [`BROKER_RETRY_MAX`].
const BROKER_RETRY_MIN: Duration = Duration::from_millis(500);
/// Longest pause between two attempts to reach the broker at start.
const BROKER_RETRY_MAX: Duration = Duration::from_secs(30);

/// Database connections beyond one per worker: the finalizer's and a spare.
const EXTRA_CONNECTIONS: usize = 2;
/// The console's own pool: a page reads with one statement at a time.
const CONSOLE_CONNECTIONS: u32 = 2;

/// `--help` text.
pub(super) const LONG_ABOUT: &str = "Run the dispatcher: claim pending outbox rows under a lease, publish each to the RabbitMQ \
    exchange with publisher confirms, and record the outcome with fenced writes. Logs go to \
    stderr (RUST_LOG, default info): a summary a minute, and each change of state.\n\n\
    PostgreSQL must be reachable at start (otherwise exit 1). An unreachable broker at start is \
    retried with backoff and logged until it comes up; once connected, the sink reconnects by \
    itself.\n\n\
    SIGINT or SIGTERM: stop claiming at once, let publishes already started finish and be \
    finalized (within the publish timeout), exit 0 with no row left processing by this \
    process. A second signal exits at once with code 130; the rows still held are reclaimed \
    by other workers when their lease expires.";

/// Arguments of `actix-outbox run`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Example:\n  DATABASE_URL=postgres://app:secret@db:5432/app AMQP_URL=amqp://app:secret@rabbit:5672/%2f \\\n    \
                  actix-outbox run --workers 4 --batch 100 --lease 60s --publish-timeout 10s --exchange outbox"
)]
pub struct RunArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Relay the outbox of this schema of the database (SCHEMA or SCHEMA.outbox); repeatable:
    /// one dispatcher an outbox in this process (workers, pool, listener, pace and broker
    /// connection of its own), each with its own source, metrics label
    /// outbox="SCHEMA.outbox" and summary line, so that one outbox's backlog never delays
    /// another's rows. With --database-url repeated, the schema's outbox in each database.
    /// Default: the URL's own outbox (or --schema's)
    #[arg(long, value_name = "SCHEMA", value_parser = outbox_schema, conflicts_with = "schema")]
    pub outbox: Vec<String>,
    /// Relay the outbox of every schema whose name is LIKE this pattern (e.g. 'tenant_%'), as
    /// --outbox each, and of those created later, looked for every --discover-interval (a schema
    /// that disappears stops its dispatcher)
    #[arg(long, value_name = "PATTERN", conflicts_with_all = ["outbox", "schema"])]
    pub outbox_schemas: Option<String>,
    /// How often --outbox-schemas looks for new schemas
    #[arg(long, value_name = "DURATION", default_value = "10s", requires = "outbox_schemas")]
    pub discover_interval: humantime::Duration,
    /// RabbitMQ URL; several (comma-separated or repeated) for the nodes of a cluster, tried in turn
    /// when reconnecting (passwords masked in every message)
    #[arg(
        long,
        env = "AMQP_URL",
        value_name = "URL",
        default_value = DEFAULT_AMQP_URL,
        value_delimiter = ',',
        num_args = 1..,
        hide_env_values = true
    )]
    pub amqp_url: Vec<String>,
    /// Exchange every message is published to, unless its event names its own
    #[arg(long, value_name = "NAME", default_value_t = SINK.exchange.clone())]
    pub exchange: String,
    /// Routing key of the messages whose event names none of its own (default: the event
    /// type), with the placeholders {aggregate_type}, {aggregate_id}, {event_type} and {source},
    /// e.g. '{aggregate_type}.{event_type}'; {{ and }} are literal braces. An unknown
    /// placeholder or an unbalanced brace exits 2
    #[arg(long, value_name = "TEMPLATE")]
    pub routing_key: Option<String>,
    /// binary: every message is also a CloudEvent of the CloudEvents AMQP binding's binary mode
    /// (cloudEvents:id, :source, :type, :specversion, :time, :subject headers; the body its
    /// data), read by any CloudEvents SDK
    #[arg(long, value_name = "MODE", value_enum, default_value_t = CloudEvents::Off)]
    pub cloudevents: CloudEvents,
    /// Do not declare the exchange (durable topic) at connect; it must exist already
    #[arg(long)]
    pub no_declare: bool,
    /// Declare the durable queue NAME and bind it to the exchange with PATTERN (e.g.
    /// billing:order.#) at every connect, after the exchange (also with --no-declare), so that
    /// messages have somewhere to go instead of going dead as unroutable. Repeatable, also for
    /// several patterns of one queue; NAME ends at the first ':'. A queue that exists with other
    /// arguments (e.g. of the other type) exits 1 at start, saying what differs. For development
    /// and simple deployments; leave queues managed elsewhere to their owner
    #[arg(long, value_name = "NAME:PATTERN", value_parser = queue_binding)]
    pub bind_queue: Vec<(String, String)>,
    /// Type of the queues of --bind-queue
    #[arg(long, value_name = "TYPE", value_enum, default_value_t = QueueType::Quorum, requires = "bind_queue")]
    pub queue_type: QueueType,
    /// Send no x-outbox-source, x-aggregate-type, x-aggregate-id or x-attempt header
    /// (message_id, type and the producer's headers still go): less work for the broker, for
    /// consumers that read none of them (an inbox then sees no source)
    #[arg(long)]
    pub no_outbox_headers: bool,
    /// Also send x-deduplication-header = SOURCE/ID, for brokers that run RabbitMQ's
    /// message-deduplication plugin
    #[arg(long)]
    pub deduplication_header: bool,
    /// This outbox's name in every message's x-outbox-source header, with the id unique across
    /// databases (default: derived from the database, SYSTEM_IDENTIFIER/DATABASE/SCHEMA.outbox;
    /// logged at start). Every dispatcher of one table must use the same
    #[arg(long, value_name = "NAME", env = "ACTIX_OUTBOX_SOURCE", hide_env_values = true)]
    pub source: Option<String>,
    /// Claim actors, each with its own owner id
    #[arg(long, value_name = "N", default_value_t = DISPATCHER.workers)]
    pub workers: usize,
    /// Rows one claim takes at most
    #[arg(long, value_name = "N", default_value_t = DISPATCHER.batch)]
    pub batch: usize,
    /// Rows one worker holds claimed at once, publishing or finalizing (default: 2 × batch)
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<usize>,
    /// Messages a second this process publishes at most (a token bucket the claims take from),
    /// so that a drain after an outage does not flood the consumers; paced, it also slows by
    /// itself while the broker pushes back (nacks, timeouts, a blocked connection). The console
    /// changes it while running. Default: not paced
    #[arg(long, value_name = "N")]
    pub max_rate: Option<f64>,
    /// How long a claim owns its rows; a dead worker's rows are reclaimed after it
    #[arg(long, value_name = "DURATION", default_value_t = DISPATCHER.lease.into())]
    pub lease: humantime::Duration,
    /// Claims a row gets before it goes dead
    #[arg(long, value_name = "N", default_value_t = DISPATCHER.max_attempts)]
    pub max_attempts: i32,
    /// Bound on one publish (must be shorter than the lease); also bounds the shutdown drain
    #[arg(long, value_name = "DURATION", default_value_t = DISPATCHER.publish_timeout.into())]
    pub publish_timeout: humantime::Duration,
    /// Pause after a claim that found fewer rows than a batch
    #[arg(long, value_name = "DURATION", default_value_t = DISPATCHER.poll_interval.into())]
    pub poll_interval: humantime::Duration,
    /// How often to log a summary at info (published, retried, deferred, dead, reaped, lost leases, backlog, oldest row's age); 0 turns it off
    #[arg(long, value_name = "DURATION", default_value = "60s")]
    pub summary_interval: humantime::Duration,
    /// Prefix of the lease_owner written on claimed rows (default: HOSTNAME:PID); keep it unique per running dispatcher
    #[arg(long, value_name = "ID")]
    pub owner: Option<String>,
    /// The per-aggregate FIFO gate this dispatcher applies (off without the flag).
    #[command(flatten)]
    pub fifo: FifoArgs,
    /// Serve GET /metrics (Prometheus text format), /health/live and /health/ready on this address (port 0: any free port, logged)
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Serve the web console (overview, dead rows, blocked aggregates, repairs) on this address;
    /// a port alone listens on 127.0.0.1 (port 0: any free port, logged). Read-only unless an
    /// operator token is given (--console-token-file or ACTIX_OUTBOX_CONSOLE_TOKEN)
    #[arg(long, value_name = "[HOST:]PORT")]
    pub console_addr: Option<String>,
    /// File holding the console's operator token (surrounding whitespace ignored), which every
    /// change made in the console requires; ACTIX_OUTBOX_CONSOLE_TOKEN gives it instead
    #[arg(long, value_name = "PATH", requires = "console_addr")]
    pub console_token_file: Option<std::path::PathBuf>,
    /// Do not LISTEN for inserts; new rows wait for the poll (behind a transaction pooler without --direct-url, the listener is off anyway)
    #[arg(long)]
    pub no_listen: bool,
    /// What becomes of a row once its message is confirmed: a duration (`24h`, `10m`) keeps it as
    /// done for that long, then `run` deletes it (in short batches, one process of a fleet);
    /// `keep` keeps it for good (for audits, or a `purge` of your own); `delete` deletes it in
    /// the same fenced statement (a table the size of the backlog). Dead rows always stay
    #[arg(long, value_name = "DURATION|keep|delete", value_parser = parse_retention, default_value = "24h")]
    pub retention: Retention,
    /// Log line format on stderr: text for humans, json (one object a line) for log shippers
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `--retention`: `keep`, `delete`, or how long to keep done rows (`24h`).
fn parse_retention(value: &str) -> Result<Retention, String> {
    match value {
        "keep" => Ok(Retention::Keep),
        "delete" => Ok(Retention::Delete),
        other => match humantime::parse_duration(other) {
            Ok(keep) if !keep.is_zero() => Ok(Retention::KeepFor(keep)),
            Ok(_) => Err("a retention of 0 keeps nothing: say `delete` to delete rows as they are confirmed".into()),
            Err(e) => Err(format!("expected `keep`, `delete` or a duration such as `24h` ({e})")),
        },
    }
}

/// `--cloudevents`: [`CloudEventsMode`] on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[non_exhaustive]
pub enum CloudEvents {
    /// Plain outbox messages (the default)
    #[default]
    Off,
    /// CloudEvents in the AMQP binding's binary content mode
    Binary,
}

impl From<CloudEvents> for CloudEventsMode {
    fn from(arg: CloudEvents) -> Self {
        match arg {
            CloudEvents::Off => CloudEventsMode::Off,
            CloudEvents::Binary => CloudEventsMode::Binary,
        }
    }
}

/// `--queue-type`: [`QueueKind`] on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[non_exhaustive]
pub enum QueueType {
    /// Quorum queues, RabbitMQ's recommendation for durable queues (the default)
    #[default]
    Quorum,
    /// Classic queues, e.g. for a queue that exists already as one (a queue's type cannot change)
    Classic,
}

impl From<QueueType> for QueueKind {
    fn from(arg: QueueType) -> Self {
        match arg {
            QueueType::Quorum => QueueKind::Quorum,
            QueueType::Classic => QueueKind::Classic,
        }
    }
}

/// `--outbox SCHEMA[.outbox]`: the schema. The table of an outbox is always `outbox`; the
/// schema's spelling is checked where it is used, by `ConnectionString::in_schema`.
fn outbox_schema(arg: &str) -> Result<String, String> {
    let schema = arg.strip_suffix(".outbox").unwrap_or(arg);
    if schema.is_empty() || schema.contains('.') {
        return Err(format!(
            "expected SCHEMA or SCHEMA.outbox, got {arg:?}: an outbox's table is always named outbox, one a schema"
        ));
    }
    Ok(schema.to_owned())
}

/// `--bind-queue NAME:PATTERN`: the queue's name ends at the first `:`; the pattern may be
/// empty (a fanout or direct exchange's binding) or hold colons itself.
fn queue_binding(arg: &str) -> Result<(String, String), String> {
    match arg.split_once(':') {
        Some((queue, pattern)) if !queue.is_empty() => Ok((queue.to_owned(), pattern.to_owned())),
        _ => Err(format!("expected NAME:PATTERN, e.g. billing:order.#, got {arg:?}")),
    }
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[non_exhaustive]
pub enum LogFormat {
    /// One human-readable line an event.
    #[default]
    Text,
    /// One JSON object a line: `timestamp`, `level`, `target`, the event's fields (its
    /// message in `message`) and its spans.
    Json,
}

impl RunArgs {
    /// The dispatcher configuration these flags describe, validated.
    fn dispatcher_config(&self) -> Result<DispatcherConfig, CliError> {
        let mut config = DispatcherConfig::default()
            .workers(self.workers)
            .batch(self.batch)
            .lease(self.lease.into())
            .max_attempts(self.max_attempts)
            .publish_timeout(self.publish_timeout.into())
            .poll_interval(self.poll_interval.into())
            .listen_for_inserts(!self.no_listen)
            .summary_interval(Some(Duration::from(self.summary_interval)).filter(|d| !d.is_zero()))
            .retention(self.retention);
        if let Some(owner) = &self.owner {
            config = config.owner(owner.clone());
        }
        if let Some(n) = self.max_in_flight {
            config = config.max_in_flight(n);
        }
        if let Some(source) = &self.source {
            config = config.source(source.clone());
        }
        if let Some(rate) = self.max_rate {
            config = config.max_rate(rate);
        }
        config = config.fifo(self.fifo.fifo()?);
        if let Some(addr) = &self.metrics_addr {
            let port = addr.rsplit_once(':').map(|(host, port)| (host, port.parse::<u16>()));
            if !matches!(port, Some((host, Ok(_))) if !host.is_empty()) {
                return Err(CliError::BadInput(format!("--metrics-addr {addr:?}: expected HOST:PORT")));
            }
        }
        if let Some(addr) = &self.console_addr {
            console_addr(addr)?;
        }
        config.validate().map_err(|e| CliError::BadInput(format!("invalid dispatcher configuration: {e}")))?;
        Ok(config)
    }

    /// The console's operator token: from `--console-token-file`, or `ACTIX_OUTBOX_CONSOLE_TOKEN`
    /// (`env`, passed in so that tests need not set the process's environment). `None`: the
    /// console is read-only. A token given both ways, an unreadable file or a blank token is bad
    /// input: an operator who meant to give one must not get a console that silently refuses.
    fn console_token(&self, env: Option<String>) -> Result<Option<String>, CliError> {
        let from_file = match &self.console_token_file {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                CliError::BadInput(format!("--console-token-file {}: cannot read it: {e}", path.display()))
            })?),
            None => None,
        };
        let token = match (from_file, env) {
            (Some(_), Some(_)) => {
                return Err(CliError::BadInput(
                    "the console token is given twice (--console-token-file and ACTIX_OUTBOX_CONSOLE_TOKEN); give one"
                        .into(),
                ));
            }
            (Some(token), None) | (None, Some(token)) => token,
            (None, None) => return Ok(None),
        };
        let token = token.trim();
        if token.is_empty() {
            return Err(CliError::BadInput("the console token is empty; give a long random one".into()));
        }
        Ok(Some(token.to_owned()))
    }

    /// The sink configuration these flags describe, validated (a malformed AMQP URL is bad input).
    fn rabbit_config(&self) -> Result<RabbitConfig, CliError> {
        let mut config = RabbitConfig::cluster(self.amqp_url.iter().map(|u| u.trim().to_owned()))
            .exchange(self.exchange.clone())
            .declare_exchange(!self.no_declare)
            .outbox_headers(!self.no_outbox_headers)
            .deduplication_header(self.deduplication_header)
            .cloudevents(self.cloudevents.into());
        if let Some(template) = &self.routing_key {
            config = config.routing_key_template(template);
        }
        for (queue, pattern) in &self.bind_queue {
            config = config.bind_queue_with(queue, pattern, self.queue_type.into());
        }
        config.validate().map_err(|e| CliError::BadInput(e.to_string()))?;
        Ok(config)
    }
}

/// `--console-addr`: `HOST:PORT` as given, or a port alone on the loopback interface (a console
/// can change rows, so it is not put on every interface by default).
fn console_addr(addr: &str) -> Result<String, CliError> {
    if addr.parse::<u16>().is_ok() {
        return Ok(format!("127.0.0.1:{addr}"));
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(addr.to_owned()),
        _ => Err(CliError::BadInput(format!("--console-addr {addr:?}: expected HOST:PORT or PORT"))),
    }
}

/// One outbox ready to relay: checked, its source known, its pool open.
struct Prepared {
    /// `SCHEMA.outbox` when the process relays several, else `None`.
    name: Option<String>,
    database: DatabaseArgs,
    config: DispatcherConfig,
    pool: actix_outbox::PgPool,
}

/// Checks the outbox `database` reaches (migrated), derives its source unless configured, and
/// opens its pool.
async fn prepare(
    database: DatabaseArgs,
    config: &DispatcherConfig,
    name: Option<String>,
) -> Result<Prepared, CliError> {
    let url = database.url()?;
    let mut conn = connect(&url).await?;
    let pending = database
        .answered(&url, actix_outbox::admin::pending_migrations(url.expose()))
        .await?
        .map_err(|e| CliError::store(&url, e))?;
    if !pending.is_empty() {
        let schema = database.schema.as_deref().map(|s| format!(" --schema {s}")).unwrap_or_default();
        return Err(CliError::Failed(format!(
            "the database at {url} is not migrated ({} pending: {}); run `actix-outbox migrate{schema}` first",
            pending.len(),
            pending.join(", ")
        )));
    }
    let mut config = config.clone();
    if config.source.is_none() {
        let source = database.answered(&url, actix_outbox::admin::outbox_source(&mut conn)).await?;
        config.source = Some(source.map_err(|e| CliError::store(&url, e))?);
    }
    drop(conn);
    if let Some(name) = &name {
        config = config.name(name.clone());
    }
    let pool = database.pool((config.workers + EXTRA_CONNECTIONS) as u32).await?;
    Ok(Prepared { name, database, config, pool })
}

/// The schemas `pattern` finds in the database of `database` (without `--schema`).
async fn discover(database: &DatabaseArgs, pattern: &str) -> Result<Vec<String>, CliError> {
    let url = database.url()?;
    let mut conn = connect(&url).await?;
    database
        .answered(&url, actix_outbox::admin::outbox_schemas(&mut conn, pattern))
        .await?
        .map_err(|e| CliError::store(&url, e))
}

impl RunArgs {
    /// Whether the process relays several outboxes (or may come to): each then is named.
    fn several(&self) -> bool {
        self.outbox.len() > 1 || self.outbox_schemas.is_some() || self.database.database_url.len() > 1
    }

    /// The name of the outbox of `schema` (none: the URL's own) in `database`, when the process
    /// relays several: `SCHEMA.outbox`, or `DATABASE/SCHEMA.outbox` with several databases.
    fn name_of(&self, database: &DatabaseArgs, schema: Option<&str>) -> Result<Option<String>, CliError> {
        if !self.several() {
            return Ok(None);
        }
        let table = schema.map_or_else(|| "outbox".to_owned(), |schema| format!("{schema}.outbox"));
        if self.database.database_url.len() == 1 {
            return Ok(Some(table));
        }
        let url = database.url()?;
        let db = url.database().ok_or_else(|| {
            CliError::BadInput(format!(
                "--database-url {url} names no database: with several, each must name its own (they name the outboxes)"
            ))
        })?;
        Ok(Some(format!("{db}/{table}")))
    }

    /// Every outbox to relay at start, as `(where, name)`: the schemas of `--outbox` (or those
    /// `--outbox-schemas` finds) in each database, or each database's own outbox.
    async fn outboxes(&self) -> Result<Vec<(DatabaseArgs, Option<String>)>, CliError> {
        let mut outboxes = Vec::new();
        for database in self.database.each() {
            let schemas = match &self.outbox_schemas {
                Some(pattern) => {
                    let found = discover(&database, pattern).await?;
                    info!(database = %database.url()?, pattern, found = ?found,
                        "outbox schemas found; new ones are looked for every {}", self.discover_interval);
                    found
                }
                None => self.outbox.clone(),
            };
            if schemas.is_empty() && self.outbox_schemas.is_none() {
                outboxes.push((database.clone(), self.name_of(&database, None)?));
            }
            for schema in schemas {
                let name = self.name_of(&database, Some(&schema))?;
                outboxes.push((in_schema(&database, &schema), name));
            }
        }
        let mut names: Vec<&String> = outboxes.iter().filter_map(|(_, name)| name.as_ref()).collect();
        names.sort();
        if let Some(twice) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(CliError::BadInput(format!(
                "two outboxes would both be named {}: give each --database-url a database of another name",
                twice[0]
            )));
        }
        Ok(outboxes)
    }
}

/// `database` for the outbox of `schema`.
fn in_schema(database: &DatabaseArgs, schema: &str) -> DatabaseArgs {
    DatabaseArgs { schema: Some(schema.to_owned()), ..database.clone() }
}

/// One outbox being relayed: where it lives, its dispatcher, and its own connection to the
/// broker.
struct Running {
    /// Where it lives (`--schema` its schema, for `--outbox` and `--outbox-schemas`).
    database: DatabaseArgs,
    relayed: serve::Relayed,
    sink: RabbitSink,
}

impl Running {
    /// Its name: `SCHEMA.outbox` when the process relays several, else the table's own.
    fn name(&self) -> String {
        self.relayed.name.clone().unwrap_or_else(|| "outbox".to_owned())
    }
}

/// The console of one outbox being relayed, on a pool of its own (pages never wait for the
/// dispatcher's connections, nor it for theirs): two connections, or one an outbox when the
/// console shows several.
async fn console_of(
    outbox: &Running,
    args: &RunArgs,
    token: Option<&str>,
    several: bool,
) -> Result<actix_outbox_console::Console, CliError> {
    let pool = outbox.database.pool(if several { 1 } else { CONSOLE_CONNECTIONS }).await?;
    let mut console = actix_outbox_console::Console::new(pool)
        .supervisor(outbox.relayed.supervisor.clone())
        .fifo(args.fifo.fifo()?)
        .source(outbox.relayed.source.clone());
    if let Some(token) = token {
        console = console.token(token);
    }
    Ok(console)
}

/// The broker connection of one more outbox (the first is made by [`connect_broker`]): each
/// outbox has its own, so that one outbox's drain never fills the confirm pipeline another's
/// messages wait in. Named after the outbox in the broker's connection list.
async fn sink_of(rabbit: &RabbitConfig, name: Option<&str>) -> Result<RabbitSink, CliError> {
    RabbitSink::connect(named(rabbit, name)).await.map_err(|e| match e {
        e @ RabbitError::Config(_) => CliError::BadInput(e.to_string()),
        e => CliError::Failed(e.to_string()),
    })
}

/// `rabbit` with its connection named after the outbox `name`, unless named already.
fn named(rabbit: &RabbitConfig, name: Option<&str>) -> RabbitConfig {
    match (name, &rabbit.connection_name) {
        (Some(name), None) => rabbit.clone().connection_name(format!("actix-outbox {name}")),
        _ => rabbit.clone(),
    }
}

/// Starts the dispatcher of `outbox` on `sink`, registered in `relayed`.
fn start_one(outbox: Prepared, sink: RabbitSink, relayed: &serve::SupervisorSlot) -> Result<Running, CliError> {
    let Prepared { name, database, config, pool } = outbox;
    let source = config.source.clone().unwrap_or_default();
    info!(outbox = name.as_deref(), database = %database.url()?, pooler = %database.pooler, source = %source,
        fifo = %config.fifo, "starting the dispatcher; SIGINT or SIGTERM stops it gracefully");
    let supervisor = OutboxSupervisor::start(config, pool.clone(), sink.clone())
        .map_err(|e| CliError::BadInput(format!("cannot start the dispatcher: {e}")))?;
    let one = serve::Relayed { name, supervisor, pool, source };
    relayed.lock().unwrap_or_else(|e| e.into_inner()).push(one.clone());
    Ok(Running { database, relayed: one, sink })
}

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
    for (database, name) in args.outboxes().await? {
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
            Some(serve::start_console(&console_addr(addr)?, console)?)
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

/// Looks for the schemas `pattern` finds now: starts a dispatcher for each new one, stops
/// those of schemas that are gone. A failure is logged and tried again at the next look.
async fn rediscover(
    args: &RunArgs,
    pattern: &str,
    config: &DispatcherConfig,
    rabbit: &RabbitConfig,
    relayed: &serve::SupervisorSlot,
    console: Option<(&actix_outbox_console::Consoles, Option<&str>)>,
    running: &mut Vec<Running>,
) {
    let mut found = Vec::new();
    for database in args.database.each() {
        match discover(&database, pattern).await {
            Ok(schemas) => found.extend(schemas.into_iter().map(|schema| in_schema(&database, &schema))),
            Err(e) => {
                warn!(error = %e, pattern, "looking for outbox schemas failed; trying again later");
                return;
            }
        }
    }
    let same = |a: &DatabaseArgs, b: &DatabaseArgs| a.database_url == b.database_url && a.schema == b.schema;
    let (kept, gone): (Vec<Running>, Vec<Running>) =
        running.drain(..).partition(|r| found.iter().any(|f| same(f, &r.database)));
    *running = kept;
    for stopped in gone {
        info!(outbox = stopped.relayed.name.as_deref(), "its schema is gone: stopping its dispatcher");
        if let Some((consoles, _)) = console {
            consoles.remove(&stopped.name());
        }
        let _ = stopped.relayed.supervisor.send(Shutdown).await;
        stopped.sink.close().await;
        relayed.lock().unwrap_or_else(|e| e.into_inner()).retain(|r| r.supervisor != stopped.relayed.supervisor);
    }
    for database in found {
        if running.iter().any(|r| same(&r.database, &database)) {
            continue;
        }
        let name = match args.name_of(&database, database.schema.as_deref()) {
            Ok(name) => name.unwrap_or_else(|| "outbox".to_owned()),
            Err(e) => {
                warn!(error = %e, "a new outbox schema cannot be relayed");
                continue;
            }
        };
        let started = async {
            let outbox = prepare(database, config, Some(name.clone())).await?;
            let sink = sink_of(rabbit, Some(&name)).await?;
            let one = start_one(outbox, sink, relayed)?;
            if let Some((consoles, token)) = console {
                match console_of(&one, args, token, true).await {
                    Ok(page) => consoles.insert(name.clone(), page),
                    Err(e) => warn!(outbox = %name, error = %e, "the console cannot show the new outbox"),
                }
            }
            Ok::<_, CliError>(one)
        };
        match started.await {
            Ok(one) => {
                info!(outbox = %name, "new outbox schema found: relaying it");
                running.push(one);
            }
            Err(e) => {
                warn!(outbox = %name, error = %e, "a new outbox schema cannot be relayed yet; trying again later")
            }
        }
    }
}

/// Connects the RabbitMQ sink, retrying with capped, jittered exponential backoff while the
/// broker is unreachable. A broker that answers but refuses (credentials, vhost, an exchange of
/// another type) is a failure: retrying would not help.
async fn connect_broker(config: RabbitConfig) -> Result<RabbitSink, CliError> {
    let mut ceiling = BROKER_RETRY_MIN;
    loop {
        match RabbitSink::connect(config.clone()).await {
            // The sink logs the connection itself.
            Ok(sink) => return Ok(sink),
            Err(e) if e.is_transient() => {
                // Half fixed, half jitter: never hammers the broker, and many dispatchers
                // started together do not reconnect in step.
                let delay = ceiling / 2 + ceiling.mul_f64(rand::rng().random_range(0.0..0.5));
                warn!(error = %e, retry_in = %humantime::format_duration(round_ms(delay)),
                    "RabbitMQ unreachable; retrying");
                tokio::time::sleep(delay).await;
                ceiling = (ceiling * 2).min(BROKER_RETRY_MAX);
            }
            Err(e @ RabbitError::Config(_)) => return Err(CliError::BadInput(e.to_string())),
            Err(e) => return Err(CliError::Failed(e.to_string())),
        }
    }
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

/// SIGTERM and SIGINT, registered once for the life of the command (the second of either ends
/// a graceful shutdown at once).
struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn register() -> Result<Self, CliError> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let failed = |e: std::io::Error| CliError::Failed(format!("cannot install the signal handlers: {e}"));
            Ok(Self {
                terminate: signal(SignalKind::terminate()).map_err(failed)?,
                interrupt: signal(SignalKind::interrupt()).map_err(failed)?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The name of the next signal received.
    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.terminate.recv() => "SIGTERM",
                _ = self.interrupt.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Command};
    use actix_outbox::Fifo;

    fn fifo_of(flags: &[&str]) -> Fifo {
        let argv = ["actix-outbox", "run", "--database-url", "postgres://root@db/app"].iter().chain(flags);
        let Command::Run(args) = Cli::try_parse_from(argv).unwrap().command else { panic!("a run command") };
        args.dispatcher_config().unwrap().fifo
    }

    #[test]
    fn several_amqp_urls_reach_the_sink_configuration_in_order() {
        let argv = ["actix-outbox", "run", "--database-url", "postgres://root@db/app"];
        let flags = ["--amqp-url", "amqp://a/%2f,amqp://b/%2f", "--amqp-url", "amqp://c/%2f"];
        let Command::Run(args) = Cli::try_parse_from(argv.iter().chain(&flags)).unwrap().command else { panic!() };
        assert_eq!(args.rabbit_config().unwrap().urls, ["amqp://a/%2f", "amqp://b/%2f", "amqp://c/%2f"]);
    }

    fn run_args(flags: &[&str]) -> Result<super::RunArgs, clap::Error> {
        let argv = ["actix-outbox", "run", "--database-url", "postgres://root@db/app"].iter().chain(flags);
        match Cli::try_parse_from(argv)?.command {
            Command::Run(args) => Ok(*args),
            _ => panic!("a run command"),
        }
    }

    #[test]
    fn bind_queue_flags_reach_the_sink_configuration() {
        use actix_outbox::sink::QueueKind;
        let bindings = |flags: &[&str]| {
            let config = run_args(flags).unwrap().rabbit_config().unwrap();
            config.bindings.iter().map(|b| (b.queue.clone(), b.pattern.clone(), b.kind)).collect::<Vec<_>>()
        };
        assert_eq!(bindings(&[]), []);
        let q = |queue: &str, pattern: &str, kind| (queue.to_owned(), pattern.to_owned(), kind);
        assert_eq!(
            bindings(&[
                "--bind-queue",
                "billing:order.#",
                "--bind-queue",
                "billing:refund.*",
                "--bind-queue",
                "audit:a:b"
            ]),
            [
                q("billing", "order.#", QueueKind::Quorum),
                q("billing", "refund.*", QueueKind::Quorum),
                q("audit", "a:b", QueueKind::Quorum)
            ]
        );
        assert_eq!(bindings(&["--bind-queue", "all:", "--queue-type", "classic"]), [q("all", "", QueueKind::Classic)]);
        for bad in ["billing", ":order.#"] {
            let e = run_args(&["--bind-queue", bad]).unwrap_err();
            assert!(e.to_string().contains("expected NAME:PATTERN"), "{bad}: {e}");
        }
        assert!(run_args(&["--queue-type", "classic"]).is_err(), "--queue-type needs a --bind-queue");
        assert!(run_args(&["--bind-queue", "q:x", "--queue-type", "stream"]).is_err());
        let long = run_args(&["--bind-queue", &format!("{}:x", "q".repeat(256))]).unwrap().rabbit_config().unwrap_err();
        assert_eq!(long.exit_code(), crate::EXIT_USAGE, "{long}");
    }

    #[test]
    fn a_console_port_alone_listens_on_the_loopback_interface() {
        assert_eq!(super::console_addr("9188").unwrap(), "127.0.0.1:9188");
        assert_eq!(super::console_addr("0.0.0.0:9188").unwrap(), "0.0.0.0:9188");
        assert_eq!(super::console_addr("[::1]:9188").unwrap(), "[::1]:9188");
        for bad in ["", "host", ":9188", "host:port", "70000"] {
            let e = super::console_addr(bad).unwrap_err();
            assert_eq!(e.exit_code(), crate::EXIT_USAGE, "{bad}");
        }
        let e = run_args(&["--console-addr", "nope"]).unwrap().dispatcher_config().unwrap_err();
        assert_eq!(e.to_string(), "--console-addr \"nope\": expected HOST:PORT or PORT");
    }

    #[test]
    fn the_console_token_comes_from_one_place_and_is_not_blank() {
        let dir = std::env::temp_dir().join(format!("actix-outbox-console-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "  s3cret-token\n").unwrap();
        let path = file.to_str().unwrap();
        let with_file = run_args(&["--console-addr", "9188", "--console-token-file", path]).unwrap();
        assert_eq!(with_file.console_token(None).unwrap().as_deref(), Some("s3cret-token"));
        let e = with_file.console_token(Some("other".into())).unwrap_err();
        assert_eq!(e.exit_code(), crate::EXIT_USAGE);
        let plain = run_args(&["--console-addr", "9188"]).unwrap();
        assert_eq!(plain.console_token(None).unwrap(), None);
        assert_eq!(plain.console_token(Some(" env-token ".into())).unwrap().as_deref(), Some("env-token"));
        assert_eq!(plain.console_token(Some(" ".into())).unwrap_err().exit_code(), crate::EXIT_USAGE);
        std::fs::write(&file, "\n").unwrap();
        assert_eq!(with_file.console_token(None).unwrap_err().exit_code(), crate::EXIT_USAGE);
        let missing = run_args(&["--console-addr", "9188", "--console-token-file", "/nonexistent/token"]).unwrap();
        assert_eq!(missing.console_token(None).unwrap_err().exit_code(), crate::EXIT_USAGE);
        // A token file without a console to use it is a usage error.
        assert!(run_args(&["--console-token-file", path]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_fifo_flag_reaches_the_dispatcher_configuration() {
        assert_eq!(fifo_of(&[]), Fifo::Off);
        assert_eq!(fifo_of(&["--fifo"]), Fifo::All);
        assert_eq!(
            fifo_of(&["--fifo", "order.created,order.paid"]),
            Fifo::event_types(["order.created", "order.paid"])
        );
    }
}
