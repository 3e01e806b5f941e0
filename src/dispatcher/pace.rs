//! The pace: the dispatcher's cap on messages a second ([`DispatcherConfig::max_rate`]), a
//! token bucket that every worker claims from, slowed by itself when the broker pushes back.
//!
//! Tokens are taken at the claim, one per row, so a paced claim takes at most what the bucket
//! holds: the rows' leases start when they are claimed, and nothing waits for a token while
//! holding a lease. The bucket holds a tenth of a second of the rate (at least one row, at most
//! a batch), so a worker claims small batches often rather than a whole batch in a burst, and
//! an idle dispatcher saves up no more than that. Rows a claim asked for and did not get (a
//! short claim, a cut by the byte budget, a failed claim) go back into the bucket.
//!
//! Pushback: every sink answer is counted in one-second windows. A window in which at least
//! one publish in a hundred failed retryably or found the sink unavailable (a broker's nack,
//! as for a queue over its `x-max-length` with `reject-publish`; a timeout; a lost link), or at
//! least one confirm in ten took longer than [`SLOW_CONFIRM`] (a broker that blocked its
//! connections holds publishes until it unblocks), halves the pace, down to a hundredth of the
//! cap. Each calm window after that gives back a tenth of the cap, so the pace is back at the
//! cap ten calm seconds after its lowest point: additive increase, multiplicative decrease, as
//! TCP does it. Without a cap the dispatcher is not paced at all; the broker's pushback then
//! reaches each row as its own retry backoff.
//!
//! The cap is the process's, changed while it runs with
//! [`SetMaxRate`](crate::dispatcher::SetMaxRate). A fleet of dispatchers shares a cap by
//! dividing it: each process gets its share (`--max-rate` = the fleet's cap / processes).
//! A bucket in the database that every claim draws from would make every claim of the fleet
//! update one row first, serializing the fleet's claims on that row's lock.
//!
//! [`DispatcherConfig::max_rate`]: crate::DispatcherConfig::max_rate

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::{info, warn};

/// A confirm slower than this counts as pushback.
pub(crate) const SLOW_CONFIRM: Duration = Duration::from_secs(1);
/// The span of sink answers judged together.
const WINDOW: Duration = Duration::from_secs(1);
/// What the bucket holds, in time at the current pace.
const BURST: Duration = Duration::from_millis(100);
/// Pushback never paces below this share of the cap.
const FLOOR_SHARE: f64 = 0.01;
/// Each calm window gives back this share of the cap.
const RECOVER_SHARE: f64 = 0.1;

/// How a sink call ended, for the pushback count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Taken (or refused for the message's own sake: permanent, deferred).
    Taken,
    /// Not taken for the sink's sake: a nack, a timeout, an unavailable sink.
    PushedBack,
}

/// The dispatcher's pace, shared by its workers.
#[derive(Debug)]
pub(crate) struct Pace {
    /// A cap is set: the fast path of an unpaced dispatcher reads only this.
    on: AtomicBool,
    bucket: Mutex<Bucket>,
}

/// What [`GetPace`](crate::dispatcher::GetPace) answers: the cap and the pace it is at now.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct PaceReport {
    /// Messages a second at most, as configured or last set; `None`: not paced.
    pub max_rate: Option<f64>,
    /// The pace now: the cap, or less while the broker pushes back; `None`: not paced.
    pub rate: Option<f64>,
}

impl PaceReport {
    /// Whether pushback holds the pace below the cap.
    pub fn is_pushed_back(&self) -> bool {
        matches!((self.max_rate, self.rate), (Some(cap), Some(rate)) if rate < cap)
    }
}

#[derive(Debug)]
struct Bucket {
    cap: Option<f64>,
    /// The pace now, at most the cap.
    rate: f64,
    tokens: f64,
    refilled: Instant,
    /// The largest claim.
    batch: usize,
    window: Window,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    answers: u32,
    pushed_back: u32,
    slow: u32,
}

impl Window {
    fn new(now: Instant) -> Self {
        Self { started: now, answers: 0, pushed_back: 0, slow: 0 }
    }

    fn is_pushback(&self) -> bool {
        (self.pushed_back > 0 && self.pushed_back * 100 >= self.answers)
            || (self.slow > 0 && self.slow * 10 >= self.answers)
    }
}

impl Pace {
    pub(crate) fn new(cap: Option<f64>, batch: usize) -> Self {
        let now = Instant::now();
        let mut bucket =
            Bucket { cap: None, rate: 0.0, tokens: 0.0, refilled: now, batch: batch.max(1), window: Window::new(now) };
        bucket.set_cap(cap);
        Self { on: AtomicBool::new(cap.is_some()), bucket: Mutex::new(bucket) }
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.bucket.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Rows a claim of up to `want` may take now, or how long to wait before asking again.
    pub(crate) fn take(&self, want: usize) -> Result<usize, Duration> {
        if !self.on.load(Ordering::Relaxed) || want == 0 {
            return Ok(want);
        }
        let mut bucket = self.bucket();
        let now = Instant::now();
        bucket.roll(now);
        let Some(_) = bucket.cap else { return Ok(want) };
        let need = want.min(bucket.burst() as usize).max(1);
        if bucket.tokens >= need as f64 {
            bucket.tokens -= need as f64;
            Ok(need)
        } else {
            Err(Duration::from_secs_f64((need as f64 - bucket.tokens) / bucket.rate).max(Duration::from_millis(1)))
        }
    }

    /// Gives back rows taken and not claimed.
    pub(crate) fn refund(&self, rows: usize) {
        if rows == 0 || !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut bucket = self.bucket();
        let burst = bucket.burst();
        bucket.tokens = (bucket.tokens + rows as f64).min(burst);
    }

    /// Counts a sink answer, which took `took`.
    pub(crate) fn answered(&self, answer: Answer, took: Duration) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut bucket = self.bucket();
        bucket.roll(Instant::now());
        let window = &mut bucket.window;
        window.answers += 1;
        window.pushed_back += u32::from(answer == Answer::PushedBack);
        window.slow += u32::from(took > SLOW_CONFIRM);
    }

    /// Sets the cap (`None`: no pacing), starting at it.
    pub(crate) fn set_cap(&self, cap: Option<f64>) {
        self.bucket().set_cap(cap);
        self.on.store(cap.is_some(), Ordering::Relaxed);
    }

    pub(crate) fn report(&self) -> PaceReport {
        let mut bucket = self.bucket();
        bucket.roll(Instant::now());
        PaceReport { max_rate: bucket.cap, rate: bucket.cap.map(|_| bucket.rate) }
    }
}

impl Bucket {
    fn burst(&self) -> f64 {
        (self.rate * BURST.as_secs_f64()).floor().clamp(1.0, self.batch as f64)
    }

    fn set_cap(&mut self, cap: Option<f64>) {
        let now = Instant::now();
        self.cap = cap;
        self.rate = cap.unwrap_or(0.0);
        self.tokens = if cap.is_some() { self.burst() } else { 0.0 };
        self.refilled = now;
        self.window = Window::new(now);
    }

    /// Refills the bucket up to `now`, and judges the window once it is over.
    fn roll(&mut self, now: Instant) {
        let Some(cap) = self.cap else { return };
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst());
        if now.saturating_duration_since(self.window.started) < WINDOW {
            return;
        }
        let window = std::mem::replace(&mut self.window, Window::new(now));
        let floor = (cap * FLOOR_SHARE).max(f64::MIN_POSITIVE).min(cap);
        if window.is_pushback() {
            let rate = (self.rate / 2.0).max(floor);
            if rate < self.rate {
                warn!(
                    answers = window.answers,
                    pushed_back = window.pushed_back,
                    slow = window.slow,
                    rate = format_args!("{rate:.1}"),
                    max_rate = cap,
                    "the broker is pushing back: pacing at half the last rate"
                );
            }
            self.rate = rate;
        } else if self.rate < cap {
            self.rate = (self.rate + cap * RECOVER_SHARE).min(cap);
            if self.rate >= cap {
                info!(max_rate = cap, "no more pushback: pacing at the cap again");
            }
        }
        self.tokens = self.tokens.min(self.burst());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpaced_takes_what_it_asks() {
        let pace = Pace::new(None, 200);
        assert_eq!(pace.take(200), Ok(200));
        pace.answered(Answer::PushedBack, Duration::from_secs(5));
        assert_eq!(pace.report(), PaceReport { max_rate: None, rate: None });
    }

    #[test]
    fn a_claim_takes_a_tenth_of_a_second_of_the_rate_then_waits() {
        let pace = Pace::new(Some(1000.0), 200);
        assert_eq!(pace.take(200), Ok(100));
        let wait = pace.take(200).unwrap_err();
        assert!(wait > Duration::from_millis(50) && wait <= Duration::from_millis(100), "{wait:?}");
        pace.refund(40);
        assert_eq!(pace.take(40), Ok(40));
        // Never more than a batch, never less than a row.
        assert_eq!(Pace::new(Some(1e6), 200).take(500), Ok(200));
        assert_eq!(Pace::new(Some(0.5), 200).take(200), Ok(1));
    }

    #[test]
    fn pushback_halves_the_pace_and_calm_windows_give_a_tenth_back() {
        let pace = Pace::new(Some(1000.0), 200);
        let mut bucket = pace.bucket();
        let start = bucket.window.started;
        // 2 pushed back of 150: over 1 in 100.
        bucket.window.answers = 150;
        bucket.window.pushed_back = 2;
        bucket.roll(start + WINDOW);
        assert_eq!(bucket.rate, 500.0);
        // 1 in 200 is not pushback: the pace recovers by a tenth of the cap.
        bucket.window.answers = 200;
        bucket.window.pushed_back = 1;
        bucket.roll(start + 2 * WINDOW);
        assert_eq!(bucket.rate, 600.0);
        // Slow confirms: 1 in 10 is pushback.
        bucket.window.answers = 10;
        bucket.window.slow = 1;
        bucket.roll(start + 3 * WINDOW);
        assert_eq!(bucket.rate, 300.0);
        for (n, expected) in
            [(4, 400.0), (5, 500.0), (6, 600.0), (7, 700.0), (8, 800.0), (9, 900.0), (10, 1000.0), (11, 1000.0)]
        {
            bucket.roll(start + n * WINDOW);
            assert_eq!(bucket.rate, expected, "window {n}");
        }
        // Never below a hundredth of the cap.
        for n in 12..30 {
            bucket.window.answers = 1;
            bucket.window.pushed_back = 1;
            bucket.roll(start + n * WINDOW);
        }
        assert_eq!(bucket.rate, 10.0);
    }

    #[test]
    fn setting_the_cap_starts_at_it() {
        let pace = Pace::new(Some(1000.0), 200);
        pace.set_cap(Some(50.0));
        assert_eq!(pace.report(), PaceReport { max_rate: Some(50.0), rate: Some(50.0) });
        assert_eq!(pace.take(200), Ok(5));
        pace.set_cap(None);
        assert_eq!(pace.take(200), Ok(200));
    }
}
