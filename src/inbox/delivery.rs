//! A delivery in our hands: where it came from (its [`Envelope`]), the [`Job`] a lane runs, and
//! how it left our hands ([`Settled`]). Shared by the consumer, the attempt and the settling.

use std::sync::Arc;

use lapin::{Acker, BasicProperties, Channel};

use super::message::InboxMessage;

/// Where a delivery came from and how to settle it.
pub(super) struct Envelope {
    /// The link it came on.
    pub(super) generation: u64,
    pub(super) acker: Acker,
    pub(super) channel: Channel,
    /// One forward at a time on `channel` (see `Link::forwards`).
    pub(super) forwards: Arc<tokio::sync::Mutex<()>>,
    pub(super) properties: BasicProperties,
    /// The exchange and routing key it was first published with.
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) attempt: u32,
}

/// A usable delivery waiting for, or going through, its lane.
pub(super) struct Job {
    pub(super) envelope: Envelope,
    pub(super) message: InboxMessage,
}

/// How a delivery left our hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    Handled,
    LateFlagged,
    Duplicate,
    LateSkipped,
    Retried,
    DeadLettered,
    /// Given back unhandled at shutdown.
    Requeued,
    /// Its channel died before it could be acknowledged: the broker delivers it again.
    Abandoned,
}
