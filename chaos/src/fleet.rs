//! The dispatcher processes: the real `actix-outbox run` binary, each reaching PostgreSQL and
//! RabbitMQ through proxies of its own, started, signalled and restarted by the faults.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_outbox_test_support::proxy::Proxy;
use tokio::sync::oneshot;

/// How one process instance is started.
#[derive(Debug, Clone)]
pub struct RunFlags {
    /// The `actix-outbox` executable.
    pub bin: PathBuf,
    /// The run's database, direct (the proxy's address replaces the host per process).
    pub database_url: String,
    /// The run's exchange.
    pub exchange: String,
    /// `--workers`, `--batch`, `--max-in-flight`.
    pub workers: u64,
    /// `--batch`.
    pub batch: u64,
    /// `--max-in-flight`.
    pub max_in_flight: u64,
    /// `--lease`.
    pub lease: Duration,
    /// `--publish-timeout`.
    pub publish_timeout: Duration,
    /// `--fifo` (all event types).
    pub fifo: bool,
    /// Where each instance's stderr goes, one file per instance.
    pub log_dir: PathBuf,
    /// The broker nodes: one (the shared broker), or the run's cluster's. Slot `i`'s proxy
    /// fronts node `1 + i % 2` of a cluster (node 0 serves the run's consumer), and its process
    /// is given the other nodes' own URLs after the proxy's, to move to when that node dies.
    pub nodes: Vec<Node>,
}

/// A broker node: its AMQP address and URL.
#[derive(Debug, Clone)]
pub struct Node {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub url: String,
}

impl RunFlags {
    /// The node slot `index`'s proxy fronts.
    fn home(&self, index: usize) -> usize {
        if self.nodes.len() > 1 { 1 + index % (self.nodes.len() - 1) } else { 0 }
    }
}

/// An exit the fault runner did not cause.
#[derive(Debug, Clone)]
pub struct Unexpected {
    /// Seconds since the start of production.
    pub at: f64,
    /// The instance's owner name.
    pub owner: String,
    /// How it ended.
    pub status: String,
    /// Whether its database proxy was faulted then: `run` exits 1 when PostgreSQL is
    /// unreachable at start, as documented, so that exit is expected.
    pub excused: bool,
}

#[derive(Default)]
struct State {
    pid: Option<u32>,
    generation: u32,
    owner: String,
    /// Set by a fault that ends the process: the monitor hands it the exit instead of
    /// treating it as a crash.
    expect: Option<oneshot::Sender<ExitStatus>>,
    /// The run is over: exits are expected and nothing restarts.
    closing: bool,
    unexpected: Vec<Unexpected>,
}

/// One dispatcher slot: its two proxies and whichever process instance runs in it.
pub struct Slot {
    /// 0-based.
    pub index: usize,
    /// In front of PostgreSQL.
    pub db: Proxy,
    /// In front of RabbitMQ.
    pub broker: Proxy,
    /// Faults currently holding the database proxy (cut, blackhole, slow, delay).
    pub db_faulted: std::sync::atomic::AtomicBool,
    flags: RunFlags,
    started: Instant,
    state: Mutex<State>,
}

impl Slot {
    /// The slot's proxies, no process yet.
    pub async fn new(index: usize, flags: RunFlags, started: Instant) -> Arc<Slot> {
        let home = flags.nodes[flags.home(index)].addr.clone();
        Arc::new(Slot {
            index,
            db: Proxy::start("127.0.0.1:5432".into()).await,
            broker: Proxy::start(home).await,
            db_faulted: Default::default(),
            flags,
            started,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a new instance (a new owner name, so that no instance mistakes another's rows
    /// for its own).
    pub fn spawn(self: &Arc<Self>) -> std::io::Result<()> {
        let mut state = self.lock();
        if state.closing {
            return Ok(());
        }
        state.generation += 1;
        let owner = format!("chaos-p{}-g{}", self.index + 1, state.generation);
        let f = &self.flags;
        // The owner is also the connections' application_name, which the audit trigger
        // records for every fenced write (see `world::AUDIT_SQL`).
        let sep = if f.database_url.contains('?') { '&' } else { '?' };
        let database_url = format!("{}{sep}application_name={owner}", self.db.route(&f.database_url));
        let log = std::fs::File::create(f.log_dir.join(format!("{owner}.log")))?;
        let home = f.home(self.index);
        let mut amqp_urls = vec![self.broker.amqp_url()];
        amqp_urls.extend(f.nodes.iter().enumerate().filter(|(i, _)| *i != home).map(|(_, n)| n.url.clone()));
        let mut cmd = tokio::process::Command::new(&f.bin);
        cmd.arg("run")
            .args(["--database-url", &database_url])
            .args(["--amqp-url", &amqp_urls.join(",")])
            .args(["--exchange", &f.exchange])
            .args(["--owner", &owner])
            .args(["--workers", &f.workers.to_string()])
            .args(["--batch", &f.batch.to_string()])
            .args(["--max-in-flight", &f.max_in_flight.to_string()])
            .args(["--lease", &humantime::format_duration(f.lease).to_string()])
            .args(["--publish-timeout", &humantime::format_duration(f.publish_timeout).to_string()])
            // Takeovers happen as soon as a lease expires, not half a second later.
            .args(["--poll-interval", "100ms"])
            .env_remove("DATABASE_URL")
            .env_remove("AMQP_URL")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        if f.fifo {
            cmd.arg("--fifo");
        }
        let mut child = cmd.spawn()?;
        state.pid = child.id();
        state.owner = owner.clone();
        drop(state);
        let slot = self.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            slot.exited(&owner, status);
        });
        Ok(())
    }

    fn exited(self: &Arc<Self>, owner: &str, status: std::io::Result<ExitStatus>) {
        let mut state = self.lock();
        if state.owner != owner {
            return;
        }
        state.pid = None;
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                state.unexpected.push(Unexpected {
                    at: self.started.elapsed().as_secs_f64(),
                    owner: owner.into(),
                    status: format!("wait failed: {e}"),
                    excused: false,
                });
                return;
            }
        };
        if let Some(tx) = state.expect.take() {
            let _ = tx.send(status);
            return;
        }
        if state.closing {
            return;
        }
        let excused = status.code() == Some(1) && self.db_faulted.load(std::sync::atomic::Ordering::Relaxed);
        state.unexpected.push(Unexpected {
            at: self.started.elapsed().as_secs_f64(),
            owner: owner.into(),
            status: describe(status),
            excused,
        });
        drop(state);
        // Keep the slot populated: a crashed dispatcher is a finding, and the run goes on.
        let slot = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if let Err(e) = slot.spawn() {
                eprintln!("chaos: cannot restart p{}: {e}", slot.index + 1);
            }
        });
    }

    /// Sends `signal` to the running instance, if any; `false` when none runs.
    pub fn signal(&self, signal: i32) -> bool {
        let Some(pid) = self.lock().pid else { return false };
        // SAFETY: kill(2) with a pid this slot started and has not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, signal) == 0 }
    }

    /// Sends `signal` and waits up to `within` for the instance to exit: its status, or
    /// `None` if it did not exit in time (it is then killed) or was not running.
    pub async fn end(&self, signal: i32, within: Duration) -> Option<ExitStatus> {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.lock();
            state.pid?;
            state.expect = Some(tx);
        }
        // A stopped process cannot act on SIGTERM.
        self.signal(libc::SIGCONT);
        if !self.signal(signal) {
            return None;
        }
        match tokio::time::timeout(within, rx).await {
            Ok(Ok(status)) => Some(status),
            _ => {
                self.signal(libc::SIGKILL);
                None
            }
        }
    }

    /// No more restarts; exits from now on are the run's own.
    pub fn close(&self) {
        self.lock().closing = true;
    }

    /// Exits no fault caused.
    pub fn unexpected(&self) -> Vec<Unexpected> {
        self.lock().unexpected.clone()
    }

    /// The owner name of the running instance.
    pub fn owner(&self) -> String {
        self.lock().owner.clone()
    }
}

/// `exit 0`, `exit 1`, `signal 9`.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        _ => format!("{status}"),
    }
}

/// The `actix-outbox` executable: `given`, or the one built next to this tool, in the same
/// profile, by `cargo build -p actix-outbox-cli --bin actix-outbox` (cheap when up to date).
pub fn find_binary(given: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(path) = given {
        return if path.is_file() {
            Ok(path.to_owned())
        } else {
            Err(format!("--bin {}: no such file", path.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let dir = exe.parent().ok_or("this executable has no directory")?;
    // target/<profile>/actix-outbox-chaos: build the command line in the same profile, into
    // the same target directory.
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_owned(),
        Some(name) => name.to_owned(),
        None => return Err(format!("cannot tell the profile from {}", dir.display())),
    };
    let target_dir = dir.parent().ok_or("the profile directory has no parent")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    eprintln!("chaos: building actix-outbox (profile {profile}); --bin PATH skips this");
    let status = std::process::Command::new(cargo)
        .args(["build", "--quiet", "-p", "actix-outbox-cli", "--bin", "actix-outbox", "--profile", &profile])
        .arg("--manifest-path")
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", target_dir)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build -p actix-outbox-cli failed: {status}"));
    }
    Ok(dir.join("actix-outbox"))
}
