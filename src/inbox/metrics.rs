//! The consumer's counters, shared by the supervisor and every consumer actor it starts, so
//! that they survive a restart.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A consistent-enough copy of an inbox consumer's counters (each read atomically, not all at
/// one instant). Counts are since the supervisor started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxMetrics {
    /// Deliveries received from the broker (copies included).
    pub received: u64,
    /// Messages whose handler committed (late ones under `LateEvents::Flag` included).
    pub handled: u64,
    /// Copies of messages already recorded: acknowledged without calling the handler.
    pub duplicates: u64,
    /// Late messages recorded and skipped (ordered consumers, `LateEvents::Skip`).
    pub late_skipped: u64,
    /// Late messages handed to the handler flagged (ordered consumers, `LateEvents::Flag`).
    pub late_flagged: u64,
    /// Failed attempts republished for a later attempt.
    pub retried: u64,
    /// Messages dead-lettered (permanent failures, exhausted retries, unusable messages).
    pub dead_lettered: u64,
    /// Of those, messages without a usable message id.
    pub unusable: u64,
    /// Handler calls that panicked (rolled back, then retried like a retryable failure).
    pub panics: u64,
    /// Attempts that failed because the database did not answer (each held and tried again).
    pub outage_waits: u64,
    /// Deliveries given back to the broker unhandled (`nack` with requeue) at shutdown.
    pub requeued: u64,
    /// Connections to the broker established after the first.
    pub reconnects: u64,
    /// Consumer actors the supervisor replaced after they died.
    pub restarts: u64,
    /// Whether the consumer has a live channel and consumes from it right now.
    pub connected: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) received: AtomicU64,
    pub(crate) handled: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) late_skipped: AtomicU64,
    pub(crate) late_flagged: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) unusable: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) outage_waits: AtomicU64,
    pub(crate) requeued: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) restarts: AtomicU64,
    pub(crate) connected: AtomicBool,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> InboxMetrics {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        InboxMetrics {
            received: get(&self.received),
            handled: get(&self.handled),
            duplicates: get(&self.duplicates),
            late_skipped: get(&self.late_skipped),
            late_flagged: get(&self.late_flagged),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            unusable: get(&self.unusable),
            panics: get(&self.panics),
            outage_waits: get(&self.outage_waits),
            requeued: get(&self.requeued),
            reconnects: get(&self.reconnects),
            restarts: get(&self.restarts),
            connected: self.connected.load(Ordering::Relaxed),
        }
    }
}
