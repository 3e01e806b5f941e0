//! The per-delivery work of a lane: one transaction (order check, inbox row, handler) and the
//! loop around it that holds a delivery while the database is out and decides, from the
//! outcome, whether it is acknowledged, retried or dead-lettered.

use std::borrow::Cow;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use super::config::{InboxConfig, LateEvents};
use super::delivery::{Job, Settled};
use super::handler::{FailureClass, HandlerError, InboxHandler};
use super::message::InboxMessage;
use super::metrics::Counters;
use super::settle::{Forward, ack, forward, requeue};
use super::shared::Shared;
use super::store::{self, AggregateOrder};
use crate::backoff::half_jitter;

/// Once a shutdown started, how much longer a delivery may wait for a pooled connection before
/// it is given back to the broker (a healthy pool answers far sooner; a dead database would
/// otherwise hold the shutdown for the pool's whole checkout timeout).
const DRAIN_CHECKOUT_GRACE: Duration = Duration::from_secs(2);

/// What a lane's run of one job produced.
pub(super) enum Processed {
    Settled(Settled),
    /// A retryable failure with attempts left: republish after `delay` (off the lane).
    Retry {
        job: Box<Job>,
        delay: Duration,
        reason: String,
    },
}

/// How one attempt ended.
pub(crate) enum Attempt {
    /// Committed (or nothing to commit): acknowledge.
    Done(Settled),
    /// The database did not answer (or the inbox's own statements failed): hold and try again.
    Outage(String),
    /// The handler failed (rolled back); `panicked`: by a panic.
    Failed { reason: String, retryable: bool, panicked: bool },
}

/// Why the handler did not finish, noted inside the transaction.
enum HandlerFailure {
    Error(HandlerError),
    Panic(String),
    TimedOut,
}

/// Runs one delivery to its end on its lane: attempts (held and repeated while the database is
/// out), then acknowledges, dead-letters, or hands back a retry.
pub(super) async fn process(shared: Arc<Shared>, job: Job, mut drain: watch::Receiver<bool>) -> Processed {
    let config = &shared.config;
    let mut outages = 0_i32;
    loop {
        if !job.envelope.acker.usable() {
            debug!("delivery's channel is gone; the broker delivers it again");
            return Processed::Settled(Settled::Abandoned);
        }
        if *drain.borrow() && shared.database_out.load(Ordering::Relaxed) {
            requeue(&job.envelope.acker).await;
            return Processed::Settled(Settled::Requeued);
        }
        match attempt(&shared, &job.message, &drain).await {
            Attempt::Done(settled) => {
                shared.database_out.store(false, Ordering::Relaxed);
                if settled == Settled::LateSkipped {
                    info!(aggregate_type = %job.message.aggregate_type, aggregate_id = %job.message.aggregate_id,
                        "late message skipped: a newer message of its aggregate was applied first");
                }
                ack(&job.envelope.acker).await;
                return Processed::Settled(settled);
            }
            Attempt::Outage(reason) => {
                Counters::add(&shared.counters.outage_waits, 1);
                shared.database_out.store(true, Ordering::Relaxed);
                if *drain.borrow() {
                    warn!(reason = %reason, "database unavailable during shutdown; giving the delivery back");
                    requeue(&job.envelope.acker).await;
                    return Processed::Settled(Settled::Requeued);
                }
                let delay = half_jitter(outages, config.outage_backoff_min, config.outage_backoff_max);
                outages = outages.saturating_add(1);
                warn!(reason = %reason, retry_in = ?delay,
                    "database unavailable; holding the delivery and trying again (no attempt spent)");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = drain.changed() => {}
                }
            }
            Attempt::Failed { reason, retryable, .. } => {
                let attempt = job.message.attempt;
                if retryable && attempt < config.max_attempts {
                    let delay = crate::backoff::full_jitter(
                        i32::try_from(attempt - 1).unwrap_or(i32::MAX),
                        config.retry_base,
                        config.retry_cap,
                    );
                    return Processed::Retry { job: Box::new(job), delay, reason };
                }
                let reason = if retryable {
                    format!("retries exhausted after {attempt} attempts; last error: {reason}")
                } else {
                    format!("permanent failure on attempt {attempt}: {reason}")
                };
                warn!(reason = %reason, "dead-lettering the message");
                let settled =
                    forward(&shared, &job.envelope, &job.message.body, Forward::DeadLetter(&reason), drain).await;
                return Processed::Settled(settled);
            }
        }
    }
}

/// One transaction: the order check (ordered consumers), the inbox row, and — for a new
/// message that is not a skipped late one — the handler. Commits only if all of it succeeded.
async fn attempt(shared: &Shared, message: &InboxMessage, drain: &watch::Receiver<bool>) -> Attempt {
    let config = &shared.config;
    let mut draining = drain.clone();
    let checkout = tokio::select! {
        checkout = shared.pool.checkout() => checkout,
        () = async {
            let _ = draining.wait_for(|draining| *draining).await;
            tokio::time::sleep(DRAIN_CHECKOUT_GRACE).await;
        } => return Attempt::Outage("no database connection during shutdown".into()),
    };
    let mut conn = match checkout {
        Ok(conn) => conn,
        Err(e) => return Attempt::Outage(e.to_string()),
    };
    let attempt = transact(&mut conn, config, &*shared.handler, message, &shared.pool).await;
    if let Attempt::Failed { panicked: true, .. } = attempt {
        Counters::add(&shared.counters.panics, 1);
    }
    attempt
}

/// The transaction of one attempt on `conn`, classified. The consumer's lanes and the test
/// kit's `deliver` both run a message through here.
///
/// A connection that went silent without closing would hold its delivery for ever, so the
/// database gets the query timeout of `pool` (the pool `conn` came from) to answer the inbox's
/// own part of the transaction (`BEGIN`, the order check and the inbox row; then the commit or
/// the rollback), and the handler its own timeout (plus that, for the statement it may be in):
/// past it, the connection is given up (the pool then tries its other connections before it
/// hands them out) and the attempt is an outage (the delivery is held and tried again).
pub(crate) async fn transact(
    conn: &mut diesel_async::AsyncPgConnection,
    config: &InboxConfig,
    handler: &dyn InboxHandler,
    message: &InboxMessage,
    pool: &crate::store::PgPool,
) -> Attempt {
    let query_timeout = pool.query_timeout();
    let consumer = config.consumer.as_str();
    let mut failure: Option<HandlerFailure> = None;
    let failure_slot = &mut failure;
    // Until when the part of the transaction under way may wait for the database, moved on as
    // it goes from our statements to the handler and back.
    let phase = Phase::new(query_timeout);
    let phase = &phase;
    // A transaction the server ends by itself (releasing the inbox row's lock) if the link goes
    // silent for longer than the handler may take: the next try of the message, on another
    // connection, would otherwise wait for that lock for ever.
    let idle = config.handler_timeout + query_timeout;
    let transaction = crate::store::in_transaction_idle(conn, idle, async |c| {
        let mut newest = None;
        if config.ordered && message.has_aggregate() {
            let order =
                store::advance_aggregate(c, consumer, store::AggregateRef::of(message), message.message_id).await?;
            if let AggregateOrder::Late { newest: n } = order {
                newest = Some(n);
            }
        }
        let message: Cow<'_, InboxMessage> = match newest {
            None => Cow::Borrowed(message),
            Some(n) => {
                let mut late = message.clone();
                late.late = true;
                late.newest_applied = Some(n);
                Cow::Owned(late)
            }
        };
        if !store::record(c, consumer, &message).await? {
            return Ok(Settled::Duplicate);
        }
        if message.late && config.late_events == LateEvents::Skip {
            return Ok(Settled::LateSkipped);
        }
        // The handler is called inside the guarded future, so that a panic while building
        // its future is caught as well as one while polling it.
        let call = AssertUnwindSafe(async { handler.handle(c, &message).await }).catch_unwind();
        phase.allow(config.handler_timeout + query_timeout);
        let called = tokio::time::timeout(config.handler_timeout, call).await;
        // The commit or the rollback: one statement's answer.
        phase.allow(query_timeout);
        match called {
            Ok(Ok(Ok(()))) => Ok(if message.late { Settled::LateFlagged } else { Settled::Handled }),
            Ok(Ok(Err(e))) => {
                *failure_slot = Some(HandlerFailure::Error(e));
                Err(diesel::result::Error::RollbackTransaction)
            }
            Ok(Err(panic)) => {
                *failure_slot = Some(HandlerFailure::Panic(panic_text(&*panic)));
                Err(diesel::result::Error::RollbackTransaction)
            }
            Err(_) => {
                *failure_slot = Some(HandlerFailure::TimedOut);
                Err(diesel::result::Error::RollbackTransaction)
            }
        }
    });
    // Dropping a transaction that did not finish drops its connection (the pool discards a
    // connection left inside a transaction, or in the middle of its COMMIT): nothing it did
    // commits, unless its COMMIT had gone out, in which case the next try finds the message
    // recorded.
    let Some(result) = phase.watch(transaction).await else {
        crate::store::abandon(conn);
        let silent = crate::error::StoreError::NoAnswer { server: pool.server(), waited: query_timeout };
        pool.learn(&silent);
        return Attempt::Outage(silent.to_string());
    };
    match (result, failure) {
        (Ok(settled), _) => Attempt::Done(settled),
        (Err(_), Some(HandlerFailure::Error(e))) => match e.class() {
            FailureClass::Outage => Attempt::Outage(format!("the handler lost its connection: {e}")),
            FailureClass::Retryable => Attempt::Failed { reason: e.to_string(), retryable: true, panicked: false },
            FailureClass::Permanent => Attempt::Failed { reason: e.to_string(), retryable: false, panicked: false },
        },
        (Err(_), Some(HandlerFailure::Panic(why))) => {
            error!(panic = %why, "inbox handler panicked; rolled back, retried like a retryable failure");
            Attempt::Failed { reason: format!("handler panicked: {why}"), retryable: true, panicked: true }
        }
        (Err(_), Some(HandlerFailure::TimedOut)) => Attempt::Failed {
            reason: format!("handler timed out after {}", humantime::format_duration(config.handler_timeout)),
            retryable: true,
            panicked: false,
        },
        // Our own statements (or the commit) failed: the database, not the message, is at fault.
        (Err(e), None) => Attempt::Outage(format!("inbox transaction failed: {e}")),
    }
}

/// Until when the part of a transaction under way may wait for the database: a deadline that
/// the transaction moves on as it goes from one part to the next, and that [`Phase::watch`]
/// holds it to.
struct Phase {
    started: tokio::time::Instant,
    /// Milliseconds from `started`.
    until: std::sync::atomic::AtomicU64,
}

impl Phase {
    /// A deadline `first` from now.
    fn new(first: Duration) -> Self {
        let phase = Phase { started: tokio::time::Instant::now(), until: Default::default() };
        phase.allow(first);
        phase
    }

    /// The part starting now may take `d`.
    fn allow(&self, d: Duration) {
        let until = self.started.elapsed() + d;
        self.until.store(until.as_millis() as u64, Ordering::Relaxed);
    }

    fn deadline(&self) -> tokio::time::Instant {
        self.started + Duration::from_millis(self.until.load(Ordering::Relaxed))
    }

    /// `work`'s output, or `None` once a part of it outlived its deadline.
    async fn watch<T>(&self, work: impl std::future::Future<Output = T>) -> Option<T> {
        let mut work = std::pin::pin!(work);
        loop {
            let deadline = self.deadline();
            tokio::select! {
                out = &mut work => return Some(out),
                () = tokio::time::sleep_until(deadline) => {
                    // The deadline may have moved on meanwhile.
                    if tokio::time::Instant::now() >= self.deadline() {
                        return None;
                    }
                }
            }
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}
