//! Starting on a system that is going away.
//!
//! An actor that `main` started just before it returned (an error from `bind` right after
//! [`OutboxSupervisor::start`](crate::OutboxSupervisor::start), a panic) has its `started` run
//! while the system is torn down: actix polls each actor's context once as it drops it, so that
//! the actor can stop, and by then the Tokio runtime is gone. A timer or a task made at that
//! point panics ("there is no reactor running"), and that panic would take the place of the
//! user's own error, or abort the process if the user's code was already panicking. So every
//! actor of the crate asks [`system_gone`] first in `started`, and stops at once without
//! doing anything.

/// Whether the runtime an actor's `started` runs on has gone (see the module's docs); the
/// actor should call `ctx.stop()` and return.
pub(crate) fn system_gone() -> bool {
    tokio::runtime::Handle::try_current().is_err()
}
