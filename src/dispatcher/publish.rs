//! `PublishActor`: one per claimed message. Calls the sink outside any transaction, bounded by
//! the publish timeout; turns a panic into a crash report; hands the outcome to the finalizer.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use actix::prelude::*;
use futures_util::FutureExt;
use tracing::{Instrument, debug, error, info_span};

use super::finalize::{Fenced, Finalize, FinalizeActor, Heartbeat};
use super::shared::Shared;
use crate::error::PublishError;
use crate::metrics::Metrics;
use crate::model::OutboxMessage;
use crate::step::decide;

/// Sent to the claim actor when a message no longer counts against its in-flight window.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub(crate) struct PublishFinished;

pub(crate) struct PublishActor {
    message: Arc<OutboxMessage>,
    shared: Arc<Shared>,
    finalizer: Addr<FinalizeActor>,
    owner: Recipient<PublishFinished>,
}

impl std::fmt::Debug for PublishActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishActor").field("id", &self.message.id).finish()
    }
}

impl PublishActor {
    pub(crate) fn new(
        message: OutboxMessage,
        shared: Arc<Shared>,
        finalizer: Addr<FinalizeActor>,
        owner: Recipient<PublishFinished>,
    ) -> Self {
        Self { message: Arc::new(message), shared, finalizer, owner }
    }
}

/// How the sink call ended.
enum Attempt {
    Finished(Result<(), PublishError>),
    /// The sink panicked: we do not know whether the message left.
    Crashed(String),
}

impl Actor for PublishActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let message = self.message.clone();
        let span = info_span!("publish", outbox_id = message.id, lease_version = message.lease_version,
            attempt = message.attempts, event_type = %message.event_type);

        // A sink slower than a third of the lease keeps its claim alive (fenced). When the
        // publish timeout ends every publish before that mark (the default: 10 s against 20 s),
        // no heartbeat could ever fire, so the timer is not armed at all: one timer less per
        // message. A heartbeat after the publish ended would buy nothing either: the outcome
        // is already queued at the finalizer, which applies it before any later heartbeat.
        let heartbeat_every = self.shared.config.lease / 3;
        if self.shared.config.publish_timeout >= heartbeat_every {
            let fence = message.fence();
            ctx.run_interval(heartbeat_every, move |act, _| act.finalizer.do_send(Heartbeat(fence)));
        }

        let shared = self.shared.clone();
        let finalizer = self.finalizer.clone();
        let owner = self.owner.clone();
        let work = async move {
            let timeout = shared.config.publish_timeout;
            // The sink is called inside the guarded future, so a panic while building its
            // future is caught as well as one while polling it.
            let call = {
                let (publisher, message) = (shared.publisher.clone(), message.clone());
                async move { publisher.publish(message).await }
            };
            let attempt = match AssertUnwindSafe(tokio::time::timeout(timeout, call)).catch_unwind().await {
                Ok(Ok(result)) => Attempt::Finished(result),
                Ok(Err(_)) => Attempt::Finished(Err(PublishError::Retryable(format!(
                    "publish timed out after {}",
                    humantime::format_duration(timeout)
                )))),
                Err(panic) => Attempt::Crashed(panic_text(&*panic)),
            };
            match attempt {
                Attempt::Crashed(why) => {
                    Metrics::add(&shared.metrics.publish_crashes, 1);
                    error!(panic = %why, "sink panicked; the row stays processing until its lease expires");
                }
                Attempt::Finished(result) => {
                    if result.is_ok() {
                        Metrics::add(&shared.metrics.published, 1);
                    }
                    debug!(outcome = ?result, "published");
                    let step = decide(&message, &result, &shared.config);
                    match finalizer.send(Finalize(step)).await {
                        Ok(Fenced::Won | Fenced::Lost | Fenced::Failed) => {}
                        Err(e) => error!(error = %e, "finalizer unavailable; the row waits for lease expiry"),
                    }
                }
            }
            owner.do_send(PublishFinished);
        }
        .instrument(span);
        ctx.spawn(work.into_actor(self).map(|(), _, ctx| ctx.stop()));
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}
