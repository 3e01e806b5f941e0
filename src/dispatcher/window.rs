//! The window: how many claimed rows the dispatcher keeps in flight at once, all its workers
//! together, found from how long the sink takes to answer.
//!
//! A dispatcher alone in its actix system (one outbox a process) keeps every worker's window,
//! `workers × max_in_flight`: in front of RabbitMQ, the deeper the pipeline, the larger the
//! batches the broker writes and confirms, and the higher the throughput. Beside other
//! dispatchers of the same system (the outboxes of one relay: `run --outbox a --outbox b`),
//! those rows hurt: a RabbitMQ queue takes one message after another, so every row one outbox
//! keeps in flight is one that another outbox's single message waits behind (a 200,000-row
//! drain held another outbox's rows up to 170 ms). There the window is found by delay, as TCP
//! Vegas finds its congestion window, kept where the sink's answers do not queue, while a sink
//! that answers slowly but in parallel (an HTTP endpoint) still gets every worker's window:
//!
//! - It stays between one worker's window (`max_in_flight`, `2 × batch` by default: a claim
//!   overlapping the publishing of the last) and all the workers', and starts at the floor.
//! - Every answer of the sink is a sample of the time the publish took. The least sample of the
//!   last 10 to 20 seconds is the sink's own time (`base`); what a round of answers (from one
//!   answer to the first [`ROUND`] after it) takes on average beyond it is time spent queueing.
//! - A round whose mean exceeds the base by more than [`QUEUE_TARGET`] or the base itself,
//!   whichever is more, shrinks the window by a quarter, down to the floor. A round within that,
//!   in which a claim waited for room, grows it: doubling until the first round over (a slow
//!   start), then a quarter of a batch a round.
//! - A claim reserves its batch before it runs and hands back what it did not get (a
//!   [`Reservation`]); each claimed message holds a [`Slot`] until its outcome is finalized.
//!   A claim fits when the window has room for its batch, or when nothing is in flight. A worker
//!   whose claim did not fit is woken when room opens.
//!
//! Against RabbitMQ on one host the window settles near its floor while a backlog drains: the
//! broker's queue is then about two batches deep, so a message published beside the drain
//! (another outbox's) waits behind about that.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use actix::Recipient;

use super::wake::Wake;

/// The span of answers judged together.
pub(crate) const ROUND: Duration = Duration::from_millis(100);
/// Queueing in front of the sink that the window tolerates (or the sink's own time, if more).
pub(crate) const QUEUE_TARGET: Duration = Duration::from_millis(10);
/// The sink's own time is the least sample of the last one or two of these spans.
const BASE_SPAN: Duration = Duration::from_secs(10);

/// Per actix system (by id; `usize::MAX` outside any), the dispatchers' windows alive in it.
static SYSTEMS: LazyLock<Mutex<HashMap<usize, Arc<AtomicUsize>>>> = LazyLock::new(Mutex::default);

/// The dispatcher's window, shared by its workers and their publishes.
#[derive(Debug)]
pub(crate) struct Window {
    state: Mutex<State>,
    /// The actix system it was made in, and how many windows that system has.
    system: usize,
    dispatchers: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct State {
    floor: usize,
    ceiling: usize,
    /// Rows in flight at most now.
    limit: usize,
    /// Rows reserved by running claims and held by publishes.
    used: usize,
    /// A claim's batch: room for one wakes the workers waiting.
    batch: usize,
    /// Per worker, how to wake it while its claim waits for room.
    waiting: Vec<Option<Recipient<Wake>>>,
    /// A claim waited for room in this round.
    wanted: bool,
    /// No round has been over yet: grow by doubling.
    slow_start: bool,
    round: Round,
    base: Base,
}

#[derive(Debug)]
struct Round {
    started: Instant,
    answers: u32,
    took: Duration,
}

/// The least publish time of the current span and of the one before it.
#[derive(Debug)]
struct Base {
    started: Instant,
    current: Duration,
    previous: Duration,
}

impl Base {
    fn get(&self) -> Duration {
        self.current.min(self.previous)
    }

    fn sample(&mut self, took: Duration, now: Instant) {
        if now.saturating_duration_since(self.started) >= BASE_SPAN {
            self.previous = self.current;
            self.current = Duration::MAX;
            self.started = now;
        }
        self.current = self.current.min(took);
    }
}

/// Rows a claim may take, reserved in the window until the claim is answered. Each row it got
/// becomes a [`Slot`]; what is left goes back when it is dropped (a claim that failed, or
/// whose actor died mid-claim).
#[derive(Debug)]
pub(crate) struct Reservation {
    window: Arc<Window>,
    rows: usize,
}

/// One claimed message's place in the window, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    window: Arc<Window>,
}

impl Window {
    /// A window for `workers` workers, each holding up to `per_worker` rows, claiming `batch`.
    pub(crate) fn new(workers: usize, per_worker: usize, batch: usize) -> Arc<Self> {
        let now = Instant::now();
        let floor = per_worker.max(1);
        let system = actix::System::try_current().map_or(usize::MAX, |system| system.id());
        let dispatchers = {
            let mut systems = systems();
            let dispatchers = systems.entry(system).or_default().clone();
            dispatchers.fetch_add(1, Ordering::Relaxed);
            dispatchers
        };
        Arc::new(Self {
            system,
            dispatchers,
            state: Mutex::new(State {
                floor,
                ceiling: floor.saturating_mul(workers.max(1)),
                limit: floor,
                used: 0,
                batch: batch.max(1),
                waiting: vec![None; workers.max(1)],
                wanted: false,
                slow_start: true,
                round: Round { started: now, answers: 0, took: Duration::ZERO },
                base: Base { started: now, current: Duration::MAX, previous: Duration::MAX },
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// No other dispatcher runs in this one's actix system.
    fn alone(&self) -> bool {
        self.dispatchers.load(Ordering::Relaxed) <= 1
    }

    /// Reserves `rows` for worker `worker`'s claim if they fit; if not, keeps `wake` to call
    /// that worker back when room opens.
    pub(crate) fn admit(
        self: &Arc<Self>,
        rows: usize,
        worker: usize,
        wake: impl FnOnce() -> Recipient<Wake>,
    ) -> Option<Reservation> {
        let alone = self.alone();
        let mut state = self.state();
        if state.used == 0 || state.used + rows <= state.limit(alone) {
            state.used += rows;
            return Some(Reservation { window: self.clone(), rows });
        }
        state.wanted = true;
        if let Some(waiting) = state.waiting.get_mut(worker) {
            *waiting = Some(wake());
        }
        None
    }

    /// Reserves `rows` whether they fit or not (a probe's row).
    pub(crate) fn reserve(self: &Arc<Self>, rows: usize) -> Reservation {
        self.state().used += rows;
        Reservation { window: self.clone(), rows }
    }

    /// Counts an answer of the sink that took `took`.
    pub(crate) fn answered(&self, took: Duration) {
        if self.alone() {
            return;
        }
        let mut state = self.state();
        let was = state.limit;
        state.answered(took, Instant::now());
        let woken = if state.limit > was { state.take_waiting(false) } else { Vec::new() };
        drop(state);
        wake(woken);
    }

    /// Rows in flight at most now.
    pub(crate) fn limit(&self) -> usize {
        let alone = self.alone();
        self.state().limit(alone)
    }

    fn release(&self, rows: usize) {
        let alone = self.alone();
        let mut state = self.state();
        state.used = state.used.saturating_sub(rows);
        let woken = state.take_waiting(alone);
        drop(state);
        wake(woken);
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // Under the lock, so that a window made meanwhile in the same system finds the count.
        let mut systems = systems();
        if self.dispatchers.fetch_sub(1, Ordering::Relaxed) == 1 {
            systems.remove(&self.system);
        }
    }
}

fn systems() -> MutexGuard<'static, HashMap<usize, Arc<AtomicUsize>>> {
    SYSTEMS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn wake(woken: Vec<Recipient<Wake>>) {
    for worker in woken {
        worker.do_send(Wake);
    }
}

impl State {
    /// Rows in flight at most now: every worker's window for a dispatcher `alone` in its system.
    fn limit(&self, alone: bool) -> usize {
        if alone { self.ceiling } else { self.limit }
    }

    /// The waiting workers, taken, once a batch fits.
    fn take_waiting(&mut self, alone: bool) -> Vec<Recipient<Wake>> {
        if self.used + self.batch > self.limit(alone) && self.used > 0 {
            return Vec::new();
        }
        self.waiting.iter_mut().filter_map(Option::take).collect()
    }

    fn answered(&mut self, took: Duration, now: Instant) {
        self.base.sample(took, now);
        if self.round.answers == 0 {
            // A round is a span of answers: it starts at its first.
            self.round.started = now;
        }
        self.round.answers += 1;
        self.round.took += took;
        if now.saturating_duration_since(self.round.started) < ROUND {
            return;
        }
        let mean = self.round.took / self.round.answers;
        let base = self.base.get();
        if mean > base + QUEUE_TARGET.max(base) {
            self.slow_start = false;
            self.limit = (self.limit - self.limit / 4).max(self.floor);
        } else if self.wanted {
            let grown = if self.slow_start { self.limit * 2 } else { self.limit + (self.batch / 4).max(1) };
            self.limit = grown.min(self.ceiling);
        }
        self.wanted = false;
        self.round = Round { started: now, answers: 0, took: Duration::ZERO };
    }
}

impl Reservation {
    /// Turns one reserved row into a claimed message's slot.
    pub(crate) fn slot(&mut self) -> Slot {
        debug_assert!(self.rows > 0, "more messages than the claim reserved");
        self.rows = self.rows.saturating_sub(1);
        Slot { window: self.window.clone() }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.rows > 0 {
            self.window.release(self.rows);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.window.release(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Feeds one round of `answers` answers each taking `took`, after a claim waited when
    /// `wanted`.
    fn round(state: &mut State, start: &mut Instant, answers: u32, took: Duration, wanted: bool) -> usize {
        state.wanted = wanted;
        for _ in 1..answers {
            state.answered(took, *start);
        }
        *start += ROUND;
        state.answered(took, *start);
        state.limit
    }

    fn window(workers: usize, per_worker: usize, batch: usize) -> (Arc<Window>, Instant) {
        let window = Window::new(workers, per_worker, batch);
        let start = window.state().round.started;
        (window, start)
    }

    #[test]
    fn starts_at_one_workers_window_and_doubles_while_answers_stay_quick() {
        let (window, mut start) = window(4, 400, 200);
        let mut state = window.state();
        assert_eq!((state.floor, state.limit, state.ceiling), (400, 400, 1600));
        // No claim waited: nothing to grow for.
        assert_eq!(round(&mut state, &mut start, 50, MS, false), 400);
        assert_eq!(round(&mut state, &mut start, 50, MS, true), 800);
        assert_eq!(round(&mut state, &mut start, 50, MS, true), 1600);
        // Never past every worker's window.
        assert_eq!(round(&mut state, &mut start, 50, MS, true), 1600);
    }

    #[test]
    fn queueing_beyond_the_target_shrinks_it_by_a_quarter_then_it_grows_by_a_quarter_batch() {
        let (window, mut start) = window(4, 400, 200);
        let mut state = window.state();
        round(&mut state, &mut start, 50, MS, true);
        round(&mut state, &mut start, 50, MS, true);
        // The base is 1 ms: a mean of 12 ms is 11 ms of queueing, over the 10 ms target.
        assert_eq!(round(&mut state, &mut start, 50, 12 * MS, true), 1200);
        assert_eq!(round(&mut state, &mut start, 50, 12 * MS, true), 900);
        // 10 ms of queueing is within it: no more slow start, a quarter batch a round.
        assert_eq!(round(&mut state, &mut start, 50, 11 * MS, true), 950);
        assert_eq!(round(&mut state, &mut start, 50, 11 * MS, true), 1000);
        for _ in 0..10 {
            round(&mut state, &mut start, 50, 30 * MS, true);
        }
        // Never below the floor.
        assert_eq!(state.limit, 400);
    }

    #[test]
    fn a_sink_slow_in_parallel_is_not_queueing() {
        // 200 ms a publish, every publish alike: the base itself, so the window grows.
        let (window, mut start) = window(4, 400, 200);
        let mut state = window.state();
        assert_eq!(round(&mut state, &mut start, 50, 200 * MS, true), 800);
        // Up to twice the base is tolerated for a slow sink.
        assert_eq!(round(&mut state, &mut start, 50, 390 * MS, true), 1600);
        assert_eq!(round(&mut state, &mut start, 50, 450 * MS, true), 1200);
    }

    #[test]
    fn the_base_forgets_samples_older_than_two_spans() {
        let (window, mut start) = window(4, 400, 200);
        let mut state = window.state();
        state.answered(MS, start);
        start += BASE_SPAN;
        state.answered(20 * MS, start);
        assert_eq!(state.base.get(), MS);
        start += BASE_SPAN;
        state.answered(30 * MS, start);
        assert_eq!(state.base.get(), 20 * MS);
    }

    #[test]
    fn a_claim_fits_with_room_for_its_batch_or_when_nothing_is_in_flight() {
        let (window, _) = window(4, 400, 200);
        let never = || -> Recipient<Wake> { unreachable!("no worker waits while there is room") };
        let mut first = window.admit(200, 0, never).expect("an empty window admits");
        let second = window.admit(200, 1, never).expect("room for a second batch");
        assert_eq!(window.state().used, 400);
        // A claim that got 150 of its 200 rows: 150 slots held, 50 given back.
        let slots: Vec<Slot> = (0..150).map(|_| first.slot()).collect();
        drop(first);
        drop(second);
        assert_eq!(window.state().used, 150);
        drop(slots);
        assert_eq!(window.state().used, 0);
        // A batch larger than the limit still fits an empty window.
        let big = window.admit(1000, 2, never).expect("an empty window admits any batch");
        drop(big);
        let probe = window.reserve(1);
        assert_eq!(window.state().used, 1);
        drop(probe);
        assert_eq!(window.state().used, 0);
    }
}
