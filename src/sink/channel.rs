//! An in-process sink that hands messages to a channel, and fails, stalls or panics on demand.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::error::PublishError;
use crate::model::OutboxMessage;
use crate::publisher::{PublishFuture, Publisher, SinkState};

/// What a [`ChannelSink`] does with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SinkAction {
    /// Send it to the channel and report success.
    Deliver,
    /// Report this failure without sending.
    Fail(PublishError),
    /// Panic (a crashing sink).
    Panic,
    /// Wait this long, then deliver (a slow or stalled broker).
    Stall(Duration),
}

type Script = dyn Fn(&OutboxMessage) -> SinkAction + Send + Sync;
type StateFn = dyn Fn() -> SinkState + Send + Sync;

/// An in-process [`Publisher`]: every delivered message is sent to an unbounded channel. For
/// tests, demos and applications whose consumer lives in the same process.
///
/// ```
/// use actix_outbox::PublishError;
/// use actix_outbox::sink::{ChannelSink, SinkAction};
///
/// // Fails every message's first attempt, then delivers.
/// let (sink, _published) = ChannelSink::new();
/// let sink = sink.with_script(|m| {
///     if m.attempts == 1 { SinkAction::Fail(PublishError::Retryable("flaky".into())) } else { SinkAction::Deliver }
/// });
/// # let _ = sink;
/// ```
#[derive(Clone)]
pub struct ChannelSink {
    tx: mpsc::UnboundedSender<Arc<OutboxMessage>>,
    script: Option<Arc<Script>>,
    state: Option<Arc<StateFn>>,
}

impl std::fmt::Debug for ChannelSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelSink").field("scripted", &self.script.is_some()).finish()
    }
}

impl ChannelSink {
    /// A sink that delivers everything, and the receiving end of its channel.
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Arc<OutboxMessage>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx, script: None, state: None }, rx)
    }

    /// Decides per message what happens, from the message (its id, type, attempt...).
    #[must_use]
    pub fn with_script(mut self, script: impl Fn(&OutboxMessage) -> SinkAction + Send + Sync + 'static) -> Self {
        self.script = Some(Arc::new(script));
        self
    }

    /// Reports `state()` as the sink's health ([`Publisher::state`]); without it the sink is
    /// always [`SinkState::Up`].
    #[must_use]
    pub fn with_state(mut self, state: impl Fn() -> SinkState + Send + Sync + 'static) -> Self {
        self.state = Some(Arc::new(state));
        self
    }
}

impl Publisher for ChannelSink {
    fn publish(&self, message: Arc<OutboxMessage>) -> PublishFuture {
        let action = self.script.as_ref().map_or(SinkAction::Deliver, |script| script(&message));
        let tx = self.tx.clone();
        Box::pin(async move {
            match action {
                SinkAction::Deliver => {}
                SinkAction::Fail(e) => return Err(e),
                SinkAction::Panic => panic!("sink panicked on outbox id {} (scripted)", message.id),
                SinkAction::Stall(d) => tokio::time::sleep(d).await,
            }
            tx.send(message).map_err(|_| PublishError::Unavailable("channel receiver dropped".into()))
        })
    }

    fn state(&self) -> SinkState {
        self.state.as_ref().map_or(SinkState::Up, |state| state())
    }
}
