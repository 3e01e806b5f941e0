//! The consumer's broker link: one lapin connection on a thread and tokio runtime of its own,
//! with one channel (confirm mode, prefetch set) consuming the queue.
//!
//! A lapin connection is bound to the runtime that created it: created on an actix arbiter
//! that later stops, it would hang silently. So [`Link::open`] starts a thread
//! (`actix-outbox-inbox-amqp`) with a current-thread runtime that connects, declares the
//! dead-letter topology, starts consuming, hands the channel and the consumer stream back, and
//! then only keeps the connection alive. The channel and the stream are runtime-agnostic: the
//! consumer actor reads, acknowledges and publishes from its own arbiter. The thread closes the
//! connection and ends when the [`Link`] is dropped or closed, and not before, even when the
//! connection died: lapin fails the pending acknowledgements of a dead channel on that runtime.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use tokio::sync::oneshot;

use super::config::InboxConfig;
use crate::amqp::connection::{LinkThread, Stop};
use crate::amqp::connection_closer;
use crate::amqp::publisher_confirm::{self, Confirmed};
use crate::sink::QueueKind;
use crate::url::mask_url;

/// Bound on waiting for the broker's confirm of a forwarded copy.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);
/// An open broker connection, owned by its thread; dropping it closes the connection.
pub(crate) struct Link {
    /// The consuming channel (confirm mode on), for acknowledgements and forwards.
    pub(crate) channel: Channel,
    /// Held by a forward from publish to confirm: with one forward in flight on the channel, a
    /// message the broker returns is that forward's (lapin hands a return to whichever confirm
    /// it resolves next, which need not be the returned message's own).
    pub(crate) forwards: Arc<tokio::sync::Mutex<()>>,
    /// The index in [`InboxConfig::urls`] of the node it is connected to.
    pub(crate) node: usize,
    thread: LinkThread,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("channel", &self.channel.id()).finish()
    }
}

impl Link {
    /// Connects to the first node of [`InboxConfig::urls`] that answers, from the one at
    /// `first` on (each within the connect timeout), sets the link up and starts consuming (also
    /// bounded by the connect timeout). `Err` is a one-line reason, passwords masked.
    pub(crate) async fn open(config: InboxConfig, tag: String, first: usize) -> Result<(Link, Consumer), String> {
        let (ready_tx, ready_rx) = oneshot::channel::<Result<Ready, String>>();
        let thread = LinkThread::start("actix-outbox-inbox-amqp", move |stop| hold(config, tag, first, ready_tx, stop))
            .map_err(|e| e.to_string())?;
        match ready_rx.await {
            Ok(Ok(Ready { channel, consumer, node })) => {
                Ok((Link { channel, forwards: Arc::default(), node, thread }, consumer))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err("the link's thread ended before connecting".into()),
        }
    }

    /// Closes the connection gracefully and waits for the thread to finish.
    pub(crate) async fn close(self) {
        self.thread.close().await;
    }
}

/// What the link thread hands over once it consumes.
struct Ready {
    channel: Channel,
    consumer: Consumer,
    node: usize,
}

/// The link thread's whole life: set up, hand over, keep the connection until told to stop.
async fn hold(
    config: InboxConfig,
    tag: String,
    first: usize,
    ready: oneshot::Sender<Result<Ready, String>>,
    mut stop: Stop,
) {
    let mut connection = None;
    let setup = async {
        let (conn, node) = connect(&config, first).await?;
        // Kept by `hold`, so that it closes the connection whatever fails from here.
        let conn = connection.insert(conn);
        let url = mask_url(&config.urls[node]);
        let timeout = config.connect_timeout;
        let (channel, consumer) = tokio::time::timeout(timeout, set_up(&config, &tag, conn))
            .await
            .unwrap_or_else(|_| {
                Err(format!("no answer within the connect timeout ({})", humantime::format_duration(timeout)))
            })
            .map_err(|e| format!("RabbitMQ at {url}: {e}"))?;
        Ok(Ready { channel, consumer, node })
    };
    let handed = match setup.await {
        Ok(link) => ready.send(Ok(link)).is_ok(),
        Err(e) => {
            let _ = ready.send(Err(e));
            false
        }
    };
    let Some(conn) = connection else { return };
    if handed {
        // Wait for the owner even when the connection died: lapin settles pending
        // acknowledgements and confirms of a dead channel (with an error) on this runtime, and a
        // runtime dropped under them would leave them pending for ever.
        stop.requested().await;
    }
    connection_closer::close_gracefully(&conn, "inbox link").await;
}

/// Connects to the first node that answers, trying each once from `first` on, each within the
/// connect timeout: the connection and the node's index in [`InboxConfig::urls`].
async fn connect(config: &InboxConfig, first: usize) -> Result<(Connection, usize), String> {
    let name = config.connection_name.clone().unwrap_or_else(|| format!("actix-outbox inbox {}", config.consumer));
    let nodes = config.urls.len();
    let mut failures = Vec::new();
    for node in (0..nodes).map(|k| (first + k) % nodes) {
        let url = &config.urls[node];
        let properties = ConnectionProperties::default().with_connection_name(name.as_str().into());
        let why = match tokio::time::timeout(config.connect_timeout, Connection::connect(url, properties)).await {
            Ok(Ok(conn)) => return Ok((conn, node)),
            Ok(Err(e)) => format!("connecting failed: {e}"),
            Err(_) => format!(
                "connecting failed: no answer within the connect timeout ({})",
                humantime::format_duration(config.connect_timeout)
            ),
        };
        failures.push(format!("RabbitMQ at {}: {why}", mask_url(url)));
    }
    Err(failures.join("; "))
}

/// Opens the channel on `conn`, declares or checks the dead-letter topology, sets the prefetch
/// and consumes.
async fn set_up(config: &InboxConfig, tag: &str, conn: &Connection) -> Result<(Channel, Consumer), String> {
    let failed = |what: String| move |e: lapin::Error| format!("{what} failed: {e}");
    let channel = conn.create_channel().await.map_err(failed("opening a channel".into()))?;
    channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(failed("enabling confirms".into()))?;
    let dlx = config.dead_letter_exchange_name();
    if config.declare_dead_letter {
        let dlq = config.dead_letter_queue_name();
        let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        channel
            .exchange_declare(dlx.as_str().into(), ExchangeKind::Direct, durable, FieldTable::default())
            .await
            .map_err(failed(format!("declaring the dead-letter exchange {dlx:?}")))?;
        let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
        let arguments = config.dead_letter_queue_kind.map(QueueKind::arguments).unwrap_or_default();
        channel
            .queue_declare(dlq.as_str().into(), durable, arguments)
            .await
            .map_err(failed(format!("declaring the dead-letter queue {dlq:?}")))?;
        channel
            .queue_bind(
                dlq.as_str().into(),
                dlx.as_str().into(),
                config.queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed(format!("binding {dlq:?} to {dlx:?}")))?;
    } else {
        let passive = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
        channel
            .exchange_declare(dlx.as_str().into(), ExchangeKind::Direct, passive, FieldTable::default())
            .await
            .map_err(failed(format!(
                "the dead-letter exchange {dlx:?} must exist (declare_dead_letter is off); checking it"
            )))?;
    }
    channel
        .basic_qos(config.prefetch, BasicQosOptions { global: false })
        .await
        .map_err(failed("setting the prefetch".into()))?;
    let consumer = channel
        .basic_consume(config.queue.as_str().into(), tag.into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .map_err(failed(format!("consuming from queue {:?}", config.queue)))?;
    Ok((channel, consumer))
}

/// Why a forward (a retry copy or a dead letter) was not confirmed.
#[derive(Debug)]
pub(crate) enum PublishFailure {
    /// The channel or connection failed: the original delivery cannot be acknowledged on it
    /// any more, so the broker delivers it again.
    Link(String),
    /// The broker refused the copy (nack, or returned it: nobody is bound for it), or did not
    /// confirm it in time. The link may be fine; the copy can be tried again later (a second copy
    /// of a message is harmless: the inbox applies it once).
    Refused(String),
}

/// Publishes `body` with `properties` to `exchange` (mandatory) and waits for the broker's
/// confirm.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    properties: BasicProperties,
    body: &[u8],
) -> Result<(), PublishFailure> {
    let options = BasicPublishOptions { mandatory: true, immediate: false };
    let confirmed = tokio::time::timeout(CONFIRM_TIMEOUT, async {
        channel
            .basic_publish(ShortString::from(exchange), ShortString::from(routing_key), options, body, properties)
            .await?
            .await
    })
    .await
    .map_err(|_| {
        PublishFailure::Refused(format!(
            "no confirm from the broker within {}",
            humantime::format_duration(CONFIRM_TIMEOUT)
        ))
    })?;
    match publisher_confirm::read(confirmed) {
        Confirmed::Delivered => Ok(()),
        Confirmed::Unroutable(reply) => Err(PublishFailure::Refused(format!(
            "unroutable: exchange {exchange:?} has no binding for routing key {routing_key:?} ({reply})"
        ))),
        Confirmed::Nacked(_) => {
            Err(PublishFailure::Refused(format!("the broker nacked the copy sent to exchange {exchange:?}")))
        }
        Confirmed::NotConfirmMode => Err(PublishFailure::Link("the channel is not in confirm mode".into())),
        Confirmed::Failed(e) => Err(PublishFailure::Link(e.to_string())),
        Confirmed::NoExchange(why) => Err(PublishFailure::Refused(why)),
    }
}
