//! The sink gate: whether the dispatcher may claim, given what it knows of the sink's health.
//!
//! ```text
//!            publish Unavailable, or sink state Down / Blocked
//!   Open ─────────────────────────────────────────────────────▶ Closed
//!    ▲                                                            │ sink state Up and the
//!    │ the probe got through (or found nothing to publish)        │ probe interval passed
//!    │                                                            ▼
//!    └──────────────────────────────────────────────────────── Probing (one worker claims one row)
//!                      probe Unavailable or timed out ──▶ Closed
//! ```
//!
//! While the gate is not open, no worker claims (a probe claims one row), and a publish actor
//! whose row was claimed before the gate closed hands the row back, attempt refunded, without
//! calling the sink. So an outage costs each row at most the refunded attempt it was claimed
//! with, whatever its length, and the sink sees one message per probe interval until it is back.
//! Every transition is logged once, with how long the sink was away.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::publisher::SinkState;

/// What the gate lets a claim actor do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claimable {
    /// Claim as usual.
    Yes,
    /// Claim nothing: the sink is away (a probe is the supervisor's to start).
    No,
}

/// What the supervisor must do after a check of the sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Nothing.
    Nothing,
    /// The gate opened: wake every worker.
    WakeAll,
    /// The gate is probing: have one worker claim one row.
    Probe,
    /// The gate closed on the sink's own word (count an outage).
    Paused,
}

#[derive(Debug)]
enum Mode {
    Open,
    Closed { reason: String, next_probe: Instant },
    Probing { started: Instant },
}

#[derive(Debug)]
struct Inner {
    mode: Mode,
    /// When the sink went away (first close of this outage).
    away_since: Option<Instant>,
    /// The gate opened since the supervisor's last check.
    opened: bool,
    /// When the sink last said it was blocked.
    last_blocked: Option<Instant>,
}

/// Shared by the dispatcher's actors; every method is a short critical section.
#[derive(Debug)]
pub(crate) struct SinkGate {
    inner: Mutex<Inner>,
    probe_interval: Duration,
    /// A probe that has not reported within this long is counted as failed.
    probe_timeout: Duration,
}

impl SinkGate {
    pub(crate) fn new(probe_interval: Duration, publish_timeout: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner { mode: Mode::Open, away_since: None, opened: false, last_blocked: None }),
            probe_interval,
            probe_timeout: publish_timeout + Duration::from_secs(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether claims may run now.
    pub(crate) fn claimable(&self) -> Claimable {
        match self.lock().mode {
            Mode::Open => Claimable::Yes,
            Mode::Closed { .. } | Mode::Probing { .. } => Claimable::No,
        }
    }

    /// Whether a claimed row may be handed to the sink: not while the gate is closed (a probe's
    /// row, claimed while probing, may).
    pub(crate) fn may_publish(&self) -> bool {
        !matches!(self.lock().mode, Mode::Closed { .. })
    }

    /// Whether the sink said it was blocked within the last `d`: right after an unblock, the
    /// publishes it held are still being confirmed, and timing them out would send them again.
    pub(crate) fn blocked_within(&self, d: Duration) -> bool {
        self.lock().last_blocked.is_some_and(|t| t.elapsed() < d)
    }

    /// A publish found the sink unavailable (or the probe failed): close the gate. Returns
    /// whether this began an outage (the gate was open).
    pub(crate) fn unavailable(&self, reason: &str) -> bool {
        let mut inner = self.lock();
        let next_probe = Instant::now() + self.probe_interval;
        match &mut inner.mode {
            Mode::Open => {
                warn!(
                    reason,
                    "sink unavailable: claiming paused; rows claimed but not sent go back with their attempt refunded"
                );
                inner.away_since = Some(Instant::now());
                inner.mode = Mode::Closed { reason: reason.to_owned(), next_probe };
                true
            }
            Mode::Probing { .. } => {
                tracing::debug!(reason, "probe failed; the sink is still unavailable");
                inner.mode = Mode::Closed { reason: reason.to_owned(), next_probe };
                false
            }
            // Already closed: the publishes in flight when it closed report one by one.
            Mode::Closed { .. } => false,
        }
    }

    /// The probe's claim could not run (the database failed): probe again at the next chance.
    pub(crate) fn probe_aborted(&self) {
        let mut inner = self.lock();
        if matches!(inner.mode, Mode::Probing { .. }) {
            inner.mode = Mode::Closed { reason: "the probe could not claim".into(), next_probe: Instant::now() };
        }
    }

    /// A publish got through (or a probe found nothing to publish): open the gate.
    pub(crate) fn delivered(&self) {
        let mut inner = self.lock();
        if matches!(inner.mode, Mode::Open) {
            return;
        }
        let away = inner.away_since.take().map(|t| t.elapsed()).unwrap_or_default();
        info!(away = %humantime::format_duration(round(away)), "sink is back: claiming resumes at full speed");
        inner.mode = Mode::Open;
        inner.opened = true;
    }

    /// The supervisor's periodic look at the sink's own state.
    pub(crate) fn check(&self, state: &SinkState) -> Check {
        let mut inner = self.lock();
        if let SinkState::Blocked(_) = state {
            inner.last_blocked = Some(Instant::now());
        }
        if std::mem::take(&mut inner.opened) {
            return Check::WakeAll;
        }
        let now = Instant::now();
        match (&inner.mode, state) {
            (Mode::Open, SinkState::Up) => Check::Nothing,
            (Mode::Open, SinkState::Blocked(_) | SinkState::Down(_)) => {
                warn!(sink = %state, "claiming paused until the sink is back");
                inner.away_since = Some(now);
                inner.mode = Mode::Closed { reason: state.to_string(), next_probe: now };
                Check::Paused
            }
            (Mode::Closed { next_probe, .. }, SinkState::Up) if now >= *next_probe => {
                inner.mode = Mode::Probing { started: now };
                Check::Probe
            }
            (Mode::Closed { reason, next_probe }, SinkState::Blocked(_) | SinkState::Down(_)) => {
                if *reason != state.to_string() {
                    info!(sink = %state, "sink state changed while claiming is paused");
                    let next_probe = *next_probe;
                    inner.mode = Mode::Closed { reason: state.to_string(), next_probe };
                }
                Check::Nothing
            }
            (Mode::Probing { started }, _) if started.elapsed() > self.probe_timeout => {
                inner.mode = Mode::Closed { reason: "the probe did not report".into(), next_probe: now };
                Check::Nothing
            }
            _ => Check::Nothing,
        }
    }
}

fn round(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}
