//! The table sampler: every [`DispatcherConfig::table_metrics_interval`] the supervisor reads
//! the outbox table's unfinished rows in one aggregate statement (a second one under the FIFO
//! gate, for the blocked aggregates) and sets the sampled gauges of the `metrics` facade. Its
//! cost follows the backlog, not the history: the `done` gauge is the statistics collector's
//! estimate, not a count. No sample starts
//! while the database is known to be down (the gauges keep their last values). A sample that
//! fails leaves the gauges as they were and counts `outbox_table_sample_errors_total`; one
//! still running when the next is due makes that one skip.
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
        let mut conn = shared.pool.get().await?;
        let sample = store::sample_unfinished(&mut conn).await?;
        let blocked = if shared.config.fifo.is_on() {
            shared.fifo_index(&mut conn).await?;
            Some(store::blocked_aggregates_count(&mut conn, &shared.config.fifo).await?)
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
