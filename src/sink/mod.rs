//! The publish step: the [`Publisher`](crate::Publisher) implementations that ship with the
//! crate, and what a sink of one's own works with. Sinks know nothing of the database: they get
//! a claimed message and return an outcome.
//!
//! - [`RabbitSink`] (configured by [`RabbitConfig`]): RabbitMQ with publisher confirms;
//! - [`ChannelSink`]: an in-process channel, for tests and for consumers in the same process;
//! - [`ActorPublisher`]: a user's own actix actor that handles [`Publish`];
//! - [`publisher_fn`]: an async closure;
//! - any type that implements [`Publisher`](crate::Publisher), reporting its health as a
//!   [`SinkState`].

mod channel;
mod rabbit;

pub use crate::publisher::{ActorPublisher, FnPublisher, Publish, PublishFuture, SinkState, publisher_fn};
pub use channel::{ChannelSink, SinkAction};
pub use rabbit::{
    CloudEventsMode, ExchangeKind, QueueBinding, QueueKind, RabbitConfig, RabbitError, RabbitSink, RoutingKeyFn,
};
