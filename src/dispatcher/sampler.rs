//! The table sampler: every [`DispatcherConfig::table_metrics_interval`] the supervisor reads
//! the outbox table's unfinished rows in one aggregate statement (a second one under the FIFO
//! gate, for the blocked aggregates) and sets the sampled gauges of the `metrics` facade. Its
//! cost follows the backlog, not the history: the `done` gauge is the statistics collector's
//! estimate, not a count. No sample starts
//! while the database is known to be down (the gauges keep their last values). A sample that
//! fails leaves the gauges as they were and counts `outbox_table_sample_errors_total`; one
//! still running when the next is due makes that one skip. A sample is bounded by the pool's
//! query timeout, like every statement. Gauges left from an older sample are never passed off
//! as current: `outbox_table_sample_age_seconds` says how old they are, and the summary line
//! leaves the backlog out and says since when it has not been sampled.
//!
//! [`DispatcherConfig::table_metrics_interval`]: crate::DispatcherConfig::table_metrics_interval

use std::sync::Arc;

use tracing::debug;

use super::shared::Shared;
use crate::store;

/// What one sample read: the table's unfinished rows, and the blocked aggregates under FIFO.
pub(crate) type Sampled = Result<(store::Sample, Option<i64>), crate::StoreError>;

/// Samples the table once; [`report`] sets the gauges.
pub(crate) async fn sample(shared: Arc<Shared>) -> Sampled {
    async {
        let pool = &shared.pool;
        let mut conn = pool.checkout().await?;
        let sample = pool.unit(&mut conn, async |c| store::sample_unfinished(c).await).await?;
        let blocked = if shared.config.fifo.is_on() {
            shared.fifo_index(&mut conn).await?;
            let fifo = &shared.config.fifo;
            Some(pool.unit(&mut conn, async |c| store::blocked_aggregates_count(c, fifo).await).await?)
        } else {
            None
        };
        Ok::<_, crate::StoreError>((sample, blocked))
    }
    .await
}

/// Sets the gauges from a sample (or counts its failure).
pub(crate) fn report(shared: &Shared, result: Sampled) {
    match result {
        // An answer ends no outage (see `DbHealth::answered`): a standby answers this read
        // while it refuses every write.
        Ok((sample, blocked)) => {
            shared.summary.sampled(sample);
            shared.metrics.sampled(&sample, blocked);
        }
        Err(e) => {
            shared.metrics.sample_failed();
            if e.is_transient() {
                shared.db.failed("sample the table metrics", &e);
            } else {
                debug!(error = %e, "sampling the table metrics failed");
            }
        }
    }
}
