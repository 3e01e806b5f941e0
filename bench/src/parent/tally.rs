//! What the consumer of the benchmark's queue has seen, shared between it and the phases.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::SystemTime;

use super::latencies::Join;

/// What the consumer has seen of the current phase's id range.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) first: i64,
    pub(super) seen: Vec<bool>,
    pub(super) distinct: usize,
    pub(super) duplicates: usize,
    /// Messages outside the range (another phase's stragglers).
    pub(super) stray: usize,
    /// First arrival of every id, whatever its range, recorded only in the latency phase.
    pub(super) arrivals: Option<HashMap<i64, SystemTime>>,
    /// The steady phases' commits and deliveries.
    pub(super) join: Option<Join>,
}

impl Tally {
    pub(super) fn expect(&mut self, first: i64, count: usize, record_arrivals: bool) {
        *self =
            Tally { first, seen: vec![false; count], arrivals: record_arrivals.then(HashMap::new), ..Tally::default() };
    }

    pub(super) fn record(&mut self, id: i64) {
        let now = SystemTime::now();
        if let Some(arrivals) = &mut self.arrivals {
            arrivals.entry(id).or_insert(now);
        }
        if let Some(join) = &mut self.join {
            join.arrived(id, now);
        }
        let Some(slot) = usize::try_from(id - self.first).ok().and_then(|i| self.seen.get_mut(i)) else {
            self.stray += 1;
            return;
        };
        if std::mem::replace(slot, true) {
            self.duplicates += 1;
        } else {
            self.distinct += 1;
        }
    }
}

pub(super) fn tally_of(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    tally.lock().unwrap_or_else(|e| e.into_inner())
}
