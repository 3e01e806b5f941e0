//! The insert listener: a dedicated connection that `LISTEN`s for the outbox trigger's
//! notifications and wakes one idle claim actor, so that a new row is claimed at once instead of
//! at the next poll. Polling stays as the fallback: a dropped connection or a lost notification
//! costs latency, never a row.

use std::time::Duration;

use actix::WeakAddr;
use diesel_async::SimpleAsyncConnection;
use futures_util::{FutureExt, StreamExt};
use tracing::{debug, warn};

use crate::store::PgPool;
use crate::supervisor::{OutboxSupervisor, WakeWorkers};

/// The channel the migration's trigger notifies on every `INSERT` statement into `outbox`.
pub(crate) const CHANNEL: &str = "outbox_insert";

/// Listens until the supervisor goes away, reconnecting with a capped backoff.
///
/// Holds only a weak address, so the listener never keeps a dropped dispatcher alive.
pub(crate) async fn listen(pool: PgPool, supervisor: WeakAddr<OutboxSupervisor>) {
    let mut backoff = Duration::from_millis(100);
    while supervisor.upgrade().is_some() {
        match listen_once(&pool, &supervisor).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff, "insert listener lost its connection; polling meanwhile");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

async fn listen_once(pool: &PgPool, supervisor: &WeakAddr<OutboxSupervisor>) -> Result<(), String> {
    // Not a pooled connection: LISTEN state must not leak to other users, and the stream holds
    // the connection for as long as we listen.
    let mut conn = pool.dedicated_connection().await.map_err(|e| e.to_string())?;
    conn.batch_execute(&format!("LISTEN {CHANNEL}")).await.map_err(|e| e.to_string())?;
    debug!("insert listener connected");
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    loop {
        // Poll the supervisor's liveness now and then, so a stopped dispatcher frees the connection.
        let next = tokio::time::timeout(Duration::from_secs(5), notifications.next()).await;
        let Some(addr) = supervisor.upgrade() else { return Ok(()) };
        match next {
            Err(_elapsed) => continue,
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
        addr.do_send(WakeWorkers);
    }
}
