//! The lease protocol, model-checked: every interleaving of two workers over three rows, with
//! the sink's answers, crashes, stalls and the database's clock, explored exhaustively by
//! `stateright`. No database: the table is a few fields per row.
//!
//! # The model
//!
//! Rows 0 and 1 belong to one aggregate, row 2 to another. A worker stands for a dispatcher
//! process with one claim actor: its own owner id and its own sink gate. Each action is one
//! atomic step of the real code, a statement on the database or a step of a worker:
//!
//! | action | the real code |
//! | --- | --- |
//! | `Claim(w)` | `store::claim` (src/store/claim.rs, the SQL in src/store/sql.rs), one statement: the reaper (expired leases at `max_attempts` go `dead`, `lease_version + 1`), then expired leases with attempts left and ready pending rows, each through the FIFO gate when it is on, in id order up to the batch; each gets `processing`, a lease, `lease_version + 1`, `attempts + 1`. Only while the worker's gate is open and its window (`max_in_flight`, twice the batch) has room for a batch, as `ClaimActor::claim` does |
//! | `LeaseExpires(r)` | time passes on the database's clock until `lease_until < now()` |
//! | `BackoffElapses(r)` | time passes until `available_at <= now()` after a backoff or a deferral |
//! | `Publish{outcome}` | `PublishActor` calling the sink through `call_sink` (src/dispatcher/publish.rs): the answer is recorded, and an `Unavailable` one closes the worker's sink gate |
//! | `Heartbeat` | `store::extend_leases`, fenced, from a publish still running: it renews a lease that already ran out but that nobody took over (the statement does not look at `lease_until`) |
//! | `Finalize` | the finalize actor applying `testing::decide`'s step with `mark_done`, `mark_dead` or `reschedule` (src/store/finalize.rs), fenced `WHERE status = 'processing' AND lease_version = $claimed`; a write that matches nothing is a lost lease |
//! | `ReleaseUnsent` | a publish that finds its worker's sink gate closed hands its row back unsent (`step::release`: pending at once, attempt refunded), fenced like a finalize |
//! | `Crash(w)` | the process dies: what it held is lost, its rows wait for their lease |
//! | `Stall(w)`, `Resume(w)` | the process freezes (a paused VM, a partition) and later carries on, unaware of the time that passed: its leases may run out meanwhile |
//! | `SinkBack(w)` | the sink gate reopens (a probe got through) |
//!
//! The answers are those of `protocol::Outcome`: confirmed, nacked (`Retryable`),
//! `Permanent`, `Unavailable`, `Defer`, and two for a publish sent but never confirmed: what
//! `call_sink` makes of the publish timeout, `Retryable` while the sink says it is up and
//! `Unavailable` while it says it is down. A finalized row's next state is computed by the
//! crate's own `actix_outbox::testing::decide` from an `OutboxMessage` carrying the claim's
//! attempt and version, so the model follows the code's decisions rather than a copy of them.
//! The release of an unsent row uses `decide`'s step for `Unavailable`, which the code builds
//! with the same crate-private `step::release`.
//!
//! Every run is finite. Faults come from a budget (each failed answer, crash, stall and late
//! heartbeat spends one), after which the sink confirms everything and no worker fails: the
//! "sink that eventually succeeds". A lease runs out only under a worker that stalled or
//! crashed: a running one finalizes within its lease, which `publish_timeout < lease`
//! (`DispatcherConfig::validate`) gives the real dispatcher.
//!
//! # What is abstracted away
//!
//! Time is two booleans per row (the lease ran out, the backoff elapsed), not instants: the
//! order of expiries is free, the lengths of leases and backoffs are not modelled. Claims take
//! candidates in id order, not expired leases by `lease_until`. The byte budget, the resume
//! position, the bounded walk and the heads scan of the FIFO claim are left out (they change
//! which rows a claim sees first, not which rows it may take). So are the group commit of the
//! finalizer (a batch is one write per row here), retention by deletion, the read-back of a
//! write in doubt (`store::settled`), database outages, a claim whose answer is lost
//! (`store::release_unanswered`) and the probe's single-row claim. Rows are never older than
//! `max_defer_age`, so a deferral always goes back to pending. Operators' `dead retry` and
//! `dead skip` are not actions: a dead row stays dead.
//!
//! # The properties
//!
//! Ghost fields (a claim's number, the outcomes written since, whether a row was ever finished)
//! are bookkeeping of the checker, not columns:
//!
//! - at most one outcome is written per lease, and only by the claim that holds it: a write
//!   that lands for any other claim than the row's current one is a counterexample (with the
//!   fence, two claims never share a `(row, lease_version)`, so this is the fence's promise);
//! - a done or dead row is never claimed again (nor written back to pending);
//! - under FIFO, no row is handed to the sink while an earlier row of its aggregate is not
//!   `done`;
//! - every row ends `done` or `dead` (under FIFO, or waits behind a dead earlier row of its
//!   aggregate: a dead head blocks on purpose);
//! - with a sink whose only failures are outages, no row is ever `dead`.
//!
//! `stateright` checks `eventually` only on runs that end, and may miss a counterexample where
//! two runs join in one state. Neither limits it here: `next_state` asserts that every step
//! makes progress by a bounded measure (so every run ends: no cycle, and no unfair run to rule
//! out), and that "every row has settled" stays true once true (so the property is a function
//! of the state, whatever the run that reached it).
//!
//! # The size of the space
//!
//! Workers are interchangeable, so states are kept with their workers sorted. The checked
//! configurations (in `tests`) have 9,941 to 69,974 states; each test asserts its exact count.
//! `Bugs` switches in four deliberate bugs, and a test for each asserts that a shortest
//! counterexample is found, and prints it.

mod protocol;
mod tests;
