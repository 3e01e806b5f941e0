//! How a broker's answer to one confirmed publish reads: the single reading of lapin's
//! [`Confirmation`] that the sink and the inbox then turn into outcomes of their own.

use std::fmt;

use lapin::Confirmation;
use lapin::message::BasicReturnMessage;

/// The broker's reply code and text attached to a returned or nacked message, and the
/// returned message's own `message_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) code: u16,
    pub(crate) text: String,
    /// lapin hands a returned message to a confirm of the channel that need not be the returned
    /// delivery's own (with several publishes in flight, to any confirm of the ack that covers
    /// it): the sink's desk credits it to its own message by this id.
    pub(crate) message_id: Option<String>,
}

impl Reply {
    fn of(returned: &BasicReturnMessage) -> Self {
        Self {
            code: returned.reply_code,
            text: returned.reply_text.to_string(),
            message_id: returned.delivery.properties.message_id().as_ref().map(|id| id.to_string()),
        }
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.code, self.text)
    }
}

/// What became of a confirmed publish.
#[derive(Debug)]
pub(crate) enum Confirmed {
    /// Acked and routed.
    Delivered,
    /// Acked but returned (a `mandatory` publish nobody is bound for): lapin reports it as an
    /// ack that carries the returned message, since the broker did accept it.
    Unroutable(Reply),
    /// The broker refused it (e.g. a full queue with overflow=reject-publish).
    Nacked(Option<Reply>),
    /// The channel is not in confirm mode: only a new channel restores it.
    NotConfirmMode,
    /// The channel or the connection failed before the answer came.
    Failed(lapin::Error),
    /// Not published: the exchange an event named cannot be used (it does not exist, say); why.
    NoExchange(String),
}

/// Reads the result of awaiting a publish and its confirm.
pub(crate) fn read(sent: Result<Confirmation, lapin::Error>) -> Confirmed {
    match sent {
        Ok(Confirmation::Ack(None)) => Confirmed::Delivered,
        Ok(Confirmation::Ack(Some(returned))) => Confirmed::Unroutable(Reply::of(&returned)),
        Ok(Confirmation::Nack(returned)) => Confirmed::Nacked(returned.as_ref().map(Reply::of)),
        Ok(Confirmation::NotRequested) => Confirmed::NotConfirmMode,
        Err(e) => Confirmed::Failed(e),
    }
}
