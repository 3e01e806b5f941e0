//! Sinks: implementations of [`Publisher`](crate::Publisher). They know nothing of the
//! database: they get a claimed message and return an outcome.

mod channel;
mod rabbit;

pub use channel::{ChannelSink, SinkAction};
pub use rabbit::{
    DEFAULT_APP_ID, DEFAULT_CONNECT_TIMEOUT, DEFAULT_EXCHANGE, DEFAULT_RECONNECT_MAX, DEFAULT_RECONNECT_MIN,
    DEFAULT_UNRESPONSIVE_AFTER, ExchangeKind, RabbitConfig, RabbitError, RabbitSink, RoutingKeyFn,
};
