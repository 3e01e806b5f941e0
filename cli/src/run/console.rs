//! The web console of the outboxes a run relays (`--console-addr`).

use super::args::RunArgs;
use super::relay::Running;
use crate::CliError;

/// The console's own pool: a page reads with one statement at a time.
const CONSOLE_CONNECTIONS: u32 = 2;

/// The console of one outbox being relayed, on a pool of its own (pages never wait for the
/// dispatcher's connections, nor it for theirs): two connections, or one an outbox when the
/// console shows several.
pub(super) async fn console_of(
    outbox: &Running,
    args: &RunArgs,
    token: Option<&str>,
    several: bool,
) -> Result<actix_outbox_console::Console, CliError> {
    let pool = outbox.database.pool(if several { 1 } else { CONSOLE_CONNECTIONS }).await?;
    let mut console = actix_outbox_console::Console::new(pool)
        .supervisor(outbox.relayed.supervisor.clone())
        .fifo(args.fifo.fifo()?)
        .source(outbox.relayed.source.clone());
    if let Some(token) = token {
        console = console.token(token);
    }
    Ok(console)
}
