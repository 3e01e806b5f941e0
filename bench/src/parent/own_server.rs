//! `--pg-own`: a PostgreSQL 15 of the bench's own, with production defaults. The shared server
//! of a development machine may run with autovacuum off (and must not be reconfigured), and
//! what a table does over minutes (dead tuples, vacuum, bloat) depends on exactly that.
//!
//! `initdb` (user `root`, trust authentication) makes it in a temporary folder owned by the
//! `postgres` user (PostgreSQL's programs refuse to run as root); its `postgresql.conf` keeps
//! every default of `initdb` (autovacuum on, fsync on, `synchronous_commit` on, 128 MB of shared
//! buffers) and adds only where it listens (a free port of 127.0.0.1, sockets in its own folder)
//! and `pg_stat_statements`, so that the steady phases can say where its time goes, statement
//! by statement. Dropping it (an error or Ctrl-C included) stops it and removes the folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::BoxError;

/// Debian's PostgreSQL 15 server programs.
pub(super) const BIN: &str = "/usr/lib/postgresql/15/bin";

/// The system user the server runs as.
const RUN_AS: &str = "postgres";

/// The user `initdb` makes, the bench's (as on the shared server).
const USER: &str = "root";

/// A PostgreSQL server the bench made and runs.
pub(super) struct OwnServer {
    /// The folder: `data/`, `sockets/` and the log.
    dir: PathBuf,
    port: u16,
    /// Whether `pg_ctl start` succeeded (and a stop is due).
    running: bool,
}

impl OwnServer {
    /// Makes and starts the server; returns once it accepts connections.
    pub(super) fn start() -> Result<Self, BoxError> {
        let dir = std::env::temp_dir().join(format!("outbox_bench_pg.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir)?;
        let mut server = Self { dir, port: 0, running: false };
        give_to_postgres(&server.dir)?;
        let sockets = server.dir.join("sockets");
        std::fs::create_dir(&sockets)?;
        give_to_postgres(&sockets)?;
        let data = server.data();
        run(as_postgres(&server.dir, "initdb", &["-D", path_str(&data)?, "-U", USER, "--auth=trust"]))?;
        let conf = data.join("postgresql.conf");
        let defaults = std::fs::read_to_string(&conf)?;
        let mut failure = String::new();
        // A port found free can be taken before the server binds it: try another.
        for _ in 0..3 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            std::fs::write(&conf, format!("{defaults}\n{}", settings(port, &sockets)))?;
            let log = server.dir.join("server.log");
            let started = run(as_postgres(
                &server.dir,
                "pg_ctl",
                &["-D", path_str(&data)?, "-l", path_str(&log)?, "-w", "-t", "60", "start"],
            ));
            match started {
                Ok(_) => {
                    server.port = port;
                    server.running = true;
                    return Ok(server);
                }
                Err(e) => failure = format!("{e}\n{}", tail(&log)),
            }
        }
        Err(format!("the bench's own PostgreSQL did not start: {failure}").into())
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// `postgres://root@127.0.0.1:<port>/<database>`.
    pub(super) fn url(&self, database: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{database}", self.port)
    }

    /// What the report says the server is.
    pub(super) fn description(&self) -> String {
        format!("the bench's own PostgreSQL on 127.0.0.1:{} (initdb's defaults, pg_stat_statements)", self.port)
    }
}

impl Drop for OwnServer {
    /// Stops the server at once (its data is thrown away) and removes the folder.
    fn drop(&mut self) {
        if self.running
            && let Ok(data) = path_str(&self.data())
        {
            let _ = run(as_postgres(&self.dir, "pg_ctl", &["-D", data, "-m", "immediate", "-w", "stop"]));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What the bench adds to `initdb`'s `postgresql.conf`: where the server listens, and
/// `pg_stat_statements`; nothing that changes how it runs.
fn settings(port: u16, sockets: &Path) -> String {
    format!(
        "# the bench's own server: reachable on 127.0.0.1 only, its sockets in its own folder\n\
         listen_addresses = '127.0.0.1'\n\
         port = {port}\n\
         unix_socket_directories = '{}'\n\
         shared_preload_libraries = 'pg_stat_statements'\n\
         log_line_prefix = '%m [%p] '\n",
        sockets.display()
    )
}

fn path_str(path: &Path) -> Result<&str, BoxError> {
    path.to_str().ok_or_else(|| format!("{} is not UTF-8", path.display()).into())
}

/// PostgreSQL's `program` with `args` as [`RUN_AS`], from `cwd` (the user may not be allowed
/// into the bench's own working folder).
fn as_postgres(cwd: &Path, program: &str, args: &[&str]) -> Command {
    let mut command = Command::new("runuser");
    command.args(["-u", RUN_AS, "--", &format!("{BIN}/{program}")]).args(args).current_dir(cwd);
    command.stdin(Stdio::null());
    command
}

/// Runs `command` to its end; its output if it succeeded, what it said if not.
fn run(mut command: Command) -> Result<Output, BoxError> {
    let out = command.output().map_err(|e| format!("{command:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{command:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(out)
}

/// Hands `path` (made by this process, so owned by root) over to [`RUN_AS`].
fn give_to_postgres(path: &Path) -> Result<(), BoxError> {
    let out = Command::new("chown").arg(format!("{RUN_AS}:{RUN_AS}")).arg(path).output()?;
    if !out.status.success() {
        return Err(format!("chown {}: {}", path.display(), String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(())
}

/// The last lines of the file at `path`, for a failure message.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
