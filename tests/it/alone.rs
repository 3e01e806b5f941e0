//! Tests that need a process of their own: one that watches how a process ends (its exit code,
//! what it printed), or one that installs a process-wide log subscriber, which no neighbour
//! running in the same binary may race.
//!
//! Such a test runs this same test binary again with only itself selected (`--exact`) and
//! [`ROLE`] set; in that child, the test does its real work. Its parent asserts on the child's
//! exit status and output.

use std::process::{Command, Output};

/// Set in the child: the scenario it plays.
const ROLE: &str = "ACTIX_OUTBOX_IT_ALONE";

/// The scenario this process plays, when it is a child started by [`run_alone`].
pub(crate) fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// Runs test `name` (its path from the binary's root, `module::test`) alone in a child process
/// of this binary, playing `role`, with `env` added; waits for it and returns what it did.
pub(crate) fn run_alone(name: &str, role: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe);
    child.args(["--exact", name, "--nocapture", "--test-threads=1", "--include-ignored"]).env(ROLE, role);
    // The child prints its own panics; no backtrace, so that the parent reads only messages.
    child.env("RUST_BACKTRACE", "0");
    for (key, value) in env {
        child.env(key, value);
    }
    child.output().expect("the test binary runs")
}

/// The child's stderr, as text.
pub(crate) fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Test `name` whose work is `body`: run alone in a child process, on an actix system, and
/// passed when the child's run passed. In the child, this runs `body` itself.
pub(crate) fn test_alone<F: std::future::Future<Output = ()>>(name: &str, body: impl FnOnce() -> F) {
    if role().as_deref() == Some(name) {
        actix_rt::System::new().block_on(body());
        return;
    }
    let output = run_alone(name, name, &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", stderr(&output));
    assert!(stdout.contains("1 passed"), "the child ran the test: {stdout}");
}
