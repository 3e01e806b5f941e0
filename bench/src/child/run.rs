//! The `actix-outbox run` process: the held-horizon and soak phases' relay. It is the command
//! line's own `run` (`actix_outbox_cli`), parsed from the arguments the parent gives, so its
//! defaults and every flag of `run` (the bench's `--relay-arg`s) are the product's, not a copy.

use std::time::Duration;

use clap::Parser;

use super::{commands, emit, wait_for};
use crate::procstat::{own_cpu_seconds, peak_rss_kib};
use crate::{BoxError, RunChild};

/// How long `run` may take to stop once told (it finishes its publishes in flight first).
const STOP_WITHIN: Duration = Duration::from_secs(60);

/// Parses `args` as `actix-outbox run ARGS...` does.
pub(crate) fn parse(args: &[String]) -> Result<actix_outbox_cli::Cli, clap::Error> {
    let argv = ["actix-outbox", "run"].into_iter().map(str::to_owned).chain(args.iter().cloned());
    actix_outbox_cli::Cli::try_parse_from(argv)
}

/// Runs `actix-outbox run` from `go` to `stop` (or the end of stdin), then reports its peak RSS
/// and CPU time. `stop` becomes a SIGTERM to this process: `run`'s own graceful shutdown.
pub(crate) fn run(role: RunChild) -> Result<(), BoxError> {
    let cli = parse(&role.args)?;
    let mut commands = commands();
    emit("ready");
    let started = actix::System::new().block_on(async move {
        // `run` waits for its signal; the parent's `stop` is sent to it as one.
        if !wait_for(&mut commands, "go", Duration::from_secs(24 * 3600)).await {
            return Ok(None);
        }
        let cpu_at_go = own_cpu_seconds();
        let execute = cli.execute();
        let mut execute = std::pin::pin!(execute);
        tokio::select! {
            result = &mut execute => return result.map(|()| Some(cpu_at_go)),
            _ = commands.recv() => {}
        }
        let status = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .stderr(std::process::Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            return Err(actix_outbox_cli::CliError::Failed("could not signal the relay to stop".into()));
        }
        match tokio::time::timeout(STOP_WITHIN, execute).await {
            Ok(result) => result.map(|()| Some(cpu_at_go)),
            Err(_) => Err(actix_outbox_cli::CliError::Failed("the relay did not stop within 60 s".into())),
        }
    })?;
    let Some(cpu_at_go) = started else { return Ok(()) };
    let cpu_seconds = cpu_at_go.zip(own_cpu_seconds()).map(|(go, stop)| stop - go);
    let report = serde_json::json!({ "peak_rss_kib": peak_rss_kib(), "cpu_seconds": cpu_seconds });
    emit(&format!("final {report}"));
    Ok(())
}
