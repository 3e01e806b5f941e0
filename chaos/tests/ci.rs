//! The chaos run as CI runs it: two minutes on a fixed seed, the tool's table and last line on
//! the terminal. Ignored by default, as it takes more than two minutes; `--include-ignored`
//! runs it (`.ci/run` does). `CHAOS_SEED` picks another seed, `CHAOS_MINUTES` another length.
//!
//! Run inside the workspace's `cargo test`, it uses the `actix-outbox` binary that the same
//! build made for the CLI's tests, so CI compiles the dispatcher once; alone, the tool builds
//! the binary itself.

use std::path::Path;
use std::process::Command;

#[test]
#[ignore = "a chaos run of two minutes and more: run it with --include-ignored"]
fn a_chaos_run_holds_every_check() {
    let chaos = env!("CARGO_BIN_EXE_actix-outbox-chaos");
    let seed = std::env::var("CHAOS_SEED").unwrap_or_else(|_| "2".into());
    let minutes = std::env::var("CHAOS_MINUTES").unwrap_or_else(|_| "2".into());
    let mut run = Command::new(chaos);
    run.args(["--minutes", &minutes, "--seed", &seed]);
    let dispatcher = Path::new(chaos).with_file_name("actix-outbox");
    if dispatcher.exists() {
        run.arg("--bin").arg(&dispatcher);
    }
    eprintln!("chaos: {minutes} minutes, seed {seed}");
    let status = run.status().expect("the chaos tool starts");
    assert!(
        status.success(),
        "the chaos run failed ({status}); replay it with: cargo run -p actix-outbox-chaos -- --minutes {minutes} --seed {seed}"
    );
}
