//! The sweep (see `store::sweep`), which the supervisor runs every [`SWEEP_EVERY`]: it hands
//! rows whose lease expired to the claims, reaps those with no attempt left, moves rows the
//! claims passed while another statement held them, and moves the outbox's horizon forward (the
//! cursors of this process catch up with it). One process of a fleet sweeps at a time; the
//! others find the sweep's row locked and skip their turn. A sweep whose stretch of rows was
//! full runs again after [`SWEEP_AGAIN`]; none starts while the database is known to be down.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::shared::Shared;
use crate::metrics::Metrics;
use crate::store::{self, SweepParams, Swept};

/// How often the supervisor sweeps: a lease that ran out is taken over within this much after
/// it did.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How soon a sweep whose stretch was full runs again.
pub(crate) const SWEEP_AGAIN: Duration = Duration::from_millis(50);

/// Rows one sweep reads at most.
const CHUNK: usize = 10_000;

/// How old a pending row the claims passed must be before the sweep moves it: older than any
/// claim that may still hold it locked.
const STRAY_AFTER: Duration = Duration::from_secs(10);

/// What one sweep did; `None` when another process swept.
pub(crate) type SweepResult = Result<Option<Swept>, crate::StoreError>;

/// Sweeps once; [`report`] logs and counts it.
pub(crate) async fn sweep(shared: Arc<Shared>) -> SweepResult {
    let pool = &shared.pool;
    let mut conn = pool.checkout().await?;
    let params = SweepParams {
        max_attempts: shared.config.max_attempts,
        chunk: CHUNK,
        stray_after: STRAY_AFTER,
        claimed_to: shared.cursor.passed(),
    };
    pool.unit(&mut conn, async |c| store::sweep(c, params).await).await
}

/// Logs and counts what a sweep did; whether to sweep again soon.
pub(crate) fn report(shared: &Shared, result: SweepResult) -> bool {
    let outbox = shared.config.name.as_deref();
    match result {
        Ok(None) => false,
        Ok(Some(swept)) => {
            // The claims and the finalizes, not the sweep, say when an outage ended.
            let metrics = &shared.metrics;
            if swept.expired > 0 {
                Metrics::add(&metrics.expired, swept.expired);
                info!(
                    outbox,
                    rows = swept.expired,
                    "leases ran out (a worker died or stalled): the rows go to the next claim, which takes them over"
                );
            }
            if swept.strays > 0 {
                Metrics::add(&metrics.strays, swept.strays);
                warn!(
                    outbox,
                    rows = swept.strays,
                    "pending rows the claims had passed while another statement held them locked: they go to the next claim"
                );
            }
            if !swept.reaped.is_empty() {
                Metrics::add(&metrics.reaped, swept.reaped.len());
                for f in &swept.reaped {
                    warn!(
                        outbox,
                        outbox_id = f.id,
                        lease_version = f.lease_version,
                        "reaped: lease expired with no attempt left; the row is dead"
                    );
                }
            }
            if let Some(horizon) = &swept.horizon {
                if swept.moved {
                    debug!(outbox, horizon = %horizon, "the outbox's horizon moved");
                }
                shared.cursor.catch_up(horizon);
            }
            swept.more
        }
        Err(e) => {
            if e.is_transient() {
                shared.db.failed("sweep", &e);
            } else {
                warn!(outbox, error = %e, "the sweep failed; it runs again in a second");
            }
            false
        }
    }
}
