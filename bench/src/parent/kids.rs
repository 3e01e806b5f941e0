//! The children of one phase, seen from the parent: started (this binary re-executed with a
//! child role), told `go` and `stop`, and their output lines applied as they come.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child as Process, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;

use crate::BoxError;

/// One child process, its stdin, and its last reported `done`.
pub(super) struct Kid {
    pub(super) process: Process,
    pub(super) stdin: Option<ChildStdin>,
    pub(super) done: u64,
    pub(super) last: Option<serde_json::Value>,
}

impl Kid {
    pub(super) fn send(&mut self, line: &str) {
        if let Some(stdin) = &mut self.stdin {
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        // Closing stdin tells the child to stop; kill it if it has not within a few seconds.
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.process.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// A message from a child: its index and one line (`None` at end of output).
pub(super) type KidLine = (usize, Option<String>);

/// Children of one phase and the stream of their output lines.
pub(super) struct Kids {
    pub(super) kids: Vec<Kid>,
    pub(super) lines: mpsc::UnboundedReceiver<KidLine>,
}

impl Kids {
    pub(super) fn spawn(args: &[Vec<String>]) -> Result<Self, BoxError> {
        let exe = std::env::current_exe()?;
        let (tx, lines) = mpsc::unbounded_channel();
        let mut kids = Vec::new();
        for (i, args) in args.iter().enumerate() {
            // A process group of its own: a Ctrl-C at the terminal reaches the parent only, which
            // stops the children through their stdin (`run` would take a second signal for
            // "exit at once").
            let mut process =
                Command::new(&exe).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).process_group(0).spawn()?;
            let stdout = process.stdout.take().ok_or("child without stdout")?;
            let stdin = process.stdin.take();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((i, Some(line))).is_err() {
                        return;
                    }
                }
                let _ = tx.send((i, None));
            });
            kids.push(Kid { process, stdin, done: 0, last: None });
        }
        Ok(Self { kids, lines })
    }

    /// Waits until every child said `ready`.
    pub(super) async fn ready(&mut self, timeout: Duration) -> Result<(), BoxError> {
        let mut ready = vec![false; self.kids.len()];
        let deadline = tokio::time::Instant::now() + timeout;
        while !ready.iter().all(|r| *r) {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some((i, Some(line)))) if line == "ready" => ready[i] = true,
                Ok(Some((_, Some(_)))) => {}
                Ok(Some((i, None))) => return Err(format!("child {i} failed to start (see its stderr)").into()),
                Ok(None) => return Err("children failed to start".into()),
                Err(_) => return Err("children did not get ready in time".into()),
            }
        }
        Ok(())
    }

    pub(super) fn go(&mut self) {
        for kid in &mut self.kids {
            kid.send("go");
        }
    }

    /// Starts the dispatchers of `args`, lets them go, and leaves them idle for `settle` so that
    /// a phase measures a dispatcher at rest; the confirms they report meanwhile are applied.
    pub(super) async fn settled(
        args: &[Vec<String>],
        settle: Duration,
    ) -> Result<(Self, HashMap<i64, SystemTime>), BoxError> {
        let mut kids = Self::spawn(args)?;
        kids.ready(Duration::from_secs(30)).await?;
        kids.go();
        let mut confirms = HashMap::new();
        let until = tokio::time::Instant::now() + settle;
        while let Ok(Some(line)) = tokio::time::timeout_at(until, kids.lines.recv()).await {
            kids.apply(line, &mut confirms)?;
        }
        Ok((kids, confirms))
    }

    /// The children's pids.
    pub(super) fn pids(&self) -> Vec<u32> {
        self.kids.iter().map(|k| k.process.id()).collect()
    }

    pub(super) fn done(&self) -> u64 {
        self.kids.iter().map(|k| k.done).sum()
    }

    /// Applies one line; returns `Err` when a child ended early.
    pub(super) fn apply(
        &mut self,
        (i, line): KidLine,
        confirms: &mut HashMap<i64, SystemTime>,
    ) -> Result<(), BoxError> {
        let Some(line) = line else {
            if self.kids[i].last.is_none() {
                return Err(format!("child {i} ended unexpectedly (see its stderr above)").into());
            }
            return Ok(());
        };
        let mut words = line.splitn(3, ' ');
        match (words.next(), words.next(), words.next()) {
            (Some("done"), Some(n), None) => self.kids[i].done = n.parse()?,
            (Some("confirm"), Some(id), Some(nanos)) => {
                let nanos: u64 = nanos.parse()?;
                confirms.insert(id.parse()?, UNIX_EPOCH + Duration::from_nanos(nanos));
            }
            (Some("final"), Some(_), _) => {
                self.kids[i].last = Some(serde_json::from_str(line.trim_start_matches("final "))?);
            }
            _ => {}
        }
        Ok(())
    }

    /// Tells every child to stop and collects their `final` reports.
    pub(super) async fn stop(mut self, timeout: Duration) -> Result<Vec<serde_json::Value>, BoxError> {
        for kid in &mut self.kids {
            kid.send("stop");
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut ignore = HashMap::new();
        while self.kids.iter().any(|k| k.last.is_none()) {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => self.apply(line, &mut ignore)?,
                Ok(None) => break,
                Err(_) => return Err("children did not stop in time".into()),
            }
        }
        Ok(self.kids.iter_mut().filter_map(|k| k.last.take()).collect())
    }
}
