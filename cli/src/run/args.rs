//! The arguments of `actix-outbox run`: the flags, their parsers, and the dispatcher's and the
//! sink's configurations they describe.

use std::sync::LazyLock;
use std::time::Duration;

use clap::Args;

use crate::{CliError, DatabaseArgs, FifoArgs};
use actix_outbox::sink::{CloudEventsMode, QueueKind, RabbitConfig};
use actix_outbox::{DispatcherConfig, Retention};

/// The broker URL when neither `--amqp-url` nor `AMQP_URL` is given.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The library's defaults, which `--help` shows and an option left out keeps.
static DISPATCHER: LazyLock<DispatcherConfig> = LazyLock::new(DispatcherConfig::default);
/// The sink's defaults (the URL aside), for `--exchange`.
static SINK: LazyLock<RabbitConfig> = LazyLock::new(|| RabbitConfig::new(DEFAULT_AMQP_URL));

/// `--help` text.
pub(crate) const LONG_ABOUT: &str = "Run the dispatcher: claim pending outbox rows under a lease, publish each to the RabbitMQ \
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
    /// While rows stream in, the longest a new row waits for others before a claim takes it (fewer, larger claims: less database work per message, more latency; at least 2ms)
    #[arg(long, value_name = "DURATION", default_value_t = DISPATCHER.linger.into())]
    pub linger: humantime::Duration,
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
pub(super) fn parse_retention(value: &str) -> Result<Retention, String> {
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
pub(super) fn outbox_schema(arg: &str) -> Result<String, String> {
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
pub(super) fn queue_binding(arg: &str) -> Result<(String, String), String> {
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
    pub(super) fn dispatcher_config(&self) -> Result<DispatcherConfig, CliError> {
        let mut config = DispatcherConfig::default()
            .workers(self.workers)
            .batch(self.batch)
            .lease(self.lease.into())
            .max_attempts(self.max_attempts)
            .publish_timeout(self.publish_timeout.into())
            .poll_interval(self.poll_interval.into())
            .linger(self.linger.into())
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
    pub(super) fn console_token(&self, env: Option<String>) -> Result<Option<String>, CliError> {
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
    pub(super) fn rabbit_config(&self) -> Result<RabbitConfig, CliError> {
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
pub(super) fn console_addr(addr: &str) -> Result<String, CliError> {
    if addr.parse::<u16>().is_ok() {
        return Ok(format!("127.0.0.1:{addr}"));
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(addr.to_owned()),
        _ => Err(CliError::BadInput(format!("--console-addr {addr:?}: expected HOST:PORT or PORT"))),
    }
}

impl RunArgs {
    /// Whether the process relays several outboxes (or may come to): each then is named.
    pub(super) fn several(&self) -> bool {
        self.outbox.len() > 1 || self.outbox_schemas.is_some() || self.database.database_url.len() > 1
    }

    /// The name of the outbox of `schema` (none: the URL's own) in `database`, when the process
    /// relays several: `SCHEMA.outbox`, or `DATABASE/SCHEMA.outbox` with several databases.
    pub(super) fn name_of(&self, database: &DatabaseArgs, schema: Option<&str>) -> Result<Option<String>, CliError> {
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
