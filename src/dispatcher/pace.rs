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
//! one publish in a hundred failed retryably or found the sink unavailable (a timeout; a lost
//! link), or was refused (a broker's nack, as for a queue over its `x-max-length` with
//! `reject-publish`: [`PublishError::Refused`](crate::PublishError::Refused)), or at least one
//! confirm in ten took longer than [`SLOW_CONFIRM`] (a broker that blocked its connections holds
//! publishes until it unblocks), halves the pace, down to a hundredth of the cap. Each calm
//! window after that gives back a tenth of the cap, so the pace is back at the cap ten calm
//! seconds after its lowest point: additive increase, multiplicative decrease, as TCP does it.
//!
//! Without a cap the dispatcher is not paced, except while the sink refuses messages: a window
//! in which one publish in a hundred was refused starts a pushback episode, paced at half the
//! rate the sink took messages at in that window (at least [`UNCAPPED_FLOOR`] a second), halved
//! again by every window of refusals down to that floor; the first window in which the sink took
//! messages and refused none ends it, and the dispatcher is unpaced again (within a second or
//! two of the sink taking messages again). Timeouts, an unavailable sink and slow confirms do
//! not pace an uncapped dispatcher: the sink gate pauses claiming for the first two, and the
//! window of rows in flight (`window`) follows the sink's answer times. Refused rows go back to
//! pending with their attempt refunded, so an episode of any length costs no row an attempt.
//!
//! An episode of refusals is logged once when it starts (WARN, with the pace) and once when it
//! ends (INFO, with how long it lasted and how many publishes were refused), whatever its
//! length; `outbox_publish_refused_total` counts the refusals and `outbox_pace_rate` shows the
//! pace.
//!
//! The cap is the process's, changed while it runs with
//! [`SetMaxRate`](crate::dispatcher::SetMaxRate). A fleet of dispatchers shares a cap by
//! dividing it: each process gets its share (`--max-rate` = the fleet's cap / processes).
//! A bucket in the database that every claim draws from would make every claim of the fleet
//! update one row first, serializing the fleet's claims on that row's lock.
//!
//! [`DispatcherConfig::max_rate`]: crate::DispatcherConfig::max_rate

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

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
/// Without a cap, refusals never pace below this many messages a second: a trickle that finds
/// out soon when the sink takes messages again.
pub(crate) const UNCAPPED_FLOOR: f64 = 10.0;

/// How a sink call ended, for the pushback count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Taken (or refused for the message's own sake: permanent, deferred).
    Taken,
    /// Not taken for the sink's sake: a timeout, an unavailable sink.
    PushedBack,
    /// Refused by the sink for now: a nack.
    Refused,
}

/// The dispatcher's pace, shared by its workers.
#[derive(Debug)]
pub(crate) struct Pace {
    /// Claims are paced (a cap is set, or the sink refuses messages): the fast path of an
    /// unpaced dispatcher reads only this.
    on: AtomicBool,
    /// Sink answers so far, of every kind: counted without the lock, so that an answer taken
    /// in time costs an atomic add.
    answers: AtomicU64,
    bucket: Mutex<Bucket>,
}

/// What [`GetPace`](crate::dispatcher::GetPace) answers: the cap and the pace it is at now.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct PaceReport {
    /// Messages a second at most, as configured or last set; `None`: not capped.
    pub max_rate: Option<f64>,
    /// The pace now: the cap, or less while the broker pushes back; without a cap, the pace a
    /// broker that refuses messages (nacks) holds the dispatcher to while it does. `None`: not
    /// paced.
    pub rate: Option<f64>,
}

impl PaceReport {
    /// Whether pushback holds the pace below the cap, or paces a dispatcher that has none.
    pub fn is_pushed_back(&self) -> bool {
        match (self.max_rate, self.rate) {
            (Some(cap), Some(rate)) => rate < cap,
            (None, Some(_)) => true,
            (_, None) => false,
        }
    }
}

#[derive(Debug)]
struct Bucket {
    cap: Option<f64>,
    /// The pace now: at most the cap; without one, meaningful during an episode only.
    rate: f64,
    tokens: f64,
    refilled: Instant,
    /// The largest claim.
    batch: usize,
    window: Window,
    /// The sink has been refusing messages since then, and refused this many so far.
    episode: Option<(Instant, u64)>,
    /// A capped pace has been pushed back since then (its first halving is logged).
    pushed_since: Option<Instant>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    /// [`Pace::answers`] when the window started.
    answers_before: u64,
    pushed_back: u32,
    refused: u32,
    slow: u32,
}

/// What a window of sink answers said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// No answer at all: nothing to judge.
    Silent,
    /// At least one in a hundred refused.
    Refusing,
    /// Pushed back otherwise (timeouts, an unavailable sink, slow confirms).
    PushingBack,
    /// Calm.
    Calm,
}

impl Window {
    fn new(now: Instant, answers_before: u64) -> Self {
        Self { started: now, answers_before, pushed_back: 0, refused: 0, slow: 0 }
    }

    fn judge(&self, answers: u64) -> Verdict {
        let answers = answers.saturating_sub(self.answers_before).max(u64::from(self.refused));
        let share = |n: u32| n > 0 && u64::from(n) * 100 >= answers;
        if answers == 0 {
            Verdict::Silent
        } else if share(self.refused) {
            Verdict::Refusing
        } else if share(self.pushed_back) || (self.slow > 0 && u64::from(self.slow) * 10 >= answers) {
            Verdict::PushingBack
        } else {
            Verdict::Calm
        }
    }
}

impl Pace {
    pub(crate) fn new(cap: Option<f64>, batch: usize) -> Self {
        let now = Instant::now();
        let mut bucket = Bucket {
            cap: None,
            rate: 0.0,
            tokens: 0.0,
            refilled: now,
            batch: batch.max(1),
            window: Window::new(now, 0),
            episode: None,
            pushed_since: None,
        };
        bucket.set_cap(cap, 0);
        Self { on: AtomicBool::new(cap.is_some()), answers: AtomicU64::new(0), bucket: Mutex::new(bucket) }
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.bucket.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Rolls the bucket up to now (judging a window that is over), and says whether claims are
    /// paced.
    fn roll(&self, bucket: &mut Bucket) {
        bucket.roll(Instant::now(), self.answers.load(Ordering::Relaxed));
        self.on.store(bucket.paced(), Ordering::Relaxed);
    }

    /// Rows a claim of up to `want` may take now, or how long to wait before asking again.
    pub(crate) fn take(&self, want: usize) -> Result<usize, Duration> {
        if !self.on.load(Ordering::Relaxed) || want == 0 {
            return Ok(want);
        }
        let mut bucket = self.bucket();
        self.roll(&mut bucket);
        if !bucket.paced() {
            return Ok(want);
        }
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
        self.answers.fetch_add(1, Ordering::Relaxed);
        let slow = took > SLOW_CONFIRM;
        if answer == Answer::Taken && !slow {
            return;
        }
        let mut bucket = self.bucket();
        self.roll(&mut bucket);
        let window = &mut bucket.window;
        window.pushed_back += u32::from(answer == Answer::PushedBack);
        window.refused += u32::from(answer == Answer::Refused);
        window.slow += u32::from(slow);
        if answer == Answer::Refused
            && let Some((_, refused)) = &mut bucket.episode
        {
            *refused += 1;
        }
    }

    /// Sets the cap (`None`: no cap), starting at it.
    pub(crate) fn set_cap(&self, cap: Option<f64>) {
        let mut bucket = self.bucket();
        bucket.set_cap(cap, self.answers.load(Ordering::Relaxed));
        self.on.store(bucket.paced(), Ordering::Relaxed);
    }

    pub(crate) fn report(&self) -> PaceReport {
        let mut bucket = self.bucket();
        self.roll(&mut bucket);
        PaceReport { max_rate: bucket.cap, rate: bucket.paced().then_some(bucket.rate) }
    }
}

impl Bucket {
    fn burst(&self) -> f64 {
        (self.rate * BURST.as_secs_f64()).floor().clamp(1.0, self.batch as f64)
    }

    /// Whether claims take tokens: under a cap, or while the sink refuses messages.
    fn paced(&self) -> bool {
        self.cap.is_some() || self.episode.is_some()
    }

    fn set_cap(&mut self, cap: Option<f64>, answers: u64) {
        let now = Instant::now();
        self.cap = cap;
        self.rate = cap.unwrap_or(0.0);
        self.episode = None;
        self.pushed_since = None;
        self.tokens = if cap.is_some() { self.burst() } else { 0.0 };
        self.refilled = now;
        self.window = Window::new(now, answers);
    }

    /// Refills the bucket up to `now`, and judges the window once it is over (`answers`: the
    /// sink's answers so far).
    fn roll(&mut self, now: Instant, answers: u64) {
        if self.paced() {
            let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.rate).min(self.burst());
        }
        self.refilled = now;
        if now.saturating_duration_since(self.window.started) < WINDOW {
            return;
        }
        let window = std::mem::replace(&mut self.window, Window::new(now, answers));
        let answered = answers.saturating_sub(window.answers_before);
        let verdict = window.judge(answers);
        match verdict {
            Verdict::Refusing => self.refusing(now, &window, answered),
            Verdict::Calm => self.end_episode(now),
            Verdict::PushingBack | Verdict::Silent => {}
        }
        if let Some(cap) = self.cap {
            let floor = (cap * FLOOR_SHARE).max(f64::MIN_POSITIVE).min(cap);
            match verdict {
                Verdict::Refusing | Verdict::PushingBack => {
                    let rate = (self.rate / 2.0).max(floor);
                    if rate < self.rate && self.pushed_since.is_none() && self.episode.is_none() {
                        warn!(
                            answers = answered,
                            pushed_back = window.pushed_back,
                            slow = window.slow,
                            rate = format_args!("{rate:.1}"),
                            max_rate = cap,
                            "the broker is pushing back: pacing at half the last rate, and halving it every second \
                             it goes on"
                        );
                    } else if rate < self.rate {
                        debug!(rate = format_args!("{rate:.1}"), max_rate = cap, "still pushed back: pace halved");
                    }
                    self.pushed_since.get_or_insert(now);
                    self.rate = rate;
                }
                // A window without pushback gives back a tenth of the cap, answers or not.
                Verdict::Calm | Verdict::Silent if self.rate < cap => {
                    self.rate = (self.rate + cap * RECOVER_SHARE).min(cap);
                    if self.rate >= cap {
                        self.pushed_since = None;
                        info!(max_rate = cap, "no more pushback: pacing at the cap again");
                    }
                }
                Verdict::Calm | Verdict::Silent => {}
            }
        }
        self.tokens = self.tokens.min(self.burst());
    }

    /// A window of refusals: starts an episode (logged once), and without a cap paces at half
    /// what the sink took (then halves it per window, down to the floor).
    fn refusing(&mut self, now: Instant, window: &Window, answered: u64) {
        let taken = answered.saturating_sub(u64::from(window.refused) + u64::from(window.pushed_back));
        if self.cap.is_none() {
            self.rate = match self.episode {
                None => (taken as f64 / WINDOW.as_secs_f64() / 2.0).max(UNCAPPED_FLOOR),
                Some(_) => (self.rate / 2.0).max(UNCAPPED_FLOOR),
            };
        }
        if self.episode.is_none() {
            self.episode = Some((now, u64::from(window.refused)));
            // The rate the warning gives: a capped pace is halved right after this.
            let rate = if self.cap.is_some() { (self.rate / 2.0).max(f64::MIN_POSITIVE) } else { self.rate };
            if self.cap.is_none() {
                self.tokens = self.burst();
            }
            warn!(
                refused = window.refused,
                answers = answered,
                rate = format_args!("{rate:.1}"),
                max_rate = self.cap,
                "the broker refuses messages (nacks: a queue at its length limit with overflow=reject-publish?): \
                 the refused rows go back to pending with their attempt refunded, and claims slow down until it \
                 takes messages again"
            );
        }
    }

    /// A calm window with answers: the sink takes messages; an episode of refusals is over.
    fn end_episode(&mut self, now: Instant) {
        let Some((since, refused)) = self.episode.take() else { return };
        let lasted = Duration::from_millis(now.saturating_duration_since(since).as_millis() as u64);
        info!(lasted = %humantime::format_duration(lasted), refused,
            "the broker takes messages again: no more refusals; claims speed up");
        if self.cap.is_none() {
            self.rate = 0.0;
            self.tokens = 0.0;
        }
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

    /// Rolls `bucket` to the end of window `n` (from `start`), `answers` of them in that window.
    fn window(bucket: &mut Bucket, start: Instant, n: u32, answers: u64) {
        let before = bucket.window.answers_before;
        bucket.roll(start + n * WINDOW, before + answers);
    }

    #[test]
    fn pushback_halves_the_pace_and_calm_windows_give_a_tenth_back() {
        let pace = Pace::new(Some(1000.0), 200);
        let mut bucket = pace.bucket();
        let start = bucket.window.started;
        // 2 pushed back of 150: over 1 in 100.
        bucket.window.pushed_back = 2;
        window(&mut bucket, start, 1, 150);
        assert_eq!(bucket.rate, 500.0);
        // 1 in 200 is not pushback: the pace recovers by a tenth of the cap.
        bucket.window.pushed_back = 1;
        window(&mut bucket, start, 2, 200);
        assert_eq!(bucket.rate, 600.0);
        // Slow confirms: 1 in 10 is pushback.
        bucket.window.slow = 1;
        window(&mut bucket, start, 3, 10);
        assert_eq!(bucket.rate, 300.0);
        for (n, expected) in
            [(4, 400.0), (5, 500.0), (6, 600.0), (7, 700.0), (8, 800.0), (9, 900.0), (10, 1000.0), (11, 1000.0)]
        {
            window(&mut bucket, start, n, 0);
            assert_eq!(bucket.rate, expected, "window {n}");
        }
        // Never below a hundredth of the cap.
        for n in 12..30 {
            bucket.window.pushed_back = 1;
            window(&mut bucket, start, n, 1);
        }
        assert_eq!(bucket.rate, 10.0);
        assert!(bucket.episode.is_none(), "timeouts are no episode of refusals");
    }

    /// Without a cap, refusals pace the claims at half what the sink took, halving per window
    /// of refusals down to the floor; the first window that takes messages without a refusal
    /// ends the episode, and the dispatcher is unpaced again. Timeouts do not pace it.
    #[test]
    fn without_a_cap_refusals_pace_until_the_sink_takes_messages_again() {
        let pace = Pace::new(None, 200);
        let mut bucket = pace.bucket();
        let start = bucket.window.started;
        bucket.window.pushed_back = 50;
        window(&mut bucket, start, 1, 100);
        assert!(!bucket.paced(), "timeouts do not pace an uncapped dispatcher");
        // 1,000 taken and 200 refused in a second: paced at 500 a second.
        bucket.window.refused = 200;
        window(&mut bucket, start, 2, 1200);
        assert!(bucket.paced());
        assert_eq!(bucket.rate, 500.0);
        assert_eq!(bucket.episode.map(|(_, n)| n), Some(200));
        for (n, expected) in [(3, 250.0), (4, 125.0), (5, 62.5), (6, 31.25), (7, 15.625), (8, 10.0), (9, 10.0)] {
            bucket.window.refused = 10;
            window(&mut bucket, start, n, 10);
            assert_eq!(bucket.rate, expected, "window {n}");
        }
        // A window without answers says nothing: still paced.
        window(&mut bucket, start, 10, 0);
        assert!(bucket.paced());
        // Taken again: unpaced at once.
        window(&mut bucket, start, 11, 10);
        assert!(!bucket.paced());
        drop(bucket);
        assert_eq!(pace.report(), PaceReport { max_rate: None, rate: None });
        assert_eq!(pace.take(200), Ok(200));
    }

    /// A refusal takes the lock and is counted; an answer taken in time only counts.
    #[test]
    fn refusals_reach_the_window_and_start_an_episode() {
        let pace = Pace::new(None, 200);
        for _ in 0..3 {
            pace.answered(Answer::Taken, Duration::ZERO);
        }
        pace.answered(Answer::Refused, Duration::ZERO);
        let bucket = pace.bucket();
        assert_eq!((bucket.window.refused, pace.answers.load(Ordering::Relaxed)), (1, 4));
        assert_eq!(bucket.window.judge(4), Verdict::Refusing);
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
