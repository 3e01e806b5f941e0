//! A PgBouncer of the test's own, in transaction pooling mode, in front of a PostgreSQL server:
//! the connection pooler production puts between the dispatcher and the database.
//!
//! One bouncer per test rather than one per process: a test can then read its pools
//! (`SHOW POOLS` on the `pgbouncer` database), fill its `default_pool_size`, or kill it, without
//! disturbing the tests running beside it; and starting one costs a few tens of milliseconds.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{OwnedDir, as_postgres, free_port};

/// Where Debian's `pgbouncer` package installs it.
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// Server connections per database and user pair (PgBouncer's `default_pool_size`): the most
/// transactions of one test database that run at once, whatever the clients' pools hold.
pub const POOL_SIZE: u32 = 10;

/// Client connections the bouncer accepts at most (`max_client_conn`): a dispatcher's pool,
/// its listener, and the test's own connections, with room to spare.
const MAX_CLIENTS: u32 = 200;

/// How long the bouncer has to start accepting connections.
const START_WITHIN: Duration = Duration::from_secs(20);

/// A running PgBouncer, `pool_mode = transaction`, listening on a free port of 127.0.0.1 and
/// passing every database to the same database of its upstream server, with trust
/// authentication for `root` (its password is never checked: the upstream's `trust` decides).
/// Its configuration and log live in a folder of their own; dropping the fixture (a panic
/// included) kills the bouncer and removes the folder.
///
/// ```no_run
/// # async fn example() {
/// use actix_outbox_test_support::{PgBouncer, TestDb, database_addr};
/// let db = TestDb::new().await;
/// let bouncer = PgBouncer::start(&database_addr()).await;
/// let pool = actix_outbox::connect_pool(&bouncer.route(&db.url), 8).await.unwrap();
/// # }
/// ```
pub struct PgBouncer {
    port: u16,
    child: Child,
    dir: OwnedDir,
}

impl PgBouncer {
    /// Starts a bouncer in front of `upstream` (`host:port`, as [`crate::database_addr`] gives
    /// the test server's) and waits until it accepts connections.
    pub async fn start(upstream: &str) -> PgBouncer {
        let (host, port) = upstream.rsplit_once(':').expect("upstream is host:port");
        let dir = OwnedDir::new("pgbouncer");
        std::fs::write(dir.path().join("userlist.txt"), "\"root\" \"\"\n").expect("write auth_file");
        let mut last_failure = String::new();
        // A port found free can be taken before the bouncer binds it: try another.
        for _ in 0..3 {
            let listen = free_port();
            let config = dir.path().join("pgbouncer.ini");
            std::fs::write(&config, Self::config(dir.path(), host, port, listen)).expect("write pgbouncer.ini");
            for file in ["userlist.txt", "pgbouncer.ini"] {
                dir.give_to_owner(&dir.path().join(file));
            }
            let mut child = as_postgres(dir.path(), PGBOUNCER, &[config.to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("pgbouncer must be installed at /usr/sbin/pgbouncer (apt-get install pgbouncer)");
            match wait_accepting(&mut child, listen).await {
                Ok(()) => return PgBouncer { port: listen, child, dir },
                Err(e) => {
                    last_failure = format!("{e}\n{}", dir.tail("pgbouncer.log"));
                    kill(&mut child, &dir);
                }
            }
        }
        panic!("PgBouncer did not start: {last_failure}");
    }

    fn config(dir: &std::path::Path, host: &str, port: &str, listen: u16) -> String {
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
             default_pool_size = {POOL_SIZE}\n\
             max_client_conn = {MAX_CLIENTS}\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             admin_users = root\n\
             stats_users = root\n\
             ignore_startup_parameters = extra_float_digits,options,application_name\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n"
        )
    }

    /// The port the bouncer listens on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `url` (a `postgres://` URL) with its host and port replaced by the bouncer's; the user,
    /// database and parameters stay.
    pub fn route(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let user = authority.rsplit_once('@').map_or(String::new(), |(user, _)| format!("{user}@"));
        format!("{scheme}://{user}127.0.0.1:{}/{path}", self.port)
    }

    /// The bouncer's admin console (`SHOW POOLS`, `SHOW STATS`...), as a URL.
    pub fn admin_url(&self) -> String {
        format!("postgres://root@127.0.0.1:{}/pgbouncer", self.port)
    }

    /// `total_xact_count` of `database` in the bouncer's `SHOW STATS`: the transactions it has
    /// carried to the server for that database (the admin console speaks only the simple query
    /// protocol, which `psql` uses).
    pub async fn transactions(&self, database: &str) -> i64 {
        let (url, database) = (self.admin_url(), database.to_owned());
        tokio::task::spawn_blocking(move || {
            let out =
                Command::new("psql").args([url.as_str(), "-AtF", "|", "-c", "SHOW STATS"]).output().expect("psql runs");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| match l.split('|').collect::<Vec<_>>().as_slice() {
                    [name, transactions, ..] if *name == database => transactions.parse::<i64>().ok(),
                    _ => None,
                })
                .sum()
        })
        .await
        .expect("the SHOW STATS thread")
    }

    /// The bouncer's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        kill(&mut self.child, &self.dir);
    }
}

/// Polls with a real session until one answers, or the bouncer exits, or time runs out.
async fn wait_accepting(child: &mut Child, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + START_WITHIN;
    let url = format!("postgres://root@127.0.0.1:{port}/postgres");
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Err(format!("pgbouncer exited: {status}"));
        }
        if let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            tokio::spawn(conn);
            if client.simple_query("SELECT 1").await.is_ok() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no session through pgbouncer within {START_WITHIN:?}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops the bouncer at once: SIGKILL to the pid it wrote in `dir` (the child is `runuser`,
/// which a signal of its own would not pass on), then waits for `runuser` to reap it and exit.
/// Killing `runuser` first would leave the bouncer to init, still listening for a moment.
fn kill(child: &mut Child, dir: &OwnedDir) {
    let pidfile = dir.path().join("pgbouncer.pid");
    if let Ok(pid) = std::fs::read_to_string(&pidfile) {
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).stderr(Stdio::null()).status();
        let _ = std::fs::remove_file(pidfile);
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bouncer passes sessions through in transaction mode, and leaves nothing behind.
    #[tokio::test]
    async fn routes_sessions_in_transaction_mode_and_cleans_up() {
        let bouncer = PgBouncer::start(&crate::database_addr()).await;
        let url = bouncer.route(&crate::database_url("postgres"));
        assert_eq!(url, format!("postgres://root@127.0.0.1:{}/postgres", bouncer.port()));
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        let rows = client.simple_query("SELECT 41 + 1").await.unwrap();
        assert!(matches!(&rows[1], tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("42")));
        let (admin, conn) = tokio_postgres::connect(&bouncer.admin_url(), tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(conn);
        let config = admin.simple_query("SHOW CONFIG").await.unwrap();
        let mode = config.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("pool_mode") => r.get(1).map(str::to_owned),
            _ => None,
        });
        assert_eq!(mode.as_deref(), Some("transaction"));
        let folder = bouncer.dir.path().to_owned();
        let pid = std::fs::read_to_string(folder.join("pgbouncer.pid")).unwrap().trim().to_owned();
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        drop(bouncer);
        assert!(!folder.exists(), "the folder is removed");
        // By its pid, not its port: a port freed here is soon handed to a test beside this one.
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the bouncer is gone");
    }
}
