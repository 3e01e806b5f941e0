//! The transaction pooler of `--pgbouncer` and `--pooler-url`: a PgBouncer the bench starts
//! (`pool_mode = transaction`, on a free port of 127.0.0.1, in a temporary folder of its own,
//! as the `postgres` user, like the test support's fixture), or one that already runs; and what
//! it is measured by: its own CPU time (`/proc/<pid>/stat` of the pid in its pid file) and the
//! transactions it passed to the server (`SHOW STATS` on its admin console, which speaks only
//! the simple query protocol).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use tokio_postgres::SimpleQueryMessage;
use tokio_postgres::config::Host;

use crate::BoxError;
use crate::procstat::process_cpu_seconds;

/// Where Debian's `pgbouncer` package installs it.
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// The system user PgBouncer runs as (it refuses to run as root).
const RUN_AS: &str = "postgres";

/// Client connections the bouncer accepts at most (`max_client_conn`): the dispatchers' pools
/// with room to spare (the listeners and the producers go direct).
const MAX_CLIENTS: u32 = 400;

/// How long the bouncer has to start accepting connections.
const START_WITHIN: Duration = Duration::from_secs(20);

/// A transaction pooler in front of the bench's server.
pub(super) struct Bouncer {
    /// `scheme://user@host:port` of the pooler: a database name appended routes to it.
    server: String,
    /// What the report says the pooler is.
    description: String,
    /// The bouncer the bench started, if it did.
    own: Option<Owned>,
}

/// A PgBouncer this process started: dropping it (an error or Ctrl-C included) kills it and
/// removes its folder.
struct Owned {
    /// `runuser`, whose child the bouncer is.
    child: Child,
    /// The bouncer's own pid, from its pid file.
    pid: u32,
    /// Its configuration, user list, log and pid file.
    dir: PathBuf,
}

impl Bouncer {
    /// Starts a PgBouncer in transaction mode in front of the server of `direct_url` (the
    /// bench's database URL), with `pool_size` server connections per database and user, and
    /// waits until its admin console answers.
    pub(super) async fn start(direct_url: &str, pool_size: u32) -> Result<Self, BoxError> {
        let config = tokio_postgres::Config::from_str(direct_url)?;
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => host.clone(),
            _ => return Err("--pgbouncer needs a DATABASE_URL with a TCP host".into()),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let user = config.get_user().ok_or("--pgbouncer needs a DATABASE_URL with a user")?.to_owned();
        let mut last_failure = String::new();
        // A port found free can be taken before the bouncer binds it: try another.
        for attempt in 0..3 {
            let dir = std::env::temp_dir().join(format!("outbox_bench_pgbouncer.{}.{attempt}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir(&dir)?;
            let ini = dir.join("pgbouncer.ini");
            let spawned = (|| -> Result<(u16, Child), BoxError> {
                let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
                std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n"))?;
                std::fs::write(&ini, ini_text(&dir, &host, port, listen, pool_size, &user))?;
                for path in [dir.as_path(), &dir.join("userlist.txt"), &ini] {
                    give_to_postgres(path)?;
                }
                let child = Command::new("runuser")
                    .args(["-u", RUN_AS, "--", PGBOUNCER])
                    .arg(&ini)
                    .current_dir(&dir)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .map_err(|e| format!("runuser {PGBOUNCER}: {e}"))?;
                Ok((listen, child))
            })();
            let (listen, child) = match spawned {
                Ok(spawned) => spawned,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    return Err(e);
                }
            };
            let mut own = Owned { child, pid: 0, dir };
            let server = format!("postgres://{user}@127.0.0.1:{listen}");
            match own.wait_accepting(&server).await {
                Ok(version) => {
                    let description = format!(
                        "{version} started by the bench on 127.0.0.1:{listen}, pool_mode = transaction, \
                         default_pool_size = {pool_size}"
                    );
                    return Ok(Self { server, description, own: Some(own) });
                }
                // Dropping `own` kills the bouncer and removes its folder.
                Err(e) => last_failure = format!("{e}\n{}", tail(&own.dir.join("pgbouncer.log"))),
            }
        }
        Err(format!("PgBouncer did not start: {last_failure}").into())
    }

    /// An existing transaction pooler at `url` (`postgres://user@host:port`; a database name
    /// in it is ignored, the bench's own is appended).
    pub(super) fn existing(url: &str) -> Result<Self, BoxError> {
        let (scheme, rest) = url.split_once("://").ok_or("--pooler-url must look like postgres://user@host:port")?;
        let authority = rest.split(['/', '?']).next().unwrap_or_default();
        if authority.is_empty() {
            return Err("--pooler-url must look like postgres://user@host:port".into());
        }
        let server = format!("{scheme}://{authority}");
        let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
        Ok(Self { server, description: format!("the transaction pooler at {host} (--pooler-url)"), own: None })
    }

    /// The URL of `database` through the pooler.
    pub(super) fn route(&self, database: &str) -> String {
        format!("{}/{database}", self.server)
    }

    /// What the pooler is, for the report.
    pub(super) fn description(&self) -> &str {
        &self.description
    }

    /// The bouncer's CPU time so far, in seconds: only of one the bench started.
    pub(super) fn cpu_seconds(&self) -> Option<f64> {
        self.own.as_ref().and_then(|own| process_cpu_seconds(own.pid))
    }

    /// Transactions the pooler has passed to the server for `database` so far (`SHOW STATS`,
    /// `total_xact_count`); `None` when its admin console does not answer.
    pub(super) async fn xact_count(&self, database: &str) -> Option<u64> {
        let rows = admin_query(&self.server, "SHOW STATS").await.ok()?;
        rows.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(row) if row.get("database") == Some(database) => {
                row.get("total_xact_count")?.parse().ok()
            }
            _ => None,
        })
    }
}

impl Owned {
    /// Polls the admin console until it answers (returns the version), or the bouncer exits, or
    /// time runs out; reads the pid file once it answers.
    async fn wait_accepting(&mut self, server: &str) -> Result<String, BoxError> {
        let deadline = Instant::now() + START_WITHIN;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(format!("pgbouncer exited: {status}").into());
            }
            if let Ok(rows) = admin_query(server, "SHOW VERSION").await {
                let pid = std::fs::read_to_string(self.dir.join("pgbouncer.pid"))?;
                self.pid = pid.trim().parse()?;
                let version = rows.iter().find_map(|m| match m {
                    SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                    _ => None,
                });
                return Ok(version.unwrap_or_else(|| "PgBouncer".to_owned()));
            }
            if Instant::now() > deadline {
                return Err(format!("pgbouncer's admin console did not answer within {START_WITHIN:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Owned {
    /// SIGKILL to the pid the bouncer wrote (the child is `runuser`, which would not pass a
    /// signal of its own on), then waits for `runuser` to reap it and exit, and removes the
    /// folder.
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.dir.join("pgbouncer.pid")).ok();
        let pid =
            pid.as_deref().map(str::trim).and_then(|p| p.parse::<u32>().ok()).or((self.pid > 0).then_some(self.pid));
        if let Some(pid) = pid {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The bouncer's configuration: every database passed to the same database of the upstream
/// server, trust authentication for `user` (the upstream's own `trust` decides), `user` also
/// admin of the console.
fn ini_text(dir: &Path, host: &str, port: u16, listen: u16, pool_size: u32, user: &str) -> String {
    let dir = dir.display();
    format!(
        "[databases]\n\
         * = host={host} port={port}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {listen}\n\
         unix_socket_dir =\n\
         pool_mode = transaction\n\
         default_pool_size = {pool_size}\n\
         max_client_conn = {MAX_CLIENTS}\n\
         auth_type = trust\n\
         auth_file = {dir}/userlist.txt\n\
         admin_users = {user}\n\
         stats_users = {user}\n\
         ignore_startup_parameters = extra_float_digits,options,application_name\n\
         logfile = {dir}/pgbouncer.log\n\
         pidfile = {dir}/pgbouncer.pid\n"
    )
}

/// Hands `path` (created by this process) over to [`RUN_AS`], so the bouncer may write there.
fn give_to_postgres(path: &Path) -> Result<(), BoxError> {
    let out = Command::new("chown").arg(format!("{RUN_AS}:{RUN_AS}")).arg(path).output()?;
    if !out.status.success() {
        return Err(format!("chown {}: {}", path.display(), String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(())
}

/// One statement on the admin console (`<server>/pgbouncer`), on a connection of its own.
async fn admin_query(server: &str, statement: &str) -> Result<Vec<SimpleQueryMessage>, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(&format!("{server}/pgbouncer"), tokio_postgres::NoTls).await?;
    let conn = tokio::spawn(conn);
    let rows = client.simple_query(statement).await;
    drop(client);
    let _ = conn.await;
    rows
}

/// The last lines of the file at `path`, for a failure message.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
