//! The dispatcher: the actors that connect the store to a sink.
//!
//! - `supervisor`: [`OutboxSupervisor`], which starts the others, replaces any that die and
//!   owns the shutdown protocol;
//! - `claim`: one claim actor per worker, which reaps, leases batches and paces itself;
//! - `publish`: one publish actor per claimed message, which calls the sink outside any
//!   transaction;
//! - `finalize`: the finalize actor, which applies the fenced writes in batches;
//! - `gate`: the sink gate, which pauses claiming while the sink is unavailable and probes it;
//! - `listener`: the insert listener, which wakes a worker when rows are inserted;
//! - `sampler`: the table sampler, which the supervisor runs for the table's gauges;
//! - `shared`: the state they all read (configuration, pool, sink, counters).
//!
//! Each actor's messages sit beside it. Only the supervisor and its messages are public.

mod claim;
mod finalize;
mod gate;
mod listener;
mod publish;
mod sampler;
mod shared;
mod supervisor;

#[cfg(feature = "test-util")]
pub use supervisor::{CrashFinalizer, CrashWorker};
pub use supervisor::{GetHealth, GetMetrics, Health, OutboxSupervisor, Shutdown, WakeWorkers};
