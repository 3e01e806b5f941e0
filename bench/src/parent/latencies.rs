//! Commit → consumer latency in the steady phases: each row's commit instant, from the
//! producer, joined with its first delivery at the consumer, from the tally, whichever of the
//! two is known first (pgbench's commits are read from the table a moment after they happen).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::time::SystemTime;

/// One delivered row: when it was committed and when the consumer first had it, in seconds
/// from the production's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Sample {
    pub(super) commit_s: f64,
    pub(super) arrival_s: f64,
}

impl Sample {
    /// Commit → delivery, milliseconds (never below 0: a producer notes its commit a moment
    /// after the database has it, and the relay may be quicker than that).
    pub(super) fn latency_ms(&self) -> f64 {
        ((self.arrival_s - self.commit_s) * 1e3).max(0.0)
    }
}

/// The rows of a steady phase between their commit and their delivery.
#[derive(Debug)]
pub(super) struct Join {
    origin: SystemTime,
    /// Committed, not delivered yet: id → commit offset.
    waiting: HashMap<i64, f64>,
    /// Delivered before their commit was known (or delivered again): id → arrival offset.
    early: HashMap<i64, f64>,
    /// Delivered rows whose commit is known, in the order they were matched.
    samples: Vec<Sample>,
    /// Rows committed so far.
    pub(super) committed: u64,
    /// Deliveries so far (first deliveries, and redeliveries of a row already matched).
    pub(super) arrivals: u64,
}

impl Join {
    /// An empty join whose offsets count from `origin`.
    pub(super) fn new(origin: SystemTime) -> Self {
        Self { origin, waiting: HashMap::new(), early: HashMap::new(), samples: Vec::new(), committed: 0, arrivals: 0 }
    }

    /// Seconds from the origin to `t` (negative before it).
    pub(super) fn offset(&self, t: SystemTime) -> f64 {
        match t.duration_since(self.origin) {
            Ok(after) => after.as_secs_f64(),
            Err(before) => -before.duration().as_secs_f64(),
        }
    }

    /// Row `id` was committed at `at`.
    pub(super) fn committed(&mut self, id: i64, at: SystemTime) {
        let commit_s = self.offset(at);
        self.committed += 1;
        match self.early.remove(&id) {
            Some(arrival_s) => self.samples.push(Sample { commit_s, arrival_s }),
            None => {
                self.waiting.insert(id, commit_s);
            }
        }
    }

    /// The consumer received row `id` at `at`.
    pub(super) fn arrived(&mut self, id: i64, at: SystemTime) {
        let arrival_s = self.offset(at);
        if let Some(commit_s) = self.waiting.remove(&id) {
            self.arrivals += 1;
            self.samples.push(Sample { commit_s, arrival_s });
            return;
        }
        // Either its commit is not known yet, or it was delivered before (at least once):
        // either way only its first arrival counts.
        if let Entry::Vacant(slot) = self.early.entry(id) {
            slot.insert(arrival_s);
            self.arrivals += 1;
        }
    }

    /// Rows committed and not delivered yet.
    pub(super) fn backlog(&self) -> usize {
        self.waiting.len()
    }

    /// The commit offsets of the rows not delivered yet.
    pub(super) fn waiting(&self) -> impl Iterator<Item = f64> + '_ {
        self.waiting.values().copied()
    }

    /// Deliveries that match no commit: redeliveries, or rows whose commit was never seen.
    pub(super) fn unmatched(&self) -> usize {
        self.early.len()
    }

    /// The samples matched so far.
    pub(super) fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Takes the samples matched since the last call (for phases that keep only summaries).
    pub(super) fn take_samples(&mut self) -> Vec<Sample> {
        std::mem::take(&mut self.samples)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(origin: SystemTime, ms: u64) -> SystemTime {
        origin + Duration::from_millis(ms)
    }

    #[test]
    fn a_row_is_matched_whichever_end_is_known_first() {
        let origin = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut join = Join::new(origin);
        // Commit first (the bench's producer), then the delivery.
        join.committed(7, at(origin, 1_000));
        assert_eq!(join.backlog(), 1);
        join.arrived(7, at(origin, 1_012));
        // Delivery first (pgbench's commit is read from the table later).
        join.arrived(8, at(origin, 2_030));
        assert_eq!((join.backlog(), join.unmatched()), (0, 1));
        join.committed(8, at(origin, 2_000));
        // A redelivery of a matched row is one arrival more and no sample.
        join.arrived(7, at(origin, 3_000));
        join.arrived(7, at(origin, 3_001));
        let latencies: Vec<f64> = join.samples().iter().map(|s| (s.latency_ms() * 1e3).round() / 1e3).collect();
        assert_eq!(latencies, vec![12.0, 30.0]);
        assert_eq!((join.committed, join.arrivals, join.backlog(), join.unmatched()), (2, 3, 0, 1));
        assert_eq!(join.take_samples().len(), 2);
        assert!(join.samples().is_empty());
    }

    #[test]
    fn a_delivery_noted_before_its_commit_counts_as_no_wait() {
        let origin = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut join = Join::new(origin);
        join.committed(1, at(origin, 500));
        join.arrived(1, at(origin, 499));
        assert_eq!(join.samples()[0].latency_ms(), 0.0);
        assert_eq!(join.offset(origin - Duration::from_millis(250)), -0.25);
    }
}
