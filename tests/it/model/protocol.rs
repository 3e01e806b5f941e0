//! The lease protocol as a `stateright` model: the table's rows, the workers, the sink's answers
//! and the database's clock. The module docs (`mod.rs`) say what each action stands for.

use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::Fence;
use actix_outbox::testing::{Step, decide};
use actix_outbox::{DispatcherConfig, OutboxMessage, PublishError, PublishResult};
use stateright::{Model, Property};

/// Rows in the table, by id order (index `i` is outbox id `i + 1`).
pub(crate) const ROWS: usize = 3;
/// Claiming workers.
pub(crate) const WORKERS: usize = 2;
/// Each row's aggregate: rows 0 and 1 are two events of one aggregate, row 2 is alone in its own.
const AGGREGATE: [u8; ROWS] = [0, 0, 1];

/// Deliberate bugs, to show that the checker finds what each property guards against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Bugs {
    /// A finalize (and a release) written `WHERE id = $id` only: neither the status nor the
    /// `lease_version` of the claim is checked.
    pub(crate) unfenced_finalize: bool,
    /// The claim's expired-lease branch leaves `lease_version` as it was.
    pub(crate) reclaim_without_bump: bool,
    /// The FIFO gate lets a dead head through (blocks on `pending` and `processing` only).
    pub(crate) gate_ignores_dead: bool,
    /// The sink reports an outage as [`PublishError::Retryable`] instead of `Unavailable`.
    pub(crate) outage_as_retryable: bool,
}

/// What the sink answers to one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Outcome {
    /// Confirmed.
    Ok,
    /// Nacked: this message failed and may succeed later.
    Retryable,
    /// Unroutable or rejected: will never succeed.
    Permanent,
    /// The sink cannot take messages (no link, reconnecting).
    Unavailable,
    /// Sent, and no confirm came within the publish timeout while the sink said it was up.
    UnconfirmedUp,
    /// Sent, and no confirm came within the publish timeout while the sink said it was down.
    UnconfirmedDown,
    /// A business precondition: not yet.
    Defer,
}

impl Outcome {
    /// The sink's answer as the dispatcher hands it to `decide`. The two unconfirmed cases are
    /// what `call_sink` in src/dispatcher/publish.rs makes of a publish timeout, by the sink's
    /// state at that moment.
    fn result(self, bugs: Bugs) -> PublishResult {
        let outage = |why: &str| {
            if bugs.outage_as_retryable {
                PublishError::Retryable(why.into())
            } else {
                PublishError::Unavailable(why.into())
            }
        };
        match self {
            Outcome::Ok => Ok(()),
            Outcome::Retryable => Err(PublishError::Retryable("broker nacked the message".into())),
            Outcome::Permanent => Err(PublishError::Permanent("unroutable".into())),
            Outcome::Unavailable => Err(outage("link down")),
            Outcome::UnconfirmedUp => Err(PublishError::Retryable("publish timed out".into())),
            Outcome::UnconfirmedDown => Err(outage("no answer within the timeout and the sink is down")),
            Outcome::Defer => {
                Err(PublishError::Defer { delay: Duration::from_secs(1), reason: "precondition not met".into() })
            }
        }
    }
}

/// Which faults the checked runs may contain, and how many in all. Every fault spends one unit
/// of `budget`; a publish answered [`Outcome::Ok`] spends nothing. Once the budget is spent the
/// sink confirms everything and no worker crashes or stalls: the "sink that eventually
/// succeeds" of the liveness properties.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Faults {
    /// The failed answers the sink may give.
    pub(crate) outcomes: &'static [Outcome],
    /// Workers may crash, losing what they hold.
    pub(crate) crash: bool,
    /// Workers may stall and resume later; a stalled worker's publish may send a heartbeat
    /// after its lease ran out.
    pub(crate) stall: bool,
    pub(crate) budget: u8,
}

/// The model, with the dispatcher's configuration the decisions are made with.
#[derive(Debug, Clone)]
pub(crate) struct Protocol {
    pub(crate) fifo: bool,
    pub(crate) batch: usize,
    pub(crate) faults: Faults,
    pub(crate) bugs: Bugs,
    /// Keep the workers sorted, so that states that differ only by which worker is which are
    /// one state (they are interchangeable). Off, a worker keeps its number along a path, which
    /// makes counterexamples readable.
    pub(crate) symmetric: bool,
    /// Check this property only: the checker then stops at its first counterexample, which in
    /// a breadth-first search is a shortest one.
    pub(crate) only: Option<&'static str>,
    pub(crate) config: DispatcherConfig,
}

/// `max_attempts` of the checked configuration: the second claim of a row is its last.
pub(crate) const MAX_ATTEMPTS: u8 = 2;

impl Protocol {
    pub(crate) fn new(fifo: bool, faults: Faults) -> Self {
        Protocol {
            fifo,
            batch: 2,
            faults,
            bugs: Bugs::default(),
            symmetric: true,
            only: None,
            config: DispatcherConfig::default().max_attempts(i32::from(MAX_ATTEMPTS)),
        }
    }

    pub(crate) fn bugs(mut self, bugs: Bugs) -> Self {
        self.bugs = bugs;
        self
    }

    /// The model for a readable, shortest counterexample to `property`.
    pub(crate) fn hunting(mut self, property: &'static str) -> Self {
        self.symmetric = false;
        self.only = Some(property);
        self
    }

    /// `attempts >= max_attempts`, as the reaper and `decide` read it.
    fn exhausted(&self, attempts: u8) -> bool {
        i32::from(attempts) >= self.config.max_attempts
    }

    /// Whether the FIFO gate lets row `r` be claimed: no earlier row of its aggregate is
    /// `pending`, `processing` or `dead` (the `NOT EXISTS` probe of src/store/sql.rs).
    fn gate_open(&self, s: &State, r: usize) -> bool {
        if !self.fifo {
            return true;
        }
        (0..r).filter(|&e| AGGREGATE[e] == AGGREGATE[r]).all(|e| match s.rows[e].status {
            Status::Done => true,
            Status::Dead => self.bugs.gate_ignores_dead,
            Status::Pending | Status::Processing => false,
            other => unreachable!("the model has no {other} rows"),
        })
    }

    /// Whether row `r` has reached its end: done or dead, or, under FIFO, waiting behind a dead
    /// earlier row of its aggregate (a dead head blocks its aggregate on purpose).
    pub(crate) fn settled(&self, s: &State, r: usize) -> bool {
        s.rows[r].finished()
            || self.fifo && (0..r).any(|e| AGGREGATE[e] == AGGREGATE[r] && s.rows[e].status == Status::Dead)
    }

    pub(crate) fn all_settled(&self, s: &State) -> bool {
        (0..ROWS).all(|r| self.settled(s, r))
    }

    /// The sink fails only by outages, and workers neither crash nor stall.
    fn outages_only(&self) -> bool {
        let outage = |o: &Outcome| matches!(o, Outcome::Unavailable | Outcome::UnconfirmedDown);
        self.faults.outcomes.iter().all(outage) && !self.faults.crash && !self.faults.stall
    }

    /// One claim statement of worker `w` (src/store/claim.rs `claim`, the SQL in
    /// src/store/sql.rs): the reaper, then expired leases with attempts left and ready pending
    /// rows, gated, in id order up to the batch. Every CTE reads the statement's snapshot, so
    /// the gate sees the statuses from before the reaper's writes.
    fn claim(&self, s: &mut State, w: usize) -> bool {
        let before = s.rows.clone();
        let mut changed = false;
        for row in s.rows.iter_mut() {
            if row.status == Status::Processing && !row.leased && self.exhausted(row.attempts) {
                row.status = Status::Dead;
                row.version += 1;
                row.leased = false;
                changed = true;
            }
        }
        let snapshot = State { rows: before, ..s.clone() };
        let picked: Vec<usize> = (0..ROWS)
            .filter(|&r| {
                let row = &snapshot.rows[r];
                let expired = row.status == Status::Processing && !row.leased && !self.exhausted(row.attempts);
                let ready = row.status == Status::Pending && row.ready;
                (expired || ready) && self.gate_open(&snapshot, r)
            })
            .take(self.batch)
            .collect();
        for r in picked {
            let row = &mut s.rows[r];
            let reclaim = row.status == Status::Processing;
            if !(reclaim && self.bugs.reclaim_without_bump) {
                row.version += 1;
            }
            row.status = Status::Processing;
            row.attempts += 1;
            row.leased = true;
            row.ready = false;
            row.claims += 1;
            row.outcomes = 0;
            row.foreign = false;
            let held =
                Held { row: r as u8, claim: row.claims, version: row.version, attempts: row.attempts, answer: None };
            s.workers[w].held.push(held);
            changed = true;
        }
        s.workers[w].held.sort();
        changed
    }

    /// The message a claim handed the worker, as `decide` reads it.
    fn message(&self, held: &Held) -> OutboxMessage {
        let payload = serde_json::value::to_raw_value(&serde_json::json!({})).expect("an empty object");
        let aggregate = AGGREGATE[usize::from(held.row)].to_string();
        let mut message = OutboxMessage::new(i64::from(held.row) + 1, "order", aggregate, "order.placed", payload);
        message.attempts = i32::from(held.attempts);
        message.lease_version = i64::from(held.version);
        message
    }

    /// The fenced write of `step` for `held` (src/store/finalize.rs: `mark_done`, `mark_dead`,
    /// `reschedule`, all filtered by `held()` and `Batch::fenced`). Returns whether it won.
    fn write(&self, s: &mut State, held: &Held, step: Step) -> bool {
        let fence = Fence { id: i64::from(held.row) + 1, lease_version: i64::from(held.version) };
        assert_eq!(step.fence(), fence, "decide fences the write on the claim it was given");
        let row = &mut s.rows[usize::from(held.row)];
        let wins = self.bugs.unfenced_finalize || row.status == Status::Processing && row.version == held.version;
        if !wins {
            return false;
        }
        row.outcomes += 1;
        if row.claims != held.claim {
            row.foreign = true;
        }
        row.leased = false;
        match step {
            Step::Done(_) => row.status = Status::Done,
            Step::Dead(_) => row.status = Status::Dead,
            Step::Reschedule(r) => {
                // The model's rows are never older than `max_defer_age`: a deferral goes pending.
                row.status = Status::Pending;
                row.attempts = row.attempts.saturating_sub(u8::from(r.refund_attempt));
                // A release (no delay, attempt refunded) is claimable at once. A backoff's
                // delay is drawn at random, possibly zero: it waits for time to pass, which
                // the checker may let happen at once.
                row.ready = r.refund_attempt && r.delay.is_zero();
            }
        }
        true
    }

    fn take_held(s: &mut State, w: usize, row: u8, claim: u8) -> Held {
        let i = s.workers[w].held.iter().position(|h| h.row == row && h.claim == claim).expect("a held claim");
        s.workers[w].held.remove(i)
    }

    fn find_held(s: &State, w: usize, row: u8, claim: u8) -> Option<&Held> {
        s.workers[w].held.iter().find(|h| h.row == row && h.claim == claim)
    }

    /// Whether a running (not stalled) worker holds row `r`'s current claim.
    fn running_holder(s: &State, r: usize) -> bool {
        s.workers
            .iter()
            .any(|w| !w.stalled && w.held.iter().any(|h| usize::from(h.row) == r && h.claim == s.rows[r].claims))
    }

    /// Spends one fault of the budget, if the model allows `allowed`.
    fn spend(&self, s: &mut State, allowed: bool) -> bool {
        if allowed && s.faults_left > 0 {
            s.faults_left -= 1;
            true
        } else {
            false
        }
    }

    fn step(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Claim(w) => {
                let wk = &s.workers[usize::from(w)];
                if wk.stalled || wk.gate_closed || wk.held.len() + self.batch > 2 * self.batch {
                    return None;
                }
                if !self.claim(&mut s, usize::from(w)) {
                    return None;
                }
            }
            Action::LeaseExpires(r) => {
                let row = &s.rows[usize::from(r)];
                if row.status != Status::Processing || !row.leased {
                    return None;
                }
                // `publish_timeout < lease` (`DispatcherConfig::validate`): a running worker
                // finalizes within its lease. Only a stalled or crashed one is late.
                if Self::running_holder(&s, usize::from(r)) {
                    return None;
                }
                s.rows[usize::from(r)].leased = false;
            }
            Action::BackoffElapses(r) => {
                let row = &mut s.rows[usize::from(r)];
                if row.status != Status::Pending || row.ready {
                    return None;
                }
                row.ready = true;
            }
            Action::Publish { worker, row, claim, outcome } => {
                let w = usize::from(worker);
                let held = Self::find_held(&s, w, row, claim)?;
                if s.workers[w].stalled || s.workers[w].gate_closed || held.answer.is_some() {
                    return None;
                }
                if outcome != Outcome::Ok && !self.spend(&mut s, self.faults.outcomes.contains(&outcome)) {
                    return None;
                }
                let r = usize::from(row);
                if self.fifo && (0..r).any(|e| AGGREGATE[e] == AGGREGATE[r] && s.rows[e].status != Status::Done) {
                    s.fifo_broken = true;
                }
                // publish.rs: an Unavailable answer closes the worker's sink gate.
                if outcome.result(self.bugs).as_ref().is_err_and(PublishError::is_unavailable) {
                    s.workers[w].gate_closed = true;
                }
                let i = s.workers[w].held.iter().position(|h| h.row == row && h.claim == claim)?;
                s.workers[w].held[i].answer = Some(outcome);
            }
            Action::Heartbeat { worker, row, claim } => {
                let w = usize::from(worker);
                let held = *Self::find_held(&s, w, row, claim)?;
                let r = &s.rows[usize::from(row)];
                let extends = r.status == Status::Processing && r.version == held.version && !r.leased;
                if s.workers[w].stalled || held.answer.is_some() || !extends || !self.spend(&mut s, self.faults.stall) {
                    return None;
                }
                s.rows[usize::from(row)].leased = true;
            }
            Action::Finalize { worker, row, claim } => {
                let w = usize::from(worker);
                let held = *Self::find_held(&s, w, row, claim)?;
                if s.workers[w].stalled {
                    return None;
                }
                let outcome = held.answer?;
                let step = decide(&self.message(&held), &outcome.result(self.bugs), &self.config);
                Self::take_held(&mut s, w, row, claim);
                self.write(&mut s, &held, step);
            }
            Action::ReleaseUnsent { worker, row, claim } => {
                let w = usize::from(worker);
                let held = *Self::find_held(&s, w, row, claim)?;
                if s.workers[w].stalled || !s.workers[w].gate_closed || held.answer.is_some() {
                    return None;
                }
                // publish.rs hands such a row back with `step::release`, the same step
                // `decide` makes of an Unavailable answer (its `Unavailable` arm calls it).
                let unsent = Err(PublishError::Unavailable("released unsent".into()));
                let step = decide(&self.message(&held), &unsent, &self.config);
                Self::take_held(&mut s, w, row, claim);
                self.write(&mut s, &held, step);
            }
            Action::Crash(w) => {
                if s.workers[usize::from(w)].held.is_empty() || !self.spend(&mut s, self.faults.crash) {
                    return None;
                }
                s.workers[usize::from(w)] = Worker::default();
            }
            Action::Stall(w) => {
                let wk = &s.workers[usize::from(w)];
                if wk.stalled || wk.held.is_empty() || !self.spend(&mut s, self.faults.stall) {
                    return None;
                }
                s.workers[usize::from(w)].stalled = true;
            }
            Action::Resume(w) => {
                if !s.workers[usize::from(w)].stalled {
                    return None;
                }
                s.workers[usize::from(w)].stalled = false;
            }
            Action::SinkBack(w) => {
                if !s.workers[usize::from(w)].gate_closed {
                    return None;
                }
                s.workers[usize::from(w)].gate_closed = false;
            }
        }
        for row in s.rows.iter_mut() {
            row.ever_finished |= row.finished();
        }
        // Workers are interchangeable: keep them sorted, so that two situations that differ only
        // by which worker is which are one state.
        if self.symmetric {
            s.workers.sort();
        }
        Some(s)
    }
}

/// One row of the `outbox` table, with the checker's own bookkeeping (the ghost fields).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Row {
    pub(crate) status: Status,
    pub(crate) attempts: u8,
    pub(crate) version: u8,
    /// `processing`: `lease_until` is still ahead of the database's `now()`.
    pub(crate) leased: bool,
    /// `pending`: `available_at` has passed.
    pub(crate) ready: bool,
    /// Ghost: claims of this row so far; the current claim is the one with this number.
    pub(crate) claims: u8,
    /// Ghost: outcomes written to the row since its current claim.
    pub(crate) outcomes: u8,
    /// Ghost: an outcome of another claim than the current one was written since it.
    pub(crate) foreign: bool,
    /// Ghost: the row has been `done` or `dead`.
    pub(crate) ever_finished: bool,
}

impl Row {
    fn finished(&self) -> bool {
        matches!(self.status, Status::Done | Status::Dead)
    }
}

/// A claimed row as its worker holds it: the claim's fence and attempt, and the sink's answer
/// once it came.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Held {
    pub(crate) row: u8,
    /// Which claim of the row this is (ghost: the row's `claims` when it was made).
    pub(crate) claim: u8,
    pub(crate) version: u8,
    pub(crate) attempts: u8,
    pub(crate) answer: Option<Outcome>,
}

/// One worker: a dispatcher process with a single claim actor, its own owner id and sink gate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Worker {
    /// Its claims, sorted, so that equal situations are equal states.
    pub(crate) held: Vec<Held>,
    pub(crate) stalled: bool,
    /// The sink gate is closed: no claims, no publishes; unsent rows go back.
    pub(crate) gate_closed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct State {
    pub(crate) rows: [Row; ROWS],
    pub(crate) workers: [Worker; WORKERS],
    pub(crate) faults_left: u8,
    /// Ghost: a row was handed to the sink while an earlier row of its aggregate was not done.
    pub(crate) fifo_broken: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Claim(u8),
    LeaseExpires(u8),
    BackoffElapses(u8),
    Publish { worker: u8, row: u8, claim: u8, outcome: Outcome },
    Heartbeat { worker: u8, row: u8, claim: u8 },
    Finalize { worker: u8, row: u8, claim: u8 },
    ReleaseUnsent { worker: u8, row: u8, claim: u8 },
    Crash(u8),
    Stall(u8),
    Resume(u8),
    SinkBack(u8),
}

const ALL_OUTCOMES: [Outcome; 7] = [
    Outcome::Ok,
    Outcome::Retryable,
    Outcome::Permanent,
    Outcome::Unavailable,
    Outcome::UnconfirmedUp,
    Outcome::UnconfirmedDown,
    Outcome::Defer,
];

/// Every step makes progress by this measure, in lexicographic order: more claims or versions,
/// then fewer faults left, fewer claims held (a held claim weighs 2 before its answer, 1 after),
/// fewer closed gates, fewer running leases, fewer rows waiting for a backoff, fewer stalled
/// workers. Each is bounded, so every run is finite: there is no cycle, no run that keeps
/// doing something forever without finishing, and so no unfair run to exclude.
fn progress(s: &State) -> (u32, i32, i32, i32, i32, i32, i32) {
    let claims = s.rows.iter().map(|r| u32::from(r.version) + u32::from(r.claims)).sum();
    let held = s.workers.iter().flat_map(|w| &w.held).map(|h| if h.answer.is_none() { 2 } else { 1 }).sum::<i32>();
    let closed = s.workers.iter().filter(|w| w.gate_closed).count() as i32;
    let leased = s.rows.iter().filter(|r| r.status == Status::Processing && r.leased).count() as i32;
    let waiting = s.rows.iter().filter(|r| r.status == Status::Pending && !r.ready).count() as i32;
    let stalled = s.workers.iter().filter(|w| w.stalled).count() as i32;
    (claims, -i32::from(s.faults_left), -held, -closed, -leased, -waiting, -stalled)
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let row = Row {
            status: Status::Pending,
            attempts: 0,
            version: 0,
            leased: false,
            ready: true,
            claims: 0,
            outcomes: 0,
            foreign: false,
            ever_finished: false,
        };
        vec![State {
            rows: std::array::from_fn(|_| row.clone()),
            workers: Default::default(),
            faults_left: self.faults.budget,
            fifo_broken: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for r in 0..ROWS as u8 {
            actions.push(Action::LeaseExpires(r));
            actions.push(Action::BackoffElapses(r));
        }
        for (w, worker) in s.workers.iter().enumerate() {
            let w = w as u8;
            actions.push(Action::Claim(w));
            for h in &worker.held {
                let (row, claim) = (h.row, h.claim);
                for outcome in ALL_OUTCOMES {
                    actions.push(Action::Publish { worker: w, row, claim, outcome });
                }
                actions.push(Action::Heartbeat { worker: w, row, claim });
                actions.push(Action::Finalize { worker: w, row, claim });
                actions.push(Action::ReleaseUnsent { worker: w, row, claim });
            }
            actions.push(Action::Crash(w));
            actions.push(Action::Stall(w));
            actions.push(Action::Resume(w));
            actions.push(Action::SinkBack(w));
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let next = self.step(last, action)?;
        assert!(progress(&next) > progress(last), "{action:?} made no progress from {last:?}");
        if self.bugs == Bugs::default() {
            // What makes `eventually` exact here (see the module docs): once every row has
            // settled, every row stays settled.
            assert!(!self.all_settled(last) || self.all_settled(&next), "{action:?} unsettled {last:?}");
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(ONE_OUTCOME_PER_LEASE, |_, s: &State| {
                s.rows.iter().all(|r| r.outcomes <= 1 && !r.foreign)
            }),
            Property::always(FINISHED_STAYS_FINISHED, |_, s: &State| {
                s.rows.iter().all(|r| !r.ever_finished || r.finished())
            }),
            Property::eventually(EVERY_ROW_SETTLES, |m: &Protocol, s: &State| m.all_settled(s)),
        ];
        if self.faults.stall {
            properties.push(Property::sometimes(A_TAKEOVER_IS_FENCED_OUT, |_, s: &State| {
                s.workers.iter().flat_map(|w| &w.held).any(|h| {
                    let row = &s.rows[usize::from(h.row)];
                    h.answer == Some(Outcome::Ok) && row.claims > h.claim && row.finished()
                })
            }));
        }
        if self.fifo {
            properties.push(Property::always(FIFO_ORDER, |_, s: &State| !s.fifo_broken));
        }
        if self.outages_only() {
            properties.push(Property::always(OUTAGE_NEVER_KILLS, |_, s: &State| {
                s.rows.iter().all(|r| r.status != Status::Dead)
            }));
        }
        if let Some(only) = self.only {
            properties.retain(|p| p.name == only);
        }
        properties
    }
}

pub(crate) const ONE_OUTCOME_PER_LEASE: &str = "at most one outcome is written per lease, by its holder";
pub(crate) const FINISHED_STAYS_FINISHED: &str = "a done or dead row is never claimed again";
pub(crate) const EVERY_ROW_SETTLES: &str = "every row ends done or dead";
pub(crate) const A_TAKEOVER_IS_FENCED_OUT: &str =
    "a stale worker holds a confirmed publish of a row taken over and finished";
pub(crate) const FIFO_ORDER: &str = "no row is published while an earlier row of its aggregate is not done";
pub(crate) const OUTAGE_NEVER_KILLS: &str = "an outage alone never sends a row dead";
