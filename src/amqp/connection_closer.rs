//! Closing a connection or channel without letting a broker that does not answer hold the
//! caller: a close waits for the broker's `close-ok`, which a dead peer never sends.

use std::future::Future;
use std::time::Duration;

use lapin::Connection;
use tracing::debug;

/// How long a graceful close may take.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs `close` (a lapin close of a connection or a channel) for at most [`CLOSE_TIMEOUT`];
/// `None` when it took longer.
pub(crate) async fn bounded<T>(close: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout(CLOSE_TIMEOUT, close).await.ok()
}

/// Closes `conn` with `200 OK` if it is still connected, logging how that went under `what`.
pub(crate) async fn close_gracefully(conn: &Connection, what: &str) {
    if !conn.status().connected() {
        return;
    }
    match bounded(conn.close(200, "OK".into())).await {
        Some(Ok(())) => debug!("{what} closed"),
        Some(Err(e)) => debug!(error = %e, "closing the {what} failed"),
        None => debug!("closing the {what} timed out"),
    }
}
