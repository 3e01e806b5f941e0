//! The `actix-outbox` command line: the operator's face over the `actix-outbox` library.
//!
//! The binary is one line, `fn main() -> ExitCode { actix_outbox_cli::main() }`. Every command
//! goes through the library's public API ([`actix_outbox::migrate`],
//! [`actix_outbox::OutboxSupervisor`], the operator queries), so whatever an operator does here
//! an application can do from Rust. An application with its own clap CLI can also embed [`Command`]
//! as a subcommand and call [`Command::execute`].
//!
//! | command | what it does |
//! | --- | --- |
//! | `migrate` | create the database if missing, apply pending migrations |
//! | `run` | the dispatcher, publishing to RabbitMQ until SIGINT/SIGTERM |
//! | `stats [--json] [--fifo]` | rows by status, oldest unfinished row, expired leases, attempts; blocked aggregates with `--fifo` |
//! | `dead list` / `dead retry` / `dead skip` | inspect and repair dead rows |
//! | `dead blocked` | the aggregates a dead head holds back under the FIFO gate |
//! | `purge --older-than` | delete old `done` rows in short batches |
//! | `enqueue` | insert one event (demos, scripts) |
//! | `erase --aggregate TYPE/ID` | delete one aggregate's done and dead rows, blank it in the inbox (erasure requests) |
//!
//! Exit codes are part of the interface: [`EXIT_OK`], [`EXIT_FAILURE`] (a service failed or
//! could not be reached), [`EXIT_USAGE`] (usage error or bad input; nothing was changed) and
//! [`EXIT_ABORTED`] (a second signal interrupted a graceful shutdown). Every error is one line
//! on stderr; results go to stdout; logs go to stderr through `tracing` (`RUST_LOG`).

mod dead;
mod enqueue;
mod erase;
mod migrate;
mod purge;
mod run;
mod serve;
mod stats;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use diesel_async::AsyncPgConnection;

pub use dead::{DeadBlockedArgs, DeadCommand, DeadListArgs, DeadRetryArgs, DeadSkipArgs};
pub use enqueue::EnqueueArgs;
pub use erase::{Aggregate, EraseArgs};
pub use migrate::MigrateArgs;
pub use purge::PurgeArgs;
pub use run::{DEFAULT_AMQP_URL, LogFormat, RunArgs};
pub use stats::StatsArgs;

use actix_outbox::{ConnectionString, Fifo, PgPool, PoolConfig, Pooler, StoreError};

/// Success.
pub const EXIT_OK: u8 = 0;
/// A runtime failure: a service was unreachable or failed. The message names which and where.
pub const EXIT_FAILURE: u8 = 1;
/// A usage error or bad input (unknown flag, malformed duration, URL or JSON, an id that is not
/// a dead row, an impossible configuration). Nothing was changed.
pub const EXIT_USAGE: u8 = 2;
/// A second SIGINT/SIGTERM cut a graceful shutdown short: the process exited at once, and rows
/// it still held stay `processing` until their lease expires (then another worker reclaims them).
pub const EXIT_ABORTED: u8 = 130;

/// The `actix-outbox` command line.
#[derive(Debug, Parser)]
#[command(
    name = "actix-outbox",
    version,
    about = "Transactional outbox dispatcher: PostgreSQL outbox table to RabbitMQ",
    long_about = "Transactional outbox dispatcher: moves rows of a PostgreSQL `outbox` table to RabbitMQ, \
                  with leases and fencing tokens, and gives operators the tools to inspect and repair it.\n\n\
                  Every command reads the database connection string (a URL or key=value pairs) from \
                  --database-url or DATABASE_URL.\n\
                  Exit codes: 0 success, 1 a service failed or was unreachable, 2 usage error or bad input \
                  (nothing changed), 130 a second signal interrupted a graceful shutdown.",
    after_help = "Example:\n  export DATABASE_URL=postgres://app:secret@db:5432/app\n  actix-outbox migrate\n  \
                  actix-outbox run --amqp-url amqp://guest:guest@rabbit:5672/%2f\n  actix-outbox stats"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// One `actix-outbox` command.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the database if it does not exist and apply pending migrations.
    #[command(long_about = migrate::LONG_ABOUT)]
    Migrate(MigrateArgs),
    /// Run the dispatcher, publishing to RabbitMQ, until SIGINT or SIGTERM.
    #[command(long_about = run::LONG_ABOUT)]
    Run(Box<RunArgs>),
    /// Show rows by status, the oldest unfinished row, expired leases and attempts.
    #[command(long_about = stats::LONG_ABOUT)]
    Stats(StatsArgs),
    /// Inspect and repair dead rows.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Delete `done` rows older than a given age, in short batches.
    #[command(long_about = purge::LONG_ABOUT)]
    Purge(PurgeArgs),
    /// Insert one event into the outbox and print its id.
    #[command(long_about = enqueue::LONG_ABOUT)]
    Enqueue(EnqueueArgs),
    /// Erase one aggregate's data: its done and dead rows, its strings in the inbox.
    #[command(long_about = erase::LONG_ABOUT)]
    Erase(EraseArgs),
}

impl Cli {
    /// Runs the command. See [`Command::execute`].
    pub async fn execute(self) -> Result<(), CliError> {
        self.command.execute().await
    }
}

impl Command {
    /// Runs the command, printing its result to stdout. Must be awaited inside an actix
    /// `System` (the `run` command starts actors).
    pub async fn execute(self) -> Result<(), CliError> {
        match self {
            Command::Migrate(args) => migrate::migrate(args).await,
            Command::Run(args) => run::run(*args).await,
            Command::Stats(args) => stats::stats(args).await,
            Command::Dead(DeadCommand::List(args)) => dead::list(args).await,
            Command::Dead(DeadCommand::Retry(args)) => dead::retry(args).await,
            Command::Dead(DeadCommand::Skip(args)) => dead::skip(args).await,
            Command::Dead(DeadCommand::Blocked(args)) => dead::blocked(args).await,
            Command::Purge(args) => purge::purge(args).await,
            Command::Enqueue(args) => enqueue::enqueue(args).await,
            Command::Erase(args) => erase::erase(args).await,
        }
    }

    /// The log level when `RUST_LOG` is unset: the dispatcher reports at `info` (a summary a
    /// minute, and each change of state); one-shot commands stay quiet unless something is
    /// wrong. Other crates' lines are kept out either way ([`QUIET_CRATES`]).
    fn default_log_filter(&self) -> &'static str {
        match self {
            Command::Run(_) => "info",
            _ => "warn",
        }
    }

    /// How log lines are written: `run --log-format`, text for every other command.
    fn log_format(&self) -> LogFormat {
        match self {
            Command::Run(args) => args.log_format,
            _ => LogFormat::Text,
        }
    }
}

/// The entry point of the `actix-outbox` binary: parses the process arguments, runs the
/// command on an actix system, prints any error as one line on stderr and returns the exit code.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    init_logging(cli.command.default_log_filter(), cli.command.log_format());
    match actix::System::new().block_on(cli.execute()) {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(e) => {
            // Not `eprintln!`, which panics when stderr is closed: the exit code still tells.
            let _ = writeln!(std::io::stderr().lock(), "error: {}", one_line(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    }
}

/// Prints a clap error. Help and version go to stdout as clap renders them; a real usage error
/// is squeezed onto one line (its first paragraph), because operators grep stderr and log
/// collectors split it by line. Clap's exit code (2 for usage errors) is kept.
fn usage_error(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let code = u8::try_from(e.exit_code()).unwrap_or(EXIT_USAGE);
    if !e.use_stderr() || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let _ = e.print();
        return ExitCode::from(code);
    }
    let rendered = e.render().to_string();
    let first_paragraph = rendered.split("\n\n").next().unwrap_or_default();
    let _ = writeln!(std::io::stderr().lock(), "{} (see --help)", one_line(first_paragraph));
    ExitCode::from(code)
}

/// Third-party crates whose own lines are left out of the logs (with the level they are held
/// to) unless `RUST_LOG` names them: the sink reports every failure of its link itself (a
/// refused login, a lost connection, each reconnection), once and in our words, where lapin
/// would log three ERROR lines of its own, and the dispatcher logs returned (unroutable)
/// messages as the rows going dead; the driver's server notices (`relation ... already exists,
/// skipping`) say nothing an operator acts on. `RUST_LOG=info,lapin=debug` brings lapin back.
const QUIET_CRATES: [(&str, &str); 2] = [("lapin", "off"), ("tokio_postgres", "warn")];

/// The log filter's directives: `RUST_LOG` when it is set and valid, else the command's default
/// level; with [`QUIET_CRATES`] held to their levels unless the filter names them.
fn log_directives(default_filter: &str, from_env: Option<&str>) -> String {
    use tracing_subscriber::EnvFilter;
    let given = from_env.filter(|f| !f.trim().is_empty() && EnvFilter::try_new(f).is_ok());
    let text = given.unwrap_or(default_filter);
    let mut directives = text.to_owned();
    for (name, level) in QUIET_CRATES {
        let named = text.split(',').any(|d| d.trim().split(['=', '[', ':']).next() == Some(name));
        if !named {
            directives.push_str(&format!(",{name}={level}"));
        }
    }
    directives
}

/// Logs to stderr; `RUST_LOG` overrides the command's default level.
///
/// Logging never stops the work: a log line that cannot be written (stderr closed, a broken
/// pipe, a full disk) is dropped, without the error report the formatter would otherwise write
/// to stderr with `eprintln!`, which panics on a closed stderr.
fn init_logging(default_filter: &str, format: LogFormat) {
    let directives = log_directives(default_filter, std::env::var("RUST_LOG").ok().as_deref());
    let filter = tracing_subscriber::EnvFilter::try_new(&directives)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(|| LossyStderr).log_internal_errors(false);
    // Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org).
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = match format {
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
        LogFormat::Text => builder.with_ansi(colour).try_init(),
    };
}

/// Standard error, where a failed write counts as written: the line is lost, not the work.
struct LossyStderr;

impl std::io::Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// Joins the lines of `text`, each trimmed, with single spaces.
fn one_line(text: &str) -> String {
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// Why a command failed, classified by exit code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The input cannot be used (malformed URL, duration or JSON, an id that is not a dead row,
    /// an impossible configuration). Nothing was changed. Exit code [`EXIT_USAGE`].
    #[error("{0}")]
    BadInput(String),
    /// A service (PostgreSQL, RabbitMQ) failed or could not be reached; the message names which
    /// and where, password masked. Exit code [`EXIT_FAILURE`].
    #[error("{0}")]
    Failed(String),
    /// A second signal interrupted a graceful shutdown. Exit code [`EXIT_ABORTED`].
    #[error("{0}")]
    Aborted(String),
}

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::BadInput(_) => EXIT_USAGE,
            CliError::Failed(_) => EXIT_FAILURE,
            CliError::Aborted(_) => EXIT_ABORTED,
        }
    }

    /// A store failure while talking to the database at `url`, explained from its causes
    /// (password masked): a malformed string is bad input, anything else a failure.
    fn store(url: &ConnectionString, e: StoreError) -> Self {
        match &e {
            StoreError::BadUrl(_) | StoreError::InvalidEvent(_) => CliError::BadInput(e.to_string()),
            StoreError::Connect(cause) => {
                CliError::Failed(format!("cannot connect to PostgreSQL at {url}: {}", with_causes(cause.as_ref())))
            }
            StoreError::NoAnswer { waited, .. } => CliError::Failed(format!(
                "PostgreSQL at {url} did not answer within {} (--query-timeout): a silent link (a frozen host, a \
                 dropped NAT or load-balancer state, a hung pooler), or statements slower than that; the connection \
                 was given up",
                humantime::format_duration(*waited)
            )),
            _ if e.is_missing_outbox() => CliError::Failed(format!(
                "the database at {url} has no outbox table: run `actix-outbox migrate --database-url '{url}'` first"
            )),
            _ => CliError::Failed(format!("PostgreSQL at {url}: {}", with_causes(&e))),
        }
    }
}

/// `--database-url` / `DATABASE_URL`, shared by every command.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL connection string: postgres://user:password@host:port/database (a URL must name its database), or key=value pairs (host=db user=app password=... dbname=app); to follow a failover, list every server and ask for the primary (postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write); passwords masked in every message. `run` takes it repeated, to relay the outboxes of several databases
    #[arg(long = "database-url", env = "DATABASE_URL", value_name = "URL", hide_env_values = true, required = true)]
    pub database_url: Vec<String>,
    /// What stands between this process and PostgreSQL: `none` (the server itself, or a pooler in session mode) or `transaction` (PgBouncer with pool_mode = transaction, and the like): then no statement stays prepared past its transaction, and what needs a session goes to --direct-url
    #[arg(long, env = "DATABASE_POOLER", value_name = "MODE", default_value_t = Pooler::None)]
    pub pooler: Pooler,
    /// A connection string to the server itself, past a transaction pooler, for what needs a session of its own: `run`'s insert listener (without it, `run` polls) and the FIFO gate's index build (`run --fifo`, `migrate --fifo`)
    #[arg(long = "direct-url", env = "DATABASE_DIRECT_URL", value_name = "URL", hide_env_values = true)]
    pub direct_url: Option<String>,
    /// The schema whose outbox (or inbox) to act on, for a database that keeps one a schema (one a tenant, one a module): every connection's search_path is set to it (the `options` startup parameter). Default: the URL's own search_path (`public`). Not through a transaction pooler, which refuses that parameter: there, give each tenant a role whose search_path is its schema
    #[arg(long, env = "DATABASE_SCHEMA", value_name = "NAME")]
    pub schema: Option<String>,
    /// How long PostgreSQL may take to answer one unit of work (a claim, a finalize, a sample, a console page; a one-shot command's statements; a batch of `purge`) before the connection is given up and the work failed (`run` retries it on a fresh connection): what notices a link that went silent without closing. Raise it where statements are legitimately slow (a big table, lock waits); migrations have none
    #[arg(long, env = "DATABASE_QUERY_TIMEOUT", value_name = "DURATION", default_value = "5s", value_parser = query_timeout)]
    pub query_timeout: humantime::Duration,
}

/// `--query-timeout`: a duration of 100 ms at least.
fn query_timeout(s: &str) -> Result<humantime::Duration, String> {
    let d: humantime::Duration = s.parse().map_err(|e| format!("{e}"))?;
    if std::time::Duration::from(d) < std::time::Duration::from_millis(100) {
        return Err("must be at least 100ms".into());
    }
    Ok(d)
}

impl DatabaseArgs {
    /// The connection string, parsed by the driver's parser (malformed, or a URL that names no
    /// database: bad input), in `--schema` when it is given.
    /// A connection string given more than once is bad input here: only `run` relays several
    /// databases, each through [`DatabaseArgs::each`].
    fn url(&self) -> Result<ConnectionString, CliError> {
        let [url] = self.database_url.as_slice() else {
            return Err(CliError::BadInput(format!(
                "--database-url is given {} times: only `run` relays several databases; other commands act on one",
                self.database_url.len()
            )));
        };
        let url = ConnectionString::parse(url).map_err(|e| CliError::BadInput(e.to_string()))?;
        // A URL cut short would reach the database named after the user, and every command
        // after would act there (`migrate` would install an outbox in it).
        url.require_database().map_err(|e| CliError::BadInput(e.to_string()))?;
        self.in_schema(url, self.schema.as_deref())
    }

    /// One `DatabaseArgs` a `--database-url`, each with the other flags as given.
    fn each(&self) -> Vec<DatabaseArgs> {
        self.database_url.iter().map(|url| DatabaseArgs { database_url: vec![url.clone()], ..self.clone() }).collect()
    }

    /// `url` confined to `schema` (none: as it is). Refused behind a transaction pooler, which
    /// refuses the startup parameter that does it.
    fn in_schema(&self, url: ConnectionString, schema: Option<&str>) -> Result<ConnectionString, CliError> {
        let Some(schema) = schema else { return Ok(url) };
        if self.pooler == Pooler::Transaction {
            return Err(CliError::BadInput(format!(
                "schema {schema:?} behind a transaction pooler: the pooler refuses the startup parameter that sets the \
                 search_path; give the tenant a role whose search_path is its schema (ALTER ROLE ... SET search_path = \
                 {schema}) and a --database-url of that role, without --schema"
            )));
        }
        url.in_schema(schema).map_err(|e| CliError::BadInput(e.to_string()))
    }

    /// The direct connection string, parsed (malformed: bad input), in `--schema` when it is
    /// given.
    fn direct_url(&self) -> Result<Option<ConnectionString>, CliError> {
        let Some(url) = self.direct_url.as_deref() else { return Ok(None) };
        let url = ConnectionString::parse(url).map_err(|e| CliError::BadInput(format!("--direct-url: {e}")))?;
        url.require_database().map_err(|e| CliError::BadInput(format!("--direct-url: {e}")))?;
        match self.schema.as_deref() {
            Some(schema) => {
                url.in_schema(schema).map(Some).map_err(|e| CliError::BadInput(format!("--direct-url: {e}")))
            }
            None => Ok(Some(url)),
        }
    }

    /// A pool of `size` connections as these flags say.
    async fn pool(&self, size: u32) -> Result<PgPool, CliError> {
        let url = self.url()?;
        let mut config =
            PoolConfig::new(url.expose()).size(size).pooler(self.pooler).query_timeout(self.query_timeout.into());
        if let Some(direct) = self.direct_url()? {
            config = config.direct_url(direct.expose());
        }
        config.connect().await.map_err(|e| CliError::store(&url, e))
    }

    /// `work` (a one-shot command's statements on its connection to `url`), given up when the
    /// database has not answered it within `--query-timeout`: the command then fails with an
    /// error naming the server, rather than wait for ever on a silent link.
    async fn answered<T>(
        &self,
        url: &ConnectionString,
        work: impl std::future::Future<Output = T>,
    ) -> Result<T, CliError> {
        let limit = std::time::Duration::from(self.query_timeout);
        tokio::time::timeout(limit, work)
            .await
            .map_err(|_| CliError::store(url, StoreError::NoAnswer { server: url.to_string(), waited: limit }))
    }

    /// Where work that needs a session of its own connects: the direct URL, or the database
    /// URL when no transaction pooler is in between; `None` behind one without a direct URL.
    fn session_url(&self) -> Result<Option<ConnectionString>, CliError> {
        match (self.direct_url()?, self.pooler) {
            (Some(direct), _) => Ok(Some(direct)),
            (None, Pooler::Transaction) => Ok(None),
            (None, _) => self.url().map(Some),
        }
    }
}

/// `--fifo [EVENT_TYPE,...]`, the per-aggregate FIFO gate ([`Fifo`]), defined once and flattened
/// into every command that needs it: `run` (the gate its dispatcher applies), `stats` and
/// `dead blocked` (the gate under which to find the blocked aggregates). A command may reword
/// the help (`mut_arg`) where the flag's absence means something else.
#[derive(Debug, Clone, Default, Args)]
pub struct FifoArgs {
    /// Per-aggregate FIFO: for the listed event types (comma-separated), or for all when none is listed
    #[arg(long, value_name = "EVENT_TYPE", num_args = 0.., value_delimiter = ',')]
    pub fifo: Option<Vec<String>>,
}

impl FifoArgs {
    /// The gate the flag describes: [`Fifo::Off`] without `--fifo`, [`Fifo::All`] with `--fifo`
    /// alone, [`Fifo::EventTypes`] with a list. An empty name in the list (`a,,b`) is bad input.
    pub fn fifo(&self) -> Result<Fifo, CliError> {
        let Some(types) = &self.fifo else { return Ok(Fifo::Off) };
        if types.iter().any(|t| t.trim().is_empty()) {
            return Err(CliError::BadInput(format!(
                "--fifo: empty event type in {:?}; list event types separated by commas, or give none for all",
                types.join(",")
            )));
        }
        Ok(if types.is_empty() { Fifo::All } else { Fifo::EventTypes(types.clone()) })
    }
}

/// One connection for a one-shot command; an unreachable database is a one-line
/// [`CliError::Failed`] naming the (masked) connection string and the driver's reason.
async fn connect(url: &ConnectionString) -> Result<AsyncPgConnection, CliError> {
    actix_outbox::admin::connect(url.expose()).await.map_err(|e| CliError::store(url, e))
}

/// `error: cause: cause's cause`, each message once (an error's message often repeats its
/// cause's).
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let message = cause.to_string();
        if !text.contains(&message) {
            text += ": ";
            text += &message;
        }
        source = cause.source();
    }
    text
}

/// Parses a JSON document (`--payload`).
fn parse_json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))
}

/// A plain-text table: a header line, then one line a row, each line starting with `indent`.
/// Columns are as wide as their widest cell and two spaces apart; those in `right` (numbers)
/// are aligned right, the others left. The last column is not padded, so a long last cell (an
/// error message) runs on without widening the others.
fn table(indent: &str, header: &[&str], rows: &[Vec<String>], right: &[usize]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = indent.to_owned();
        for (i, (cell, w)) in cells.into_iter().zip(&widths).enumerate() {
            if i + 1 == widths.len() {
                s += cell;
            } else if right.contains(&i) {
                s += &format!("{cell:>w$}  ");
            } else {
                s += &format!("{cell:<w$}  ");
            }
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out += &line(row.iter().map(String::as_str).collect());
    }
    out
}

/// `text` on one line (line breaks become spaces), cut to `max` characters with an ellipsis.
fn truncate(text: &str, max: usize) -> String {
    let text = text.replace(['\n', '\r'], " ");
    if text.chars().count() <= max {
        return text;
    }
    text.chars().take(max.saturating_sub(1)).collect::<String>() + "…"
}

/// `1, 2, 3`.
fn id_list(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Third-party lines stay out whether `RUST_LOG` is set or not, unless it names the crate.
    #[test]
    fn third_party_crates_stay_quiet_unless_named() {
        let shown = |env: Option<&str>| log_directives("info", env);
        assert_eq!(shown(None), "info,lapin=off,tokio_postgres=warn");
        assert_eq!(shown(Some("info")), "info,lapin=off,tokio_postgres=warn");
        assert_eq!(shown(Some("debug,actix_outbox=trace")), "debug,actix_outbox=trace,lapin=off,tokio_postgres=warn");
        assert_eq!(shown(Some("info,lapin=debug")), "info,lapin=debug,tokio_postgres=warn");
        assert_eq!(shown(Some("lapin::channel=trace")), "lapin::channel=trace,tokio_postgres=warn");
        // An invalid filter falls back to the default, quiet crates included.
        assert_eq!(shown(Some("info,=[")), "info,lapin=off,tokio_postgres=warn");
    }

    #[test]
    fn database_urls_are_checked_and_masked() {
        let args = |url: &str| DatabaseArgs {
            database_url: vec![url.to_owned()],
            pooler: Pooler::None,
            direct_url: None,
            schema: None,
            query_timeout: "5s".parse().unwrap(),
        };
        for (url, masked) in [
            ("postgres://app:s3cret@db:5432/app", "postgres://app:***@db:5432/app"),
            ("postgres://app@db/app?password=s3cret", "postgres://app@db/app?password=***"),
            ("host=db user=app password=s3cret dbname=app", "host=db user=app password=*** dbname=app"),
            ("host=db user=app password='s3cret word' dbname=app", "host=db user=app password=*** dbname=app"),
        ] {
            let parsed = args(url).url().unwrap();
            assert_eq!(parsed.to_string(), masked);
            assert_eq!(format!("{parsed:?}"), format!("ConnectionString({masked:?})"));
        }
        for bad in
            ["not a url", "mysql://db/app", "postgres://app:s3cret@db:port/app", "host=db port=x password=s3cret"]
        {
            let e = args(bad).url().unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE, "{bad}");
            // A URL of another scheme is named as such; the others are malformed.
            let start = if bad.starts_with("mysql") {
                "database URL \"mysql://db/app\" has scheme"
            } else {
                "malformed database URL"
            };
            assert!(e.to_string().starts_with(start), "{e}");
            assert!(!e.to_string().contains("s3cret") && !format!("{e:?}").contains("s3cret"), "{e}");
        }
    }

    fn fifo_of(argv: &[&str]) -> Result<Fifo, CliError> {
        let argv = ["actix-outbox"].iter().chain(argv).chain(&["--database-url", "postgres://root@db/app"]);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(args) => args.fifo.fifo(),
            Command::Stats(args) => args.fifo.fifo(),
            Command::Dead(DeadCommand::Blocked(args)) => args.fifo.fifo(),
            other => panic!("no --fifo on {other:?}"),
        }
    }

    #[test]
    fn every_command_with_fifo_reads_it_the_same_way() {
        for command in [&["run"][..], &["stats"], &["dead", "blocked"]] {
            let with = |flags: &[&str]| fifo_of(&[command, flags].concat());
            if command != ["dead", "blocked"] {
                assert_eq!(with(&[]).unwrap(), Fifo::Off, "{command:?}"); // dead blocked requires it
            }
            assert_eq!(with(&["--fifo"]).unwrap(), Fifo::All, "{command:?}");
            assert_eq!(with(&["--fifo", "a,b"]).unwrap(), Fifo::event_types(["a", "b"]), "{command:?}");
            assert_eq!(with(&["--fifo", "a", "--fifo", "b"]).unwrap(), Fifo::event_types(["a", "b"]), "{command:?}");
            let e = with(&["--fifo", "a,,b"]).unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE, "{command:?}");
            assert!(e.to_string().starts_with("--fifo: empty event type in \"a,,b\""), "{e}");
        }
    }

    #[test]
    fn tables_align_their_columns_and_leave_the_last_one_unpadded() {
        let rows = vec![
            vec!["7".to_owned(), "order/A".to_owned(), "boom".to_owned()],
            vec!["12".to_owned(), "x".to_owned(), "a much longer error".to_owned()],
        ];
        assert_eq!(
            table("  ", &["ID", "AGGREGATE", "LAST ERROR"], &rows, &[0]),
            "  ID  AGGREGATE  LAST ERROR\n   7  order/A    boom\n  12  x          a much longer error\n"
        );
    }

    #[test]
    fn truncate_keeps_short_text_and_cuts_long_text_on_one_line() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("line one\nline two", 40), "line one line two");
        assert_eq!(truncate("abcdefghij", 5), "abcd…");
    }

    #[test]
    fn one_line_joins_lines() {
        assert_eq!(one_line("error: missing:\n  --reason <TEXT>\n"), "error: missing: --reason <TEXT>");
    }
}
