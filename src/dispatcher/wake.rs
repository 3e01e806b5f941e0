//! [`Wake`]: the message that sends a claim actor to claim now. The supervisor, the window and
//! the cursor send it, each holding the claim actors only as its recipients.

use actix::Message;

/// Claim now if idle (new rows were inserted, or room opened up).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub(crate) struct Wake;
