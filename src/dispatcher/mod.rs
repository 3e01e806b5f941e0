//! The dispatcher's messages: what an application sends to the
//! [`OutboxSupervisor`](crate::OutboxSupervisor) it started ([`Shutdown`], [`GetHealth`],
//! [`GetMetrics`], [`WakeWorkers`]), what comes back ([`Health`]; [`GetMetrics`] answers a
//! [`MetricsSnapshot`](crate::MetricsSnapshot)), and the [`Fence`] of a claimed message.
//!
//! ```no_run
//! use actix_outbox::dispatcher::{GetHealth, Shutdown};
//! # async fn f(dispatcher: actix::Addr<actix_outbox::OutboxSupervisor>) -> Result<(), actix::MailboxError> {
//! let health = dispatcher.send(GetHealth).await?;
//! if let Some(why) = health.not_ready_reason() {
//!     eprintln!("not ready: {why}");
//! }
//! dispatcher.send(Shutdown).await?;
//! # Ok(()) }
//! ```
//!
//! Inside, the dispatcher is the actors that connect the store to a sink:
//!
//! - `supervisor`: the `OutboxSupervisor`, which starts the others, replaces any that die and
//!   owns the shutdown protocol;
//! - `claim`: one claim actor per worker, which leases batches and paces itself;
//! - `cursor`: the dispatcher's cursor over new rows, held by one claim at a time;
//! - `publish`: one publish actor per claimed message, which calls the sink outside any
//!   transaction;
//! - `finalize`: the finalize actor, which applies the fenced writes in batches;
//! - `gate`: the sink gate, which pauses claiming while the sink is unavailable and probes it;
//! - `listener`: the insert listener, which wakes a worker when rows are inserted;
//! - `pace`: the cap on messages a second, a token bucket the claims take from, slowed by the
//!   broker's pushback;
//! - `sampler`: the table sampler, which the supervisor runs for the table's gauges;
//! - `sweeper`: the sweep, which the supervisor runs every second: expired leases to the
//!   claims, reaping, the outbox's horizon;
//! - `pruner`: deletes `done` rows past the retention, in short batches;
//! - `window`: how many claimed rows are in flight at most, all workers together, found from
//!   the sink's answer times (Vegas-like: kept where the sink's queue stays short);
//! - `shared`: the state they all read (configuration, pool, sink, counters);
//! - `wake`: the message that sends a claim actor to claim now.
//!
//! Each actor's messages sit beside it, but for one that several modules send (`wake`). Only the supervisor (at the crate root) and its
//! messages are public.

mod claim;
mod cursor;
mod finalize;
mod gate;
mod listener;
mod pace;
mod pruner;
mod publish;
mod sampler;
mod shared;
mod summary;
mod sweeper;
mod wake;
mod window;
// `pub(crate)`: the crate root re-exports the supervisor, `testing` its crash hooks.
pub(crate) mod supervisor;

pub use crate::model::Fence;
pub use pace::PaceReport;
pub use supervisor::{GetHealth, GetMetrics, GetPace, Health, SetMaxRate, Shutdown, WakeWorkers};
