//! [`RabbitError`]: why the sink could not start.

/// Why a [`RabbitSink`](super::RabbitSink) could not start. Once started, the sink never fails as a whole: a lost
/// broker turns into retryable publishes while it reconnects.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// The configuration breaks a rule; retrying will not help.
    #[error("invalid RabbitMQ sink configuration: {0}")]
    Config(String),
    /// Nothing answered as a broker at the URL (refused, reset, or no handshake within the
    /// connect timeout). The URL's password is masked.
    #[error("RabbitMQ is unreachable at {url}: {reason}")]
    Unreachable {
        /// The URL, password masked.
        url: String,
        /// What failed.
        reason: String,
    },
    /// A broker answered but refused the connection (bad credentials, unknown vhost) or the
    /// sink's setup (confirm mode, the exchange declaration — e.g. an existing exchange of
    /// another type —, a bound queue's declaration or binding — e.g. an existing queue of
    /// another type, named in the reason with the fix).
    #[error("RabbitMQ at {url} refused the sink: {reason}")]
    Refused {
        /// The URL, password masked.
        url: String,
        /// The broker's reason.
        reason: String,
    },
    /// The sink's connection thread could not be started.
    #[error("could not start the RabbitMQ sink's connection thread: {0}")]
    Thread(String),
}

crate::error::readable_debug!(RabbitError);

impl RabbitError {
    /// Whether connecting again later may succeed (the broker may come up), as opposed to a
    /// configuration the broker or the sink will reject again.
    pub fn is_transient(&self) -> bool {
        match self {
            RabbitError::Unreachable { .. } | RabbitError::Thread(_) => true,
            RabbitError::Config(_) | RabbitError::Refused { .. } => false,
        }
    }
}
