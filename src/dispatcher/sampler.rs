//! The table sampler: every [`DispatcherConfig::table_metrics_interval`] the supervisor reads
//! the outbox table's unfinished rows in one aggregate statement (a second one under the FIFO
//! gate, for the blocked aggregates) and sets the sampled gauges of the `metrics` facade. Its
//! cost follows the backlog, not the history: the `done` gauge is the statistics collector's
//! estimate, not a count. No sample starts
//! while the database is known to be down (the gauges keep their last values). A sample that
//! fails leaves the gauges as they were and counts `outbox_table_sample_errors_total`; one
//! still running when the next is due makes that one skip, and one that took long spaces the
//! next ones out: sampling takes at most one part in [`SHARE`] of the time, pausing at most
//! [`MAX_PAUSE`] (a backlog of a million rows takes the statement about a second, which the
//! dispatcher would otherwise pay every interval while it drains that backlog). A sample is
//! bounded by the pool's query timeout, like every statement. Gauges left from an older sample are never passed off
//! as current: `outbox_table_sample_age_seconds` says how old they are, and the summary line
//! leaves the backlog out and says since when it has not been sampled.
//!
//! [`DispatcherConfig::table_metrics_interval`]: crate::DispatcherConfig::table_metrics_interval

use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use super::shared::Shared;
use crate::store;

/// Sampling takes at most one part in this many of the time: a sample that took `d` is followed
/// by none for `SHARE × d`, counted from its start.
pub(crate) const SHARE: u32 = 20;

/// The longest pause the sampler takes after a costly sample: its gauges are never older than
/// this and the sample's own time, plus an interval.
pub(crate) const MAX_PAUSE: Duration = Duration::from_secs(60);

/// How many of the sampler's ticks, `every` apart, to let pass without a sample after one that
/// took `took`, so that the next starts no sooner than [`SHARE`] times `took` after it (and no
/// later than [`MAX_PAUSE`] after it ended).
pub(crate) fn ticks_to_skip(took: Duration, every: Duration) -> u32 {
    if every.is_zero() {
        return 0;
    }
    let pause = (took * SHARE).min(took + MAX_PAUSE);
    let ticks = (pause.as_secs_f64() / every.as_secs_f64()).ceil();
    // The sample began at a tick: the next due tick is the first at or after SHARE × took.
    (ticks as u32).saturating_sub(1)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cheap_sample_skips_no_tick_and_a_costly_one_keeps_sampling_to_a_twentieth_of_the_time() {
        let every = Duration::from_secs(5);
        assert_eq!(ticks_to_skip(Duration::from_millis(20), every), 0);
        assert_eq!(ticks_to_skip(Duration::from_millis(250), every), 0, "exactly a twentieth");
        assert_eq!(ticks_to_skip(Duration::from_millis(251), every), 1);
        // 0.7 s: the next sample no sooner than 14 s after this one, at the third tick (15 s).
        assert_eq!(ticks_to_skip(Duration::from_millis(700), every), 2);
        // 2 s would pause 40 s; 10 s would pause 200 s, but the pause stops a minute after the
        // sample: at 70 s, the 14th tick.
        assert_eq!(ticks_to_skip(Duration::from_secs(2), every), 7);
        assert_eq!(ticks_to_skip(Duration::from_secs(10), every), 13);
        assert_eq!(ticks_to_skip(Duration::from_secs(1), Duration::ZERO), 0);
    }
}
