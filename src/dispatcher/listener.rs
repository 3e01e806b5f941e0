//! The insert listener: a dedicated connection that `LISTEN`s for the outbox trigger's
//! notifications and wakes one idle claim actor, so that a new row is claimed at once instead of
//! at the next poll. Polling stays as the fallback: a dropped connection or a lost notification
//! costs latency, never a row.

use std::time::Duration;

use diesel_async::SimpleAsyncConnection;
use futures_util::{FutureExt, StreamExt};
use tracing::{debug, warn};

use crate::store::PgPool;

/// The channel the migration's trigger notifies on every `INSERT` statement into `outbox`.
pub(crate) const CHANNEL: &str = "outbox_insert";

/// Listens until the dispatcher is gone, reconnecting with a capped backoff.
///
/// `wake(burst)` wakes a worker after `burst` notifications (`0` only asks whether the
/// dispatcher is still there) and returns false once it is gone. The supervisor hands in one
/// that holds a weak address, so the listener never keeps a dropped dispatcher alive.
pub(crate) async fn listen(pool: PgPool, wake: impl Fn(usize) -> bool) {
    let mut backoff = Duration::from_millis(100);
    while wake(0) {
        match listen_once(&pool, &wake).await {
            Ok(()) => return,
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff, "insert listener lost its connection; polling meanwhile");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// `Ok` when the dispatcher is gone.
async fn listen_once(pool: &PgPool, wake: &impl Fn(usize) -> bool) -> Result<(), String> {
    // Not a pooled connection: LISTEN state must not leak to other users, and the stream holds
    // the connection for as long as we listen.
    let mut conn = pool.dedicated_connection().await.map_err(|e| e.to_string())?;
    conn.batch_execute(&format!("LISTEN {CHANNEL}")).await.map_err(|e| e.to_string())?;
    debug!("insert listener connected");
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    loop {
        // Poll the supervisor's liveness now and then, so a stopped dispatcher frees the connection.
        let next = tokio::time::timeout(Duration::from_secs(5), notifications.next()).await;
        match next {
            Err(_elapsed) if wake(0) => continue,
            Err(_elapsed) => return Ok(()),
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => return Err(e.to_string()),
            // The backend went away; polling this stream again would panic.
            Ok(None) => return Err("notification stream ended".into()),
        }
        // A burst of inserts is one wake-up: swallow what has already arrived.
        let mut burst = 1usize;
        while let Some(Some(Ok(_))) = notifications.next().now_or_never() {
            burst += 1;
        }
        debug!(burst, "rows inserted; waking a worker");
        if !wake(burst) {
            return Ok(());
        }
    }
}
