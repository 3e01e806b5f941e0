//! The state machine's publish edges: from a publish outcome to the row's next state. One pure function, shared by the finalize actor and by anyone driving the store by
//! hand.

use crate::backoff::{full_jitter, half_jitter};
use crate::config::DispatcherConfig;
use crate::error::PublishError;
use crate::model::{Fence, OutboxMessage};
use crate::publisher::PublishResult;
use crate::store::{Bury, Reschedule};

/// How long a row the sink refused waits before it is claimable again (half-jittered below).
const REFUSED_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// The fenced write a publish outcome calls for.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Published: `done`.
    Done(Fence),
    /// Back to `pending` after a backoff (attempt spent) or a deferral (attempt refunded).
    Reschedule(Reschedule),
    /// Given up: `dead`.
    Dead(Bury),
}

impl Step {
    /// The claim this write is fenced on.
    pub fn fence(&self) -> Fence {
        match self {
            Step::Done(f) => *f,
            Step::Reschedule(r) => r.fence,
            Step::Dead(b) => b.fence,
        }
    }
}

/// Decides a claimed row's next state from its publish outcome:
/// - `Ok` → done;
/// - [`PublishError::Permanent`] → dead;
/// - [`PublishError::Retryable`] → pending after a full-jitter backoff, or dead when the row's
///   attempts have reached `max_attempts`;
/// - [`PublishError::Unavailable`] → pending at once with the attempt refunded (an outage is
///   not the message's fault, whatever its length);
/// - [`PublishError::Refused`] → pending after about a second (0.5 to 1 s) with the attempt
///   refunded (a full queue is not the message's fault either; the pause keeps a refused row
///   from coming straight back to a queue that is still full);
/// - [`PublishError::Defer`] → pending after the delay with the attempt refunded, or dead when
///   the row is older than `max_defer_age` (decided in SQL, on the database clock).
///
/// ```
/// # use actix_outbox::{DispatcherConfig, OutboxMessage, PublishError};
/// # use actix_outbox::testing::{Step, decide};
/// # let payload = serde_json::value::to_raw_value(&serde_json::json!({})).unwrap();
/// # let mut message = OutboxMessage::new(7, "order", "1", "order.paid", payload);
/// # message.attempts = 12;
/// let config = DispatcherConfig::default(); // max_attempts 12
/// let step = decide(&message, &Err(PublishError::Retryable("broker away".into())), &config);
/// assert!(matches!(step, Step::Dead(_)), "the 12th failed attempt is the last");
/// ```
pub fn decide(message: &OutboxMessage, outcome: &PublishResult, config: &DispatcherConfig) -> Step {
    let fence = message.fence();
    match outcome {
        Ok(()) => Step::Done(fence),
        Err(PublishError::Permanent(e)) => Step::Dead(Bury { fence, error: format!("permanent: {e}") }),
        Err(PublishError::Retryable(e)) if message.attempts >= config.max_attempts => Step::Dead(Bury {
            fence,
            error: format!("retries exhausted after {} attempts; last: {e}", message.attempts),
        }),
        Err(PublishError::Retryable(e)) => Step::Reschedule(Reschedule {
            fence,
            delay: full_jitter(message.attempts, config.backoff_base, config.backoff_cap),
            error: format!("retryable (attempt {}): {e}", message.attempts),
            refund_attempt: false,
            dead_if_older_than: None,
        }),
        Err(PublishError::Unavailable(e)) => release(fence, format!("sink unavailable: {e}")),
        Err(PublishError::Refused(e)) => Step::Reschedule(Reschedule {
            fence,
            delay: half_jitter(0, REFUSED_PAUSE, REFUSED_PAUSE),
            error: format!("refused by the sink: {e}"),
            refund_attempt: true,
            dead_if_older_than: None,
        }),
        Err(PublishError::Defer { delay, reason }) => Step::Reschedule(Reschedule {
            fence,
            delay: *delay,
            error: format!("deferred: {reason}"),
            refund_attempt: true,
            dead_if_older_than: Some(config.max_defer_age),
        }),
    }
}

/// Puts a claimed row back untouched: pending now, its attempt refunded. For rows the sink
/// could not take (an outage) and rows never handed to it (claimed as the sink went away).
pub(crate) fn release(fence: Fence, why: String) -> Step {
    Step::Reschedule(Reschedule {
        fence,
        delay: std::time::Duration::ZERO,
        error: why,
        refund_attempt: true,
        dead_if_older_than: None,
    })
}
