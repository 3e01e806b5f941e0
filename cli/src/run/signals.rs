//! SIGTERM and SIGINT, as the run waits for them.

use crate::CliError;

/// SIGTERM and SIGINT, registered once for the life of the command (the second of either ends
/// a graceful shutdown at once).
pub(super) struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    pub(super) fn register() -> Result<Self, CliError> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let failed = |e: std::io::Error| CliError::Failed(format!("cannot install the signal handlers: {e}"));
            Ok(Self {
                terminate: signal(SignalKind::terminate()).map_err(failed)?,
                interrupt: signal(SignalKind::interrupt()).map_err(failed)?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The name of the next signal received.
    pub(super) async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.terminate.recv() => "SIGTERM",
                _ = self.interrupt.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}
