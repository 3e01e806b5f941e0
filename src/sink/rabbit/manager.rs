//! The connection manager: on the sink's link thread, it connects (to each node of a cluster in
//! turn), enables confirms, declares the exchange and the bound queues, watches the link and
//! rebuilds it when lost.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Event};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::link::{Link, LinkState};
use super::{RabbitConfig, RabbitError};
use super::{binding, confirms};
use crate::amqp::connection::Stop;
use crate::amqp::{Reconnect, connection_closer};
use crate::publisher::SinkState;

/// How often the connection manager looks at the connection's and channel's status, on top of
/// reacting at once to connection events and failed publishes. Catches a channel the broker
/// closed while nothing was being published.
const LINK_CHECK_PERIOD: Duration = Duration::from_millis(250);

/// Why a link stopped being watched.
enum Ended {
    /// The sink is stopping.
    Stop,
    /// The link broke; the reason is logged and shown to publishes until it is rebuilt.
    Broken(String),
    /// The broker stopped answering: the connection is dropped, not reused, even if it still
    /// looks connected.
    Silent(String),
}

/// The connection manager: runs on the sink's own thread and runtime.
pub(super) struct Manager {
    pub(super) config: RabbitConfig,
    /// Index (modulo the number of URLs) of the node the next new connection goes to.
    pub(super) next_node: usize,
    pub(super) link: Arc<LinkState>,
    pub(super) stop: Stop,
}

impl Manager {
    pub(super) async fn run(mut self, first: oneshot::Sender<Result<(), RabbitError>>) {
        let mut first = Some(first);
        let mut generation = 0_u64;
        let mut reconnect = Reconnect::new(self.config.reconnect_min, self.config.reconnect_max);
        let mut connection: Option<Arc<Connection>> = None;
        loop {
            let attempt = tokio::time::timeout(self.config.connect_timeout, self.establish(connection.take())).await;
            let attempt = attempt.unwrap_or_else(|_| {
                Err(RabbitError::Unreachable {
                    url: self.link.url(),
                    reason: format!(
                        "no answer within the connect timeout ({})",
                        humantime::format_duration(self.config.connect_timeout)
                    ),
                })
            });
            match attempt {
                Ok((conn, channel)) => {
                    generation += 1;
                    // The channel's desk lives on this thread until its link is dropped and its
                    // last publish answered.
                    let (desk, requests) = mpsc::unbounded_channel();
                    let prober = confirms::Prober::new(Arc::downgrade(&conn), self.link.exchange.clone());
                    let acked = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    tokio::spawn(confirms::run(channel.clone(), prober, requests, acked.clone()));
                    self.link.set_link(Link { desk, generation, acked });
                    if let Some(first) = first.take() {
                        info!(url = %self.link.url(), exchange = %self.link.exchange, "connected to RabbitMQ");
                        if first.send(Ok(())).is_err() {
                            // Whoever called connect() is gone: nobody will ever publish.
                            break self.shut(Some(conn)).await;
                        }
                    } else {
                        self.link.reconnects.fetch_add(1, Ordering::Relaxed);
                        info!(url = %self.link.url(), exchange = %self.link.exchange, "reconnected to RabbitMQ");
                    }
                    let since = Instant::now();
                    match self.watch(&conn, &channel, generation).await {
                        Ended::Stop => break self.shut(Some(conn)).await,
                        Ended::Silent(reason) => {
                            warn!(url = %self.link.url(), reason = %reason,
                                "RabbitMQ stopped answering; dropping the connection and reconnecting");
                            self.link.clear_link(format!("{reason} (reconnecting)"));
                            self.link.set_blocked(None);
                            let _ = connection_closer::bounded(conn.close(320, "unresponsive".into())).await;
                            drop(conn);
                        }
                        Ended::Broken(reason) => {
                            warn!(url = %self.link.url(), reason = %reason,
                                "RabbitMQ link lost; claiming pauses until it is back (nothing is spent meanwhile)");
                            self.link.clear_link(format!("{reason} (reconnecting)"));
                            self.link.set_blocked(None);
                            reconnect.lost_after(since.elapsed());
                            if channel.status().connected() {
                                let _ = connection_closer::bounded(channel.close(200, "replaced".into())).await;
                            }
                            // Only the channel may be gone: keep a healthy connection for the next channel.
                            if conn.status().connected() {
                                connection = Some(conn);
                            }
                        }
                    }
                }
                Err(e) => {
                    // The first connection tries every node of a cluster before `connect` fails.
                    if first.is_some() && e.is_transient() && self.next_node < self.config.urls.len() {
                        warn!(error = %e, "RabbitMQ node unreachable; trying the next one");
                        continue;
                    }
                    if let Some(first) = first.take() {
                        let _ = first.send(Err(e));
                        break self.shut(None).await;
                    }
                    warn!(error = %e, "reconnecting to RabbitMQ failed");
                    self.link.clear_link(format!("{e} (reconnecting)"));
                }
            }
            let delay = reconnect.next_delay();
            debug!(delay = ?delay, "waiting before reconnecting to RabbitMQ");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.stop.requested() => break self.shut(connection.take()).await,
            }
        }
    }

    /// A channel in confirm mode with the exchange and the bound queues declared, on `reuse` if
    /// it is still connected, else on a new connection. Declared on every new channel, so that
    /// a queue deleted while the link was down is there again.
    async fn establish(&mut self, reuse: Option<Arc<Connection>>) -> Result<(Arc<Connection>, Channel), RabbitError> {
        let conn = match reuse.filter(|c| c.status().connected()) {
            Some(conn) => conn,
            None => {
                // Each new connection goes to the next node of the cluster, in turn.
                let node = &self.config.urls[self.next_node % self.config.urls.len()];
                self.next_node += 1;
                self.link.set_url(node);
                let name = self.config.connection_name.as_deref().unwrap_or(&self.config.app_id);
                let properties = ConnectionProperties::default().with_connection_name(name.into());
                Arc::new(Connection::connect(node, properties).await.map_err(|e| connect_error(&self.link.url(), &e))?)
            }
        };
        let url = &self.link.url();
        let refused =
            |what: &str, e: lapin::Error| RabbitError::Refused { url: url.clone(), reason: format!("{what}: {e}") };
        let channel = conn.create_channel().await.map_err(|e| refused("opening a channel", e))?;
        channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| refused("enabling confirms", e))?;
        if self.config.declare_exchange {
            let options = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
            channel
                .exchange_declare(
                    self.link.exchange.clone(),
                    self.config.exchange_kind.clone(),
                    options,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| refused(&format!("declaring exchange {:?}", self.config.exchange), e))?;
        }
        binding::declare(&channel, &self.link.exchange, &self.config.bindings)
            .await
            .map_err(|reason| RabbitError::Refused { url: url.clone(), reason })?;
        Ok((conn, channel))
    }

    /// Waits until the link breaks or the sink stops.
    async fn watch(&mut self, conn: &Connection, channel: &Channel, generation: u64) -> Ended {
        let mut events = Box::pin(conn.events_listener());
        let mut check = tokio::time::interval(LINK_CHECK_PERIOD);
        loop {
            tokio::select! {
                () = self.stop.requested() => return Ended::Stop,
                () = self.link.broken_notify.notified() => {
                    if self.link.broken.load(Ordering::Acquire) >= generation {
                        return Ended::Broken("a publish failed on the channel".into());
                    }
                }
                event = events.next() => match event {
                    // lapin reports a channel the broker closed as an error of the connection:
                    // the prober's short-lived channel, closed by a 404 for an event's missing
                    // exchange, is one. Only the connection or the publishing channel breaks the link.
                    Some(Event::Error(e)) if conn.status().connected() && channel.status().connected() => {
                        debug!(error = %e, "a channel other than the publishing one was closed; the link stands");
                    }
                    Some(Event::Error(e)) => return Ended::Broken(format!("connection error: {e}")),
                    Some(Event::ConnectionBlocked(reason)) => {
                        warn!(reason = %reason, "RabbitMQ blocked the connection: publishes in flight wait for it, nothing new is claimed");
                        self.link.set_blocked(Some(reason.to_string()));
                    }
                    Some(Event::ConnectionUnblocked) => {
                        info!("RabbitMQ unblocked the connection");
                        self.link.set_blocked(None);
                    }
                    Some(_) => {}
                    None => return Ended::Broken("connection event stream ended".into()),
                },
                _ = check.tick() => {
                    if !conn.status().connected() {
                        return Ended::Broken(format!("connection is no longer connected: {:?}", conn.status()));
                    }
                    if !channel.status().connected() {
                        return Ended::Broken(format!("channel is no longer open: {:?}", channel.status()));
                    }
                    if let SinkState::Down(why) = self.link.state() {
                        return Ended::Silent(why);
                    }
                }
            }
        }
    }

    /// Closes the connection (if any) and tells publishes that the sink is over; the thread
    /// tells `close()` once this returns.
    async fn shut(&self, connection: Option<Arc<Connection>>) {
        self.link.clear_link("the RabbitMQ sink is closed".into());
        if let Some(conn) = connection {
            connection_closer::close_gracefully(&conn, "RabbitMQ connection").await;
        }
    }
}

/// Classifies a failed connection attempt: I/O trouble means nobody answered; a protocol error
/// means a broker answered and said no.
fn connect_error(url: &str, e: &lapin::Error) -> RabbitError {
    if e.is_amqp_error() {
        RabbitError::Refused { url: url.to_owned(), reason: e.to_string() }
    } else {
        RabbitError::Unreachable { url: url.to_owned(), reason: e.to_string() }
    }
}
