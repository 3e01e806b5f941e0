//! The summary: every [`DispatcherConfig::summary_interval`] (a minute by default) the supervisor logs, at `info`, what the dispatcher did
//! since the last one (published, retried, deferred, dead, reaped, leases lost) and the table's
//! backlog and oldest unfinished row as the last table sample saw them, unless that sample is
//! too old to stand for now (the database did not answer the later ones): then the line leaves
//! them out and says how old the last sample is (`sampled="2m 5s ago"`). Per-batch lines are at
//! `debug`; state changes (sink down and up, an outage, a lost lease) are logged when they
//! happen. So at the default level a busy dispatcher writes a line a minute, not one a claim.
//!
//! [`DispatcherConfig::summary_interval`]: crate::DispatcherConfig::summary_interval

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::info;

use crate::metrics::MetricsSnapshot;
use crate::store::Sample;

/// The counters at the last summary, and the last table sample.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    last: Mutex<MetricsSnapshot>,
    /// The last table sample, and when it was read.
    sample: Mutex<Option<(Sample, Instant)>>,
}

/// What one summary line counts: the counters' growth since the last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Minute {
    pub(crate) published: u64,
    pub(crate) retried: u64,
    pub(crate) deferred: u64,
    pub(crate) dead: u64,
    pub(crate) reaped: u64,
    pub(crate) lost_leases: u64,
}

impl Summary {
    /// Keeps the table sample the summary reports.
    pub(crate) fn sampled(&self, sample: Sample) {
        *self.sample.lock().unwrap_or_else(|e| e.into_inner()) = Some((sample, Instant::now()));
    }

    /// How long ago the last table sample was read, if one was.
    pub(crate) fn sample_age(&self) -> Option<Duration> {
        self.sample.lock().unwrap_or_else(|e| e.into_inner()).map(|(_, at)| at.elapsed())
    }

    /// What happened since the last call (`now` is the counters now), remembering `now`.
    pub(crate) fn since_last(&self, now: MetricsSnapshot) -> Minute {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let minute = Minute {
            published: now.published.saturating_sub(last.published),
            retried: now.retried.saturating_sub(last.retried),
            deferred: now.deferred.saturating_sub(last.deferred),
            dead: now.dead.saturating_sub(last.dead),
            reaped: now.reaped.saturating_sub(last.reaped),
            lost_leases: now.lost_leases.saturating_sub(last.lost_leases),
        };
        *last = now;
        minute
    }

    /// Logs the summary of the period that ends now. A table sample older than `fresh_for`
    /// is not shown as the backlog: the line says how old it is instead.
    pub(crate) fn log(&self, outbox: Option<&str>, now: MetricsSnapshot, fresh_for: Duration) {
        let m = self.since_last(now);
        let last = *self.sample.lock().unwrap_or_else(|e| e.into_inner());
        let stale = last
            .filter(|(_, at)| at.elapsed() > fresh_for)
            .map(|(_, at)| format!("{} ago", humantime::format_duration(Duration::from_secs(at.elapsed().as_secs()))));
        let sample = last.filter(|_| stale.is_none()).map(|(sample, _)| sample);
        let backlog = sample.map(|s| s.backlog());
        let oldest = sample
            .and_then(|s| s.oldest)
            .map(|age| humantime::format_duration(Duration::from_secs(age.max(0.0) as u64)).to_string());
        info!(
            outbox,
            published = m.published,
            retried = m.retried,
            deferred = m.deferred,
            dead = m.dead,
            reaped = m.reaped,
            lost_leases = m.lost_leases,
            backlog,
            oldest = oldest.as_deref().unwrap_or("-"),
            sampled = stale.as_deref(),
            in_flight = now.in_flight,
            "outbox summary"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_summary_counts_since_the_last() {
        let summary = Summary::default();
        let at = |published, dead| MetricsSnapshot { published, dead, ..MetricsSnapshot::default() };
        assert_eq!(summary.since_last(at(10, 1)).published, 10);
        let second = summary.since_last(at(25, 1));
        assert_eq!((second.published, second.dead), (15, 0));
    }

    #[test]
    fn a_sample_is_fresh_until_its_age_passes() {
        let summary = Summary::default();
        assert_eq!(summary.sample_age(), None);
        summary.sampled(Sample::default());
        assert!(summary.sample_age().is_some_and(|age| age < Duration::from_secs(5)));
    }
}
