//! What the server fixtures ([`crate::pgbouncer`], [`crate::standby`], [`crate::cluster`])
//! share: a free port, a folder the server's user owns (`postgres`, or `rabbitmq` for the
//! RabbitMQ nodes), and commands run as that user (PostgreSQL's server tools and PgBouncer
//! refuse to run as root, and the tests run as root on the CI machines).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::unique;

/// The system user the servers run as.
const RUN_AS: &str = "postgres";

/// A TCP port of 127.0.0.1 free right now. Another process may take it before the server
/// binds it: the fixtures retry a start that fails on a port.
pub(crate) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap().port()
}

/// A fresh folder under the system's temporary folder, owned by [`RUN_AS`], removed with
/// everything in it when this is dropped.
pub(crate) struct OwnedDir {
    path: PathBuf,
    owner: &'static str,
}

impl OwnedDir {
    /// Creates `<tmp>/outbox_it.<what>.<pid>.<n>.<random>`.
    pub(crate) fn new(what: &str) -> OwnedDir {
        OwnedDir::owned_by(what, RUN_AS)
    }

    /// Like [`OwnedDir::new`], owned by the system user `owner`.
    pub(crate) fn owned_by(what: &str, owner: &'static str) -> OwnedDir {
        let path = std::env::temp_dir().join(unique(what));
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        let dir = OwnedDir { path, owner };
        dir.give_to_owner(&dir.path);
        dir
    }

    /// The folder.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Hands `path` (created by this process, so owned by root) over to the folder's owner
    /// ([`RUN_AS`] unless made by [`OwnedDir::owned_by`]).
    pub(crate) fn give_to_owner(&self, path: &Path) {
        let owner = self.owner;
        let out = Command::new("chown").arg(format!("{owner}:{owner}")).arg(path).output().expect("run chown");
        assert!(out.status.success(), "chown {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }

    /// The last lines of the file `name` in the folder, for a failure message.
    pub(crate) fn tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.path.join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for OwnedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `program args...` as [`RUN_AS`] (through `runuser`), from the folder `cwd` (the user may not
/// be allowed into the test's own working folder).
pub(crate) fn as_postgres(cwd: &Path, program: &str, args: &[&str]) -> Command {
    as_user(RUN_AS, cwd, program, args)
}

/// `program args...` as the system user `user` (through `runuser`, which sets `HOME` to the
/// user's), from the folder `cwd`.
pub(crate) fn as_user(user: &str, cwd: &Path, program: &str, args: &[&str]) -> Command {
    let mut command = Command::new("runuser");
    command.args(["-u", user, "--", program]).args(args).current_dir(cwd).stdin(Stdio::null());
    command
}

/// Runs `command` to its end; its output if it succeeded, what it said if not.
pub(crate) fn run(mut command: Command) -> Result<Output, String> {
    let out = command.output().map_err(|e| format!("{command:?}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{command:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// [`run`] on the runtime's blocking threads, so that the dispatcher's actors on the test's
/// thread go on meanwhile (a failover takes a second or so).
pub(crate) async fn run_blocking(command: Command) -> Result<Output, String> {
    tokio::task::spawn_blocking(move || run(command)).await.expect("command thread")
}
