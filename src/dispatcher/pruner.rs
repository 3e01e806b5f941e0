//! The pruner: deletes `done` rows once they are older than the retention
//! ([`Retention::KeepFor`](crate::Retention::KeepFor)), so that the table stays the size of
//! that window without a cron job. The supervisor runs a pass a second after it starts, then
//! every [`PRUNE_EVERY`] (or a tenth of the retention when that is shorter).
//!
//! A pass walks the table by primary key from where the last one found young rows, a stretch
//! of [`STRETCH`] rows per transaction, deleting the expired `done` rows of each (`dead`,
//! `pending` and `processing` rows are never touched), and pauses [`PAUSE`] between two, so that
//! no transaction holds many locks and the claims keep the connections they need. It stops at
//! the first stretch that holds a `done` row finished within the retention: rows finish in about
//! the order of their ids, so those after it are younger still. Every tenth pass starts from the
//! first row, for the rows that finished long after their neighbours (retried, deferred,
//! scheduled). One process of a fleet prunes at a time: each stretch takes a transaction-scoped
//! advisory lock of its table, and a process that finds it taken ends its pass.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::shared::Shared;
use crate::metrics::Metrics;
use crate::store;

/// The first pass starts this long after the dispatcher, the next ones every
/// [`PRUNE_EVERY`] (or a tenth of the retention).
pub(crate) const FIRST_PASS_AFTER: Duration = Duration::from_secs(1);

/// How often the pruner starts a pass, at most.
pub(crate) const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Rows per stretch.
const STRETCH: i64 = 2_000;

/// The pause between two stretches.
const PAUSE: Duration = Duration::from_millis(20);

/// Every this many passes, one starts from the table's first row.
const FULL_PASS_EVERY: u32 = 10;

/// Where the pruner's passes start.
#[derive(Debug, Default)]
pub(crate) struct Pruner {
    /// The id after which the next pass starts.
    from: i64,
    passes: u32,
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Pass {
    pub(crate) deleted: u64,
    /// Where the next pass starts.
    pub(crate) next_from: i64,
}

/// How often to prune with a retention of `keep`.
pub(crate) fn every(keep: Duration) -> Duration {
    (keep / 10).clamp(Duration::from_secs(1), PRUNE_EVERY)
}

impl Pruner {
    /// Where the next pass starts, counting it.
    pub(crate) fn start(&mut self) -> i64 {
        self.passes += 1;
        if self.passes % FULL_PASS_EVERY == 1 { 0 } else { self.from }
    }

    /// A pass ended.
    pub(crate) fn ended(&mut self, pass: &Pass) {
        self.from = pass.next_from;
    }
}

/// One pass from id `from`, deleting `done` rows older than `keep`.
pub(crate) async fn prune(shared: Arc<Shared>, keep: Duration, from: i64) -> Result<Pass, crate::StoreError> {
    let mut pass = Pass { deleted: 0, next_from: from };
    let mut after = from;
    loop {
        let pool = &shared.pool;
        let mut conn = pool.checkout().await?;
        let step = pool.unit(&mut conn, async |c| store::prune_step(c, after, STRETCH, keep, true).await).await?;
        drop(conn);
        let deleted = usize::try_from(step.deleted).unwrap_or_default();
        pass.deleted += deleted as u64;
        Metrics::add(&shared.metrics.pruned, deleted);
        match step.last {
            // The table's end, or another process prunes.
            None => return Ok(pass),
            // Young rows: the next pass starts at this stretch.
            Some(_) if step.reached_recent => return Ok(pass),
            Some(last) => {
                after = last;
                pass.next_from = last;
            }
        }
        actix_rt::time::sleep(PAUSE).await;
    }
}

/// Logs a pass.
pub(crate) fn report(shared: &Shared, result: &Result<Pass, crate::StoreError>) {
    let outbox = shared.config.name.as_deref();
    match result {
        Ok(pass) if pass.deleted > 0 => debug!(outbox, rows = pass.deleted, "pruned done rows past the retention"),
        Ok(_) => {}
        Err(e) if e.is_transient() => shared.db.failed("prune", e),
        Err(e) => warn!(outbox, error = %e, "pruning failed; the next pass tries again"),
    }
}
