//! What every module runs the binary with: the binary itself, to completion ([`cli`], [`ok`])
//! or in the background ([`Dispatcher`]), and the rows it is run against.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_outbox_test_support::TestDb;
use diesel_async::SimpleAsyncConnection;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_actix-outbox");
pub(crate) const WITHIN: Duration = actix_outbox_test_support::PATIENCE;

/// What one finished command printed and returned.
#[derive(Debug)]
pub(crate) struct Ran {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Ran {
    /// The one line an error must fit in.
    pub(crate) fn error_line(&self) -> &str {
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "expected exactly one line on stderr, got {:?}", self.stderr);
        lines[0]
    }
}

/// The binary with a clean environment: only what the test passes reaches it.
pub(crate) fn command(database_url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("AMQP_URL").env_remove("RUST_LOG").env("DATABASE_URL", database_url);
    cmd
}

/// Runs `actix-outbox <args>` against `database_url` to completion.
pub(crate) async fn cli(database_url: &str, args: &[&str]) -> Ran {
    let mut cmd = command(database_url);
    cmd.args(args);
    let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().expect("run the binary");
    Ran {
        code: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

/// Runs it and insists on success.
pub(crate) async fn ok(database_url: &str, args: &[&str]) -> String {
    let ran = cli(database_url, args).await;
    assert_eq!(ran.code, 0, "actix-outbox {args:?} failed: {ran:?}");
    ran.stdout
}

pub(crate) async fn execute(db: &TestDb, sql: &str) {
    db.conn().await.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Makes `ids` dead as the dispatcher would leave them.
pub(crate) async fn make_dead(db: &TestDb, ids: &[i64]) {
    for id in ids {
        execute(
            db,
            &format!(
                "UPDATE outbox SET status = 'dead', attempts = 12, lease_version = 12, lease_owner = 'host:1:worker-0',
                 last_error = 'retryable: nack {id}', available_at = '9999-12-31 00:00:00+00' WHERE id = {id}"
            ),
        )
        .await;
    }
}

/// What [`Dispatcher::lines_with`] found.
#[derive(Debug)]
pub(crate) struct Logged {
    /// The lines that hold the needle.
    pub(crate) lines: Vec<String>,
    /// The log's last five lines, whatever they hold.
    #[allow(dead_code)] // Read through `Debug`, in the message of a wait that runs out.
    pub(crate) tail: Vec<String>,
}

/// A running `actix-outbox run`, its stderr collected line by line.
pub(crate) struct Dispatcher {
    pub(crate) child: Option<Child>,
    pub(crate) stderr: Arc<Mutex<Vec<String>>>,
}

impl Dispatcher {
    pub(crate) fn start(database_url: &str, args: &[&str]) -> Self {
        let mut cmd = command(database_url);
        cmd.arg("run").args(args).env("RUST_LOG", "info").stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start the dispatcher");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = stderr.clone();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Dispatcher { child: Some(child), stderr }
    }

    pub(crate) fn signal(&self, name: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        let status = Command::new("kill").args([&format!("-{name}"), &pid]).status().unwrap();
        assert!(status.success(), "kill -{name} {pid}");
    }

    pub(crate) fn log(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    pub(crate) fn logged(&self, needle: &str) -> usize {
        self.stderr.lock().unwrap().iter().filter(|l| l.contains(needle)).count()
    }

    /// The lines that hold `needle`, and the log's last lines: what a wait on the log reports
    /// when it runs out.
    pub(crate) fn lines_with(&self, needle: &str) -> Logged {
        let log = self.stderr.lock().unwrap();
        Logged {
            lines: log.iter().filter(|l| l.contains(needle)).cloned().collect(),
            tail: log.iter().rev().take(5).rev().cloned().collect(),
        }
    }

    pub(crate) fn is_running(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_none()
    }

    /// Waits for the process to exit, at most `within`.
    pub(crate) async fn exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {within:?}; log:\n{}", self.log().join("\n"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
