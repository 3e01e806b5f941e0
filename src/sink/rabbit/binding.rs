//! Queues the sink declares and binds itself ([`RabbitConfig::bind_queue`](super::RabbitConfig::bind_queue)):
//! their kind, their checks, and their declaration on each new channel.

use lapin::Channel;
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};

/// The type of a queue that the sink declares (its `x-queue-type` argument). Both are durable.
///
/// The default is [`QueueKind::Quorum`], RabbitMQ's recommendation for durable queues since
/// 3.8: replicated on a cluster, and a message published with confirms is on a majority of
/// nodes when the sink gets its ack. Pick [`QueueKind::Classic`] for a queue that already exists
/// as a classic one (a queue's type cannot change; see
/// [`RabbitConfig::bind_queue_with`](super::RabbitConfig::bind_queue_with)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum QueueKind {
    /// A quorum queue (`x-queue-type` = `quorum`). The default.
    #[default]
    Quorum,
    /// A classic queue (`x-queue-type` = `classic`).
    Classic,
}

impl QueueKind {
    /// The value of the queue's `x-queue-type` argument: `quorum` or `classic`.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueKind::Quorum => "quorum",
            QueueKind::Classic => "classic",
        }
    }

    /// The `queue.declare` arguments of a queue of this kind (`x-queue-type`).
    pub(crate) fn arguments(self) -> FieldTable {
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), AMQPValue::LongString(self.as_str().into()));
        arguments
    }
}

impl std::fmt::Display for QueueKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One binding of [`RabbitConfig::bindings`](super::RabbitConfig::bindings): the durable queue
/// `queue`, of `kind`, bound to the sink's exchange with `pattern`. Added with
/// [`RabbitConfig::bind_queue`](super::RabbitConfig::bind_queue) or
/// [`RabbitConfig::bind_queue_with`](super::RabbitConfig::bind_queue_with).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueBinding {
    /// The queue's name.
    pub queue: String,
    /// The binding's routing pattern (for a topic exchange, e.g. `order.#`).
    pub pattern: String,
    /// The queue's type.
    pub kind: QueueKind,
}

impl QueueBinding {
    pub(super) fn new(queue: String, pattern: String, kind: QueueKind) -> Self {
        Self { queue, pattern, kind }
    }
}

/// Checks names and that a queue named twice has one kind; the reason otherwise.
pub(super) fn check(bindings: &[QueueBinding], exchange: &str) -> Result<(), String> {
    if bindings.is_empty() {
        return Ok(());
    }
    if exchange.is_empty() {
        return Err("the default exchange (\"\") takes no bindings; bind queues to a named exchange".into());
    }
    for (n, b) in bindings.iter().enumerate() {
        if b.queue.is_empty() {
            return Err("a bound queue needs a name".into());
        }
        if ShortString::try_new(b.queue.as_str()).is_err() {
            return Err(format!("queue name is {} bytes long; AMQP allows 255", b.queue.len()));
        }
        if b.queue.starts_with("amq.") {
            return Err(format!("queue name {:?}: names starting with \"amq.\" are reserved to the broker", b.queue));
        }
        if ShortString::try_new(b.pattern.as_str()).is_err() {
            return Err(format!(
                "binding pattern of queue {:?} is {} bytes long; AMQP allows 255",
                b.queue,
                b.pattern.len()
            ));
        }
        if let Some(other) = bindings[..n].iter().find(|o| o.queue == b.queue && o.kind != b.kind) {
            return Err(format!(
                "queue {:?} is bound both as {} and as {}; give it one kind",
                b.queue, other.kind, b.kind
            ));
        }
    }
    Ok(())
}

/// Declares each queue of `bindings` once (durable, of its kind), then binds each to
/// `exchange`. The reason of the first failure, naming the queue; a queue that exists with
/// other arguments says what to do.
pub(super) async fn declare(
    channel: &Channel,
    exchange: &ShortString,
    bindings: &[QueueBinding],
) -> Result<(), String> {
    for (n, b) in bindings.iter().enumerate() {
        if bindings[..n].iter().any(|o| o.queue == b.queue) {
            continue;
        }
        let options = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        channel
            .queue_declare(b.queue.as_str().into(), options, b.kind.arguments())
            .await
            .map_err(|e| declare_error(b, &e))?;
    }
    for b in bindings {
        channel
            .queue_bind(
                b.queue.as_str().into(),
                exchange.clone(),
                b.pattern.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("binding queue {:?} to exchange {exchange:?} with {:?}: {e}", b.queue, b.pattern))?;
    }
    Ok(())
}

/// A failed queue declaration, in words: 406 means the queue exists with other arguments, and
/// the broker's reply names the one that differs.
fn declare_error(b: &QueueBinding, e: &lapin::Error) -> String {
    let precondition = match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => Some(amqp.get_message().to_string()),
            _ => None,
        },
        _ => None,
    };
    match precondition {
        Some(reply) => {
            let other = match b.kind {
                QueueKind::Quorum => QueueKind::Classic,
                QueueKind::Classic => QueueKind::Quorum,
            };
            format!(
                "queue {:?} already exists with other arguments than the sink declares (durable, x-queue-type {}): \
                 {reply}. If its type is what differs, bind it as a {other} queue; else delete the queue and its \
                 messages (rabbitmqctl delete_queue {}) so that the sink declares it anew",
                b.queue, b.kind, b.queue
            )
        }
        None => format!("declaring queue {:?}: {e}", b.queue),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(queue: &str, pattern: &str, kind: QueueKind) -> QueueBinding {
        QueueBinding::new(queue.into(), pattern.into(), kind)
    }

    #[test]
    fn checks_names_and_one_kind_a_queue() {
        assert!(check(&[], "").is_ok());
        let q = binding("orders", "order.#", QueueKind::Quorum);
        assert!(check(&[q.clone(), binding("orders", "", QueueKind::Quorum)], "x").is_ok());
        assert!(check(std::slice::from_ref(&q), "").unwrap_err().contains("default exchange"));
        assert!(check(&[binding("", "#", QueueKind::Quorum)], "x").unwrap_err().contains("needs a name"));
        let long = check(&[binding(&"q".repeat(256), "#", QueueKind::Quorum)], "x").unwrap_err();
        assert!(long.contains("256 bytes"), "{long}");
        let long = check(&[binding("q", &"p".repeat(300), QueueKind::Quorum)], "x").unwrap_err();
        assert!(long.contains("pattern") && long.contains("300 bytes"), "{long}");
        assert!(check(&[binding("amq.mine", "#", QueueKind::Quorum)], "x").unwrap_err().contains("reserved"));
        let mixed = check(&[q, binding("orders", "x", QueueKind::Classic)], "x").unwrap_err();
        assert!(mixed.contains("both as quorum and as classic"), "{mixed}");
    }
}
