//! Counters the supervisor reports.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters, shared by the dispatcher's actors.
        #[derive(Debug, Default)]
        pub(crate) struct Metrics {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// A copy of the dispatcher's counters since it started (and of its gauges now).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
        #[non_exhaustive]
        pub struct MetricsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Metrics {
            pub(crate) fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot { $($name: self.$name.load(Relaxed),)* }
            }
        }
    };
}

counters! {
    /// Rows leased by claims.
    claimed,
    /// Publishes the sink acknowledged.
    published,
    /// Rows finalized `done`.
    done,
    /// Rows put back to pending after a retryable failure.
    retried,
    /// Rows put back to pending by a deferral.
    deferred,
    /// Rows put back to pending, attempt refunded, because the sink was unavailable (an
    /// outage costs no attempt).
    released,
    /// Rows finalized `dead` (retries exhausted, permanent failure, or deferred too long).
    dead,
    /// Rows the claim's reaper sent dead (lease expired with no attempt left).
    reaped,
    /// Fenced writes that found the row taken over (or already finalized).
    lost_leases,
    /// Publishes that panicked; their rows wait for lease expiry.
    publish_crashes,
    /// Actors the supervisor restarted after they died.
    restarts,
    /// Claims that failed on the database.
    claim_errors,
    /// Finalize flushes that failed on the database after every retry.
    finalize_errors,
    /// Finalize statements retried after a transient database failure.
    finalize_retries,
    /// Times claiming paused because the sink became unavailable.
    sink_outages,
    /// Payload bytes held claimed right now (a gauge: it goes down as publishes finish).
    in_flight_bytes,
}

impl Metrics {
    pub(crate) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Relaxed);
    }

    /// Lowers a gauge.
    pub(crate) fn sub(gauge: &AtomicU64, n: usize) {
        gauge.fetch_sub(n as u64, Relaxed);
    }
}
