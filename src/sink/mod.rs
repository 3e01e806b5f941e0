//! Sinks: implementations of [`Publisher`](crate::Publisher). They know nothing of the
//! database: they get a claimed message and return an outcome.

mod channel;

pub use channel::{ChannelSink, SinkAction};
