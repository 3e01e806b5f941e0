//! A primary PostgreSQL server and its streaming standby, both the test's own, for failovers:
//! the database as production runs it when it must survive the loss of a server.
//!
//! Each pair is two throwaway clusters (a few seconds to make: `initdb`, then
//! `pg_basebackup`), with small shared buffers and no fsync, so that several can run beside the
//! shared server on a small machine. One pair per test: a failover is for good.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::{OwnedDir, as_postgres, free_port, run, run_blocking};
use crate::proxy::Proxy;
use crate::unique;

/// Debian's PostgreSQL 15 server programs.
const BIN: &str = "/usr/lib/postgresql/15/bin";

/// How long a server has to accept connections, and the standby to replay what it is waited for.
const WITHIN: Duration = crate::PATIENCE;

/// Settings of both clusters: small and fast rather than safe (fsync off), reachable only on
/// 127.0.0.1 and on a socket folder of their own (not the shared server's `/var/run/postgresql`).
/// `full_page_writes` stays on: `pg_basebackup` needs it.
const SETTINGS: &str = "\
listen_addresses = '127.0.0.1'
shared_buffers = 32MB
fsync = off
max_connections = 60
wal_keep_size = 64MB
log_line_prefix = '%m [%p] '
";

/// Whether the primary waits for the standby before it reports a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// PostgreSQL's default: the primary commits alone and the standby follows a moment later,
    /// so a commit the primary acknowledged just before it died may be missing on the standby.
    Asynchronous,
    /// `synchronous_standby_names = '*'` on the primary: a commit is acknowledged once the
    /// standby has it on disk, so a failover loses no acknowledged commit.
    Synchronous,
}

/// One server of the pair.
struct Node {
    port: u16,
    data: PathBuf,
    /// Stopped for good (a failover stopped it); not stopped again on drop.
    stopped: bool,
}

/// A primary made by `initdb` (user `root`, trust authentication) and a standby streaming from
/// it (`pg_basebackup -R -X stream`), each on a free port of 127.0.0.1, running as the
/// `postgres` user, with their data, sockets and logs in one folder. The roles are named by how
/// the pair started: [`ReplicatedPair::primary_url`] is the server `initdb` made,
/// [`ReplicatedPair::standby_url`] the one that streams from it (and the primary once
/// promoted). Dropping the pair (a panic included) stops both at once and removes the folder.
///
/// ```no_run
/// # async fn example() {
/// use actix_outbox_test_support::{ReplicatedPair, Replication};
/// let mut pair = ReplicatedPair::start(Replication::Asynchronous).await;
/// let db = pair.create_database().await;
/// actix_outbox::migrate(&pair.primary_url(&db)).await.unwrap();
/// let pool = actix_outbox::connect_pool(&pair.multi_host_url(&db), 8).await.unwrap();
/// // ... the dispatcher runs on `pool` ...
/// pair.fail_over().await; // the standby is the primary now, and the URL follows it
/// # }
/// ```
pub struct ReplicatedPair {
    primary: Node,
    standby: Node,
    /// The standby was promoted: both ports are primaries, or only the second if the first was
    /// stopped.
    promoted: bool,
    /// The standby's replication connection goes through it (set once the primary runs).
    link: Option<Proxy>,
    dir: OwnedDir,
}

impl ReplicatedPair {
    /// Makes, starts and connects both servers; returns once the standby streams and accepts
    /// connections. The standby streams through a [`Proxy`] of the pair's own, so that a test
    /// can hold replication back ([`ReplicatedPair::hold_replication`]).
    pub async fn start(replication: Replication) -> ReplicatedPair {
        // initdb and pg_basebackup run for seconds: on the blocking threads, not the test's.
        let mut pair = tokio::task::spawn_blocking(Self::start_primary).await.expect("start thread");
        let link = Proxy::start(format!("127.0.0.1:{}", pair.primary.port)).await;
        let through = link.addr().port();
        pair.link = Some(link);
        tokio::task::spawn_blocking(move || {
            pair.start_standby(through, replication);
            pair
        })
        .await
        .expect("start thread")
    }

    fn start_primary() -> ReplicatedPair {
        let dir = OwnedDir::new("pair");
        let sockets = dir.path().join("sockets");
        std::fs::create_dir(&sockets).unwrap();
        dir.give_to_owner(&sockets);
        let primary_data = dir.path().join("primary");
        run(as_postgres(
            dir.path(),
            &format!("{BIN}/initdb"),
            &["-D", primary_data.to_str().unwrap(), "-U", "root", "--auth=trust", "-N"],
        ))
        .unwrap_or_else(|e| panic!("initdb: {e}"));
        let mut pair = ReplicatedPair {
            primary: Node { port: 0, data: primary_data, stopped: true },
            standby: Node { port: 0, data: dir.path().join("standby"), stopped: true },
            promoted: false,
            link: None,
            dir,
        };
        pair.primary.port = pair.start_node(true);
        pair
    }

    /// Copies the primary through the link on port `through` and starts the copy as its standby.
    fn start_standby(&mut self, through: u16, replication: Replication) {
        let standby = self.standby.data.to_str().unwrap().to_owned();
        let through = through.to_string();
        run(as_postgres(
            self.dir.path(),
            &format!("{BIN}/pg_basebackup"),
            &["-h", "127.0.0.1", "-p", &through, "-U", "root", "-D", &standby, "-R", "-X", "stream", "-c", "fast"],
        ))
        .unwrap_or_else(|e| panic!("pg_basebackup: {e}"));
        self.standby.port = self.start_node(false);

        if replication == Replication::Synchronous {
            // Set on the primary only once its standby streams (commits would wait for it until
            // then), and never on the standby: promoted, it would wait for a standby of its own.
            let conf = self.primary.data.join("postgresql.conf");
            let mut text = std::fs::read_to_string(&conf).unwrap();
            text += "synchronous_standby_names = '*'\n";
            std::fs::write(&conf, text).unwrap();
            run(self.pg_ctl(true, &["reload"])).unwrap_or_else(|e| panic!("reload: {e}"));
        }
    }

    /// Appends the settings (with a free port) to the node's postgresql.conf and starts it,
    /// trying another port if the one chosen was taken meanwhile.
    fn start_node(&mut self, primary: bool) -> u16 {
        let name = if primary { "primary" } else { "standby" };
        let node = if primary { &mut self.primary } else { &mut self.standby };
        let conf = node.data.join("postgresql.conf");
        let original = std::fs::read_to_string(&conf).unwrap_or_else(|e| panic!("{name}'s postgresql.conf: {e}"));
        let sockets = self.dir.path().join("sockets");
        let mut failure = String::new();
        for _ in 0..3 {
            let port = free_port();
            let settings = format!("{SETTINGS}port = {port}\nunix_socket_directories = '{}'\n", sockets.display());
            std::fs::write(&conf, format!("{original}\n# the test's own\n{settings}")).unwrap();
            let log = self.dir.path().join(format!("{name}.log"));
            let data = node.data.to_str().unwrap();
            let started = run(as_postgres(
                self.dir.path(),
                &format!("{BIN}/pg_ctl"),
                &["-D", data, "-l", log.to_str().unwrap(), "-w", "-t", "60", "start"],
            ));
            match started {
                Ok(_) => {
                    node.port = port;
                    node.stopped = false;
                    return port;
                }
                Err(e) => failure = format!("{e}\n{}", self.dir.tail(&format!("{name}.log"))),
            }
        }
        panic!("the {name} did not start: {failure}");
    }

    /// `pg_ctl -D <node> args...` as the postgres user.
    fn pg_ctl(&self, primary: bool, args: &[&str]) -> Command {
        let node = if primary { &self.primary } else { &self.standby };
        let mut all = vec!["-D", node.data.to_str().unwrap()];
        all.extend_from_slice(args);
        as_postgres(self.dir.path(), &format!("{BIN}/pg_ctl"), &all)
    }

    /// The primary's port (the server `initdb` made).
    pub fn primary_port(&self) -> u16 {
        self.primary.port
    }

    /// The standby's port.
    pub fn standby_port(&self) -> u16 {
        self.standby.port
    }

    /// Database `db` on the primary (the server `initdb` made), as a URL.
    pub fn primary_url(&self, db: &str) -> String {
        format!("postgres://root@127.0.0.1:{}/{db}", self.primary.port)
    }

    /// Database `db` on the standby (read-only until promoted), as a URL.
    pub fn standby_url(&self, db: &str) -> String {
        format!("postgres://root@127.0.0.1:{}/{db}", self.standby.port)
    }

    /// Both servers in one URL, primary first, for a session that accepts writes:
    /// `postgres://root@127.0.0.1:P1,127.0.0.1:P2/<db>?target_session_attrs=read-write`. The
    /// driver tries the hosts in order and keeps the first that is not read-only, so the URL
    /// follows a failover.
    pub fn multi_host_url(&self, db: &str) -> String {
        format!(
            "postgres://root@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// [`ReplicatedPair::multi_host_url`] as `key=value` pairs:
    /// `host=127.0.0.1,127.0.0.1 port=P1,P2 user=root dbname=<db> target_session_attrs=read-write`.
    pub fn multi_host_conninfo(&self, db: &str) -> String {
        format!(
            "host=127.0.0.1,127.0.0.1 port={},{} user=root dbname={db} target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// Creates a uniquely named database on the primary and waits until the standby has it;
    /// returns its name. It goes with the pair (no need to drop it).
    pub async fn create_database(&self) -> String {
        let name = unique("db").replace('.', "_");
        execute(&self.primary_url("postgres"), &format!("CREATE DATABASE {name}")).await;
        self.wait_caught_up().await;
        name
    }

    /// Waits until the standby has replayed everything the primary has written so far.
    pub async fn wait_caught_up(&self) {
        let lsn = query_one(&self.primary_url("postgres"), "SELECT pg_current_wal_lsn()::text").await;
        let check = format!("SELECT (pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn)::text");
        let deadline = Instant::now() + WITHIN;
        while query_one(&self.standby_url("postgres"), &check).await != "true" {
            assert!(Instant::now() < deadline, "the standby did not replay up to {lsn} within {WITHIN:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A failover: the primary stops at once (`pg_ctl -m immediate stop`, as if its machine
    /// died: sessions cut, nothing flushed), the standby is promoted, and this returns once the
    /// standby accepts writes. Under [`Replication::Asynchronous`] the commits of the last
    /// moment may be lost with the primary.
    pub async fn fail_over(&mut self) {
        run_blocking(self.pg_ctl(true, &["-m", "immediate", "stop"])).await.unwrap_or_else(|e| panic!("stop: {e}"));
        self.primary.stopped = true;
        self.promote().await;
    }

    /// Promotes the standby (`pg_ctl -w promote`) and waits until it accepts writes. The
    /// primary, if still running, goes on as a primary of its own: two primaries, diverging.
    pub async fn promote(&mut self) {
        run_blocking(self.pg_ctl(false, &["-w", "-t", "60", "promote"]))
            .await
            .unwrap_or_else(|e| panic!("promote: {e}"));
        self.promoted = true;
        let url = self.standby_url("postgres");
        let deadline = Instant::now() + WITHIN;
        while query_one(&url, "SELECT (NOT pg_is_in_recovery())::text").await != "true" {
            assert!(Instant::now() < deadline, "the promoted standby still recovers after {WITHIN:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Holds replication back: the standby's link to the primary stops forwarding (as over a
    /// broken network), so the standby receives nothing more and falls behind. Under
    /// [`Replication::Asynchronous`] the primary goes on committing alone, and a failover now
    /// loses everything committed since; under [`Replication::Synchronous`] its commits wait.
    pub fn hold_replication(&self) {
        self.link.as_ref().expect("the standby's link").stall();
    }

    /// Ends [`ReplicatedPair::hold_replication`]: the standby receives what it missed.
    pub fn release_replication(&self) {
        self.link.as_ref().expect("the standby's link").resume();
    }

    /// Whether the standby has been promoted.
    pub fn promoted(&self) -> bool {
        self.promoted
    }

    /// The log of the primary, or of the standby, so far.
    pub fn log(&self, primary: bool) -> String {
        let name = if primary { "primary.log" } else { "standby.log" };
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }
}

impl Drop for ReplicatedPair {
    fn drop(&mut self) {
        for primary in [false, true] {
            let node = if primary { &self.primary } else { &self.standby };
            if !node.stopped {
                let _ = run(self.pg_ctl(primary, &["-m", "immediate", "stop"]));
            }
        }
        // The folder goes with `self.dir`.
    }
}

/// Runs `sql` on a session of its own to `url`, which must succeed.
async fn execute(url: &str, sql: &str) {
    let client = connect(url).await;
    client.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The single text value `sql` returns on `url` (an empty string for NULL).
async fn query_one(url: &str, sql: &str) -> String {
    let client = connect(url).await;
    let messages = client.simple_query(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row.get(0).unwrap_or_default().to_owned()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{sql} returned no row"))
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) =
        tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    tokio::spawn(conn);
    client
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows written on the primary reach the standby, which refuses writes until the failover
    /// makes it the primary; the multi-host URL, in both forms, finds whichever accepts writes.
    #[tokio::test]
    async fn replicates_fails_over_and_cleans_up() {
        let mut pair = ReplicatedPair::start(Replication::Asynchronous).await;
        let db = pair.create_database().await;
        execute(&pair.primary_url(&db), "CREATE TABLE t (n int); INSERT INTO t VALUES (1), (2)").await;
        pair.wait_caught_up().await;
        assert_eq!(query_one(&pair.standby_url(&db), "SELECT sum(n)::text FROM t").await, "3");
        let refused = connect(&pair.standby_url(&db)).await.batch_execute("INSERT INTO t VALUES (3)").await;
        assert_eq!(refused.unwrap_err().code(), Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION));
        for url in [pair.multi_host_url(&db), pair.multi_host_conninfo(&db)] {
            let port = query_one(&url, "SELECT current_setting('port')").await;
            assert_eq!(port, pair.primary_port().to_string(), "{url}");
        }

        pair.fail_over().await;
        for url in [pair.multi_host_url(&db), pair.multi_host_conninfo(&db)] {
            execute(&url, "INSERT INTO t VALUES (3)").await;
            assert_eq!(query_one(&url, "SELECT current_setting('port')").await, pair.standby_port().to_string());
        }
        assert_eq!(query_one(&pair.standby_url(&db), "SELECT sum(n)::text FROM t").await, "9");
        let folder = pair.dir.path().to_owned();
        drop(pair);
        assert!(!folder.exists(), "the folder is removed");
    }
}
