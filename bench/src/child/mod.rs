//! Child processes: the dispatcher, the raw publisher and `actix-outbox run`. They talk to the
//! parent in lines: stdout `ready`, `done <n>` (the dispatcher), `confirm <id> <nanos>`,
//! `final <json>`; stdin `go`, `stop` (or end of file, which also means stop). This module is
//! the child's end of that protocol.

mod dispatcher;
mod raw;
mod run;

use std::io::{BufRead, Write};
use std::time::Duration;

use tokio::sync::mpsc;

pub(crate) use dispatcher::dispatcher;
pub(crate) use raw::broker;
pub(crate) use run::{parse as parse_run, run};

pub(crate) fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        // The parent is gone.
        std::process::exit(3);
    }
}

/// Lines from stdin, read on a thread of their own; end of file becomes `stop`.
fn commands() -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line.trim().to_owned()).is_err() {
                return;
            }
        }
        let _ = tx.send("stop".to_owned());
    });
    rx
}

async fn wait_for(commands: &mut mpsc::UnboundedReceiver<String>, word: &str, timeout: Duration) -> bool {
    let found = async {
        while let Some(line) = commands.recv().await {
            if line == word {
                return true;
            }
            if line == "stop" {
                return false;
            }
        }
        false
    };
    tokio::time::timeout(timeout, found).await.unwrap_or(false)
}
