//! `InboxSupervisor`: owns the configuration, the pool and the handler; starts the consumer
//! actor, replaces it when it dies, reports metrics and runs the shutdown protocol.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::config::{InboxConfig, InboxError};
#[cfg(feature = "test-util")]
use super::consumer::Crash;
use super::consumer::{Drain, InboxConsumer};
use super::handler::InboxHandler;
use super::metrics::{Counters, InboxMetrics};
use super::shared::Shared;
use crate::store::PgPool;

/// How often the supervisor checks that its consumer is alive.
const WATCHDOG_PERIOD: Duration = Duration::from_millis(200);

/// The inbox consumer: register it in an actix application and it applies each message of the
/// queue once, through `handler`, until it is shut down.
///
/// It starts one consumer actor on the current arbiter; the actor's broker connection lives on
/// a thread of its own (so that no arbiter's end can strand it) and reconnects by itself. An
/// actor that dies (a bug, or a drill) is replaced within 200 ms; what it held unacknowledged
/// comes back from the broker, and the inbox makes every copy of a committed message a
/// duplicate. A handler that panics does not kill the actor: see the [module docs](super).
///
/// ```no_run
/// use actix_outbox::inbox::{self, HandlerError, InboxConfig, InboxSupervisor, handler_fn};
///
/// #[actix::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let url = "postgres://root@127.0.0.1:5432/billing";
///     inbox::migrate_inbox(url).await?;
///     let pool = actix_outbox::connect_pool(url, 8).await?;
///     let config = InboxConfig::new("billing", "amqp://guest:guest@127.0.0.1:5672/%2f", "billing.events");
///     let handler = handler_fn(|_conn, message| {
///         Box::pin(async move {
///             println!("{} {}", message.message_id, message.event_type);
///             Ok::<(), HandlerError>(())
///         })
///     });
///     let consumer = InboxSupervisor::start(config, pool, handler)?;
///     // ... until the application stops:
///     consumer.send(inbox::Shutdown).await?;
///     Ok(())
/// }
/// ```
pub struct InboxSupervisor {
    shared: Arc<Shared>,
    consumer: Option<Addr<InboxConsumer>>,
    state: State,
    shutdown_waiters: Vec<oneshot::Sender<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Draining,
    Stopped,
}

impl std::fmt::Debug for InboxSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxSupervisor")
            .field("consumer", &self.shared.config.consumer)
            .field("queue", &self.shared.config.queue)
            .field("state", &self.state)
            .finish()
    }
}

impl InboxSupervisor {
    /// A supervisor for `config`, recording through `pool` and applying with `handler`. Fails if
    /// the configuration is invalid; nothing connects until the actor starts.
    pub fn new(config: InboxConfig, pool: PgPool, handler: impl InboxHandler) -> Result<Self, InboxError> {
        config.validate()?;
        let handler = Arc::new(handler);
        let shared = Arc::new(Shared {
            config,
            pool,
            handler,
            counters: Counters::default(),
            database_out: AtomicBool::new(false),
        });
        Ok(Self { shared, consumer: None, state: State::Running, shutdown_waiters: Vec::new() })
    }

    /// [`InboxSupervisor::new`], started on the current arbiter.
    pub fn start(config: InboxConfig, pool: PgPool, handler: impl InboxHandler) -> Result<Addr<Self>, InboxError> {
        Ok(Self::new(config, pool, handler)?.start())
    }

    fn watchdog(&mut self) {
        if self.state != State::Running {
            return;
        }
        if self.consumer.as_ref().is_some_and(Addr::connected) {
            return;
        }
        error!(consumer = %self.shared.config.consumer,
            "inbox consumer actor died; restarting it (what it held comes back from the broker)");
        Counters::add(&self.shared.counters.restarts, 1);
        self.shared.counters.set_connected(false);
        self.consumer = Some(InboxConsumer::new(self.shared.clone()).start());
    }
}

impl Actor for InboxSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if crate::lifecycle::system_gone() {
            ctx.stop();
            return;
        }
        let config = &self.shared.config;
        info!(consumer = %config.consumer, queue = %config.queue, prefetch = config.prefetch,
            concurrency = config.concurrency, max_attempts = config.max_attempts, ordered = config.ordered,
            dead_letter_exchange = %config.dead_letter_exchange_name(), "inbox consumer starting");
        self.consumer = Some(InboxConsumer::new(self.shared.clone()).start());
        ctx.run_interval(WATCHDOG_PERIOD, |act, _| act.watchdog());
    }
}

/// Ask for the consumer's counters.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "InboxMetrics")]
pub struct GetMetrics;

impl Handler<GetMetrics> for InboxSupervisor {
    type Result = MessageResult<GetMetrics>;

    fn handle(&mut self, _: GetMetrics, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.shared.counters.snapshot())
    }
}

/// Graceful shutdown: cancel the consumer (`basic.cancel`), finish every delivery already
/// received — handled, committed and acknowledged, or forwarded — close the broker connection,
/// then answer. A delivery whose database is unreachable at that point is given back to the
/// broker (`nack` with requeue) rather than waited for; a retry waiting for its delay is
/// republished at once.
///
/// Safe to send more than once: later requests wait for the same drain, or answer at once when
/// it is over. The supervisor stays alive afterwards to answer [`GetMetrics`].
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Handler<Shutdown> for InboxSupervisor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Shutdown, ctx: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        match self.state {
            State::Stopped => {
                let _ = tx.send(());
            }
            State::Draining => self.shutdown_waiters.push(tx),
            State::Running => {
                self.state = State::Draining;
                self.shutdown_waiters.push(tx);
                let drained = self.consumer.clone().map(|consumer| consumer.send(Drain));
                let drained = async move {
                    if let Some(drained) = drained
                        && let Err(e) = drained.await
                    {
                        warn!(error = %e, "the inbox consumer died while draining; the broker redelivers what it held");
                    }
                };
                ctx.spawn(drained.into_actor(self).map(|(), act, _| {
                    act.state = State::Stopped;
                    info!(metrics = ?act.shared.counters.snapshot(), "inbox consumer shut down");
                    for waiter in act.shutdown_waiters.drain(..) {
                        let _ = waiter.send(());
                    }
                }));
            }
        }
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

/// Makes the consumer actor panic, so that tests and drills can watch the supervisor replace
/// it. Not for production use.
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct CrashConsumer;

#[cfg(feature = "test-util")]
impl Handler<CrashConsumer> for InboxSupervisor {
    type Result = ();

    fn handle(&mut self, _: CrashConsumer, _: &mut Context<Self>) {
        if let Some(consumer) = &self.consumer {
            consumer.do_send(Crash);
        }
    }
}
