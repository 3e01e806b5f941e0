//! The link's publisher: the one task that publishes on a channel and reads every confirm of
//! it, so that a message the broker returns is reported as returned to its own publish.
//!
//! Why one task: for a `mandatory` publish that nobody is bound for, RabbitMQ sends
//! `basic.return` and then a `basic.ack` that may cover several publishes at once
//! (`multiple`). lapin hands the returned message to whichever confirm of that ack it resolves
//! first (its pending confirms are a hash map), not necessarily the returned message's own. A
//! publish that awaited its own confirm would then read "delivered" while the broker dropped
//! it (its row done, the message lost), and another would read "returned" for a message it
//! never sent. Here every confirm is read in one place, and a return is credited to the publish
//! whose `message_id` it carries.
//!
//! A return can reach the desk one poll later than its own publish's ack (the carrier's confirm
//! may resolve while the desk is polling the others), so what a pass reads is answered at the
//! end of the next pass, once every confirm resolved with it has been read too. Both passes
//! run back to back: the wait is one poll of the desk's task, not a timer.

use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use tokio::sync::{mpsc, oneshot};

use crate::amqp::publisher_confirm::{self, Confirmed, Reply};
use crate::model::OutboxMessage;

/// One message for the desk to publish, and where its outcome goes.
pub(super) struct Outgoing {
    pub(super) message: Arc<OutboxMessage>,
    pub(super) routing_key: ShortString,
    /// The exchange: the sink's, or the event's own (checked first by the [`Prober`]).
    pub(super) exchange: ShortString,
    pub(super) properties: BasicProperties,
    pub(super) answer: oneshot::Sender<Confirmed>,
}

/// Where publishes send their messages to the desk of one link.
pub(super) type Desk = mpsc::UnboundedSender<Outgoing>;

/// A confirm as read, before returns are credited.
struct Read {
    /// The `message_id` the publish carried.
    id: String,
    confirmed: Confirmed,
    answer: oneshot::Sender<Confirmed>,
}

/// Checks that an event's own exchange exists before anything is published to it: a publish to
/// a missing exchange makes the broker close the channel (404), failing every publish in
/// flight on it. The check is a passive declare on a short-lived channel of its own (which the
/// broker closes instead); exchanges found are remembered for the link.
#[derive(Clone)]
pub(super) struct Prober {
    connection: Weak<Connection>,
    known: Arc<Mutex<HashSet<ShortString>>>,
}

impl Prober {
    /// A prober on `connection` that knows the sink's own exchange (declared, or managed
    /// elsewhere: publishing to it is the sink's configuration, not an event's).
    pub(super) fn new(connection: Weak<Connection>, exchange: ShortString) -> Self {
        Self { connection, known: Arc::new(Mutex::new(HashSet::from([exchange]))) }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashSet<ShortString>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `None` when `exchange` may be published to, else why not (retryable).
    async fn check(&self, exchange: &ShortString) -> Option<String> {
        if self.known().contains(exchange) {
            return None;
        }
        let Some(connection) = self.connection.upgrade() else {
            return Some(format!("cannot check exchange {:?}: the connection is closed", exchange.as_str()));
        };
        let probe = async {
            let channel = connection.create_channel().await?;
            let options = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
            // The kind is ignored by a passive declare.
            channel.exchange_declare(exchange.clone(), ExchangeKind::Direct, options, FieldTable::default()).await?;
            let _ = channel.close(200, "exchange checked".into()).await;
            Ok::<(), lapin::Error>(())
        };
        match probe.await {
            Ok(()) => {
                self.known().insert(exchange.clone());
                None
            }
            Err(e) if e.to_string().contains("NOT_FOUND") => Some(format!(
                "exchange {:?} (named by the event) does not exist; the message waits until it is declared ({e})",
                exchange.as_str()
            )),
            Err(e) => Some(format!("cannot check exchange {:?} (named by the event): {e}", exchange.as_str())),
        }
    }
}

/// Publishes what arrives on `requests` on `channel` and answers each with its confirm,
/// returns credited to their own messages; a message to an event's own exchange goes only once
/// `prober` found the exchange. Sets `acked` once the broker has acked a publish of the channel,
/// before it answers any confirm read after that ack (the publishes that read their answers
/// resume in any order; the desk reads them in the order the broker sent them). Ends once every
/// sender is gone and every publish is answered.
pub(super) async fn run(
    channel: Channel,
    prober: Prober,
    mut requests: mpsc::UnboundedReceiver<Outgoing>,
    acked: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut in_flight = FuturesUnordered::new();
    let mut ledger = Returns::default();
    // Read in the previous pass, answered at the end of this one.
    let mut held: Vec<Read> = Vec::new();
    let mut open = true;
    poll_fn(|cx| {
        while open {
            match requests.poll_recv(cx) {
                Poll::Ready(Some(outgoing)) => in_flight.push(send(channel.clone(), prober.clone(), outgoing)),
                Poll::Ready(None) => open = false,
                Poll::Pending => break,
            }
        }
        let mut fresh = Vec::new();
        while let Poll::Ready(Some(read)) = in_flight.poll_next_unpin(cx) {
            if matches!(read.confirmed, Confirmed::Delivered | Confirmed::Unroutable(_)) {
                acked.store(true, std::sync::atomic::Ordering::Release);
            }
            fresh.push(ledger.take_carried(read));
        }
        for read in held.drain(..) {
            let confirmed = ledger.credit(&read.id, read.confirmed);
            // The publish may have given up waiting: nobody to tell.
            let _ = read.answer.send(confirmed);
        }
        held = fresh;
        if !held.is_empty() {
            // Answer them in a pass of their own, right away.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if in_flight.is_empty() {
            // Every publish of this link is answered: a return still in the ledger has no
            // publish left to read it.
            ledger.0.clear();
            if !open {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    })
    .await;
}

async fn send(channel: Channel, prober: Prober, outgoing: Outgoing) -> Read {
    let Outgoing { message, routing_key, exchange, properties, answer } = outgoing;
    let id = message.id.to_string();
    if let Some(why) = prober.check(&exchange).await {
        return Read { id, confirmed: Confirmed::NoExchange(why), answer };
    }
    let options = BasicPublishOptions { mandatory: true, immediate: false };
    // The JSON text as PostgreSQL sent it: lapin copies it into its frames, nothing else does.
    let body = message.payload.get().as_bytes();
    let sent = async { channel.basic_publish(exchange, routing_key, options, body, properties).await?.await }.await;
    Read { id, confirmed: publisher_confirm::read(sent), answer }
}

/// Returned messages read on a confirm other than their own, by `message_id`, until their own
/// publish's confirm is read.
#[derive(Default)]
struct Returns(HashMap<String, Reply>);

impl Returns {
    /// Takes a return that `read`'s confirm carried for another message into the ledger; what
    /// is left is this publish's own answer.
    fn take_carried(&mut self, mut read: Read) -> Read {
        let foreign = |reply: &Reply| reply.message_id.as_deref().is_some_and(|carried| carried != read.id);
        read.confirmed = match read.confirmed {
            Confirmed::Unroutable(reply) if foreign(&reply) => {
                self.record(reply);
                Confirmed::Delivered
            }
            Confirmed::Nacked(Some(reply)) if foreign(&reply) => {
                self.record(reply);
                Confirmed::Nacked(None)
            }
            other => other,
        };
        read
    }

    fn record(&mut self, reply: Reply) {
        if let Some(id) = reply.message_id.clone() {
            self.0.insert(id, reply);
        }
    }

    /// The answer for the publish of `id`: returned if a return for it was read anywhere.
    fn credit(&mut self, id: &str, confirmed: Confirmed) -> Confirmed {
        match (self.0.remove(id), confirmed) {
            (Some(reply), Confirmed::Delivered) => Confirmed::Unroutable(reply),
            (_, confirmed) => confirmed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(id: &str) -> Reply {
        Reply { code: 312, text: "NO_ROUTE".into(), message_id: Some(id.into()) }
    }

    fn read(id: &str, confirmed: Confirmed) -> (Read, oneshot::Receiver<Confirmed>) {
        let (answer, rx) = oneshot::channel();
        (Read { id: id.into(), confirmed, answer }, rx)
    }

    #[test]
    fn a_return_read_on_another_confirm_is_credited_to_its_own_message() {
        let mut ledger = Returns::default();
        // 7's confirm carries 9's return: 7 was delivered, 9 was returned.
        let (carrier, _) = read("7", Confirmed::Unroutable(reply("9")));
        let carrier = ledger.take_carried(carrier);
        assert!(matches!(carrier.confirmed, Confirmed::Delivered), "{:?}", carrier.confirmed);
        assert!(matches!(ledger.credit("7", carrier.confirmed), Confirmed::Delivered));
        match ledger.credit("9", Confirmed::Delivered) {
            Confirmed::Unroutable(r) => assert_eq!(r, reply("9")),
            other => panic!("9 was returned: {other:?}"),
        }
        // Credited once: a later publish of 9 that is delivered reads delivered.
        assert!(matches!(ledger.credit("9", Confirmed::Delivered), Confirmed::Delivered));
    }

    #[test]
    fn a_publish_that_carries_its_own_return_reads_it() {
        let mut ledger = Returns::default();
        let (own, _) = read("7", Confirmed::Unroutable(reply("7")));
        let own = ledger.take_carried(own);
        match ledger.credit("7", own.confirmed) {
            Confirmed::Unroutable(r) => assert_eq!(r, reply("7")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_nack_carrying_another_return_stays_a_nack_and_credits_the_return() {
        let mut ledger = Returns::default();
        let (carrier, _) = read("7", Confirmed::Nacked(Some(reply("9"))));
        let carrier = ledger.take_carried(carrier);
        assert!(matches!(carrier.confirmed, Confirmed::Nacked(None)));
        assert!(matches!(ledger.credit("9", Confirmed::Delivered), Confirmed::Unroutable(_)));
    }
}
