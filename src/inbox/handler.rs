//! The user's side of the consumer: [`InboxHandler`] and how it reports failure
//! ([`HandlerError`], classified by [`HandlerError::class`]).

use diesel_async::AsyncPgConnection;
use futures_util::future::BoxFuture;

use super::message::InboxMessage;

/// What a consumer does with each new message.
///
/// `handle` runs inside the transaction that records the message in the inbox: every statement
/// it runs on `conn` commits together with the inbox row, or not at all. It is called once per
/// message id and consumer for each *committed* effect; an attempt that fails, panics or times
/// out is rolled back and its effect with it. Effects outside `conn` (an HTTP call, an e-mail)
/// are not covered: they happen at least once per attempt.
///
/// Do not commit or roll back `conn` yourself, and do not keep it: it goes back to the pool.
///
/// The future is boxed ([`BoxFuture`](super::BoxFuture), re-exported from `futures_util`)
/// rather than an `async fn`, so that the trait stays object-safe (an `Arc<dyn InboxHandler>`
/// serves several consumers) and its future is known to be `Send`, which the consumer's lanes
/// need. A closure is the shorter way: [`handler_fn`].
///
/// ```
/// use actix_outbox::inbox::{BoxFuture, HandlerError, InboxHandler, InboxMessage};
/// use diesel_async::{AsyncPgConnection, RunQueryDsl};
///
/// struct CountOrders;
///
/// impl InboxHandler for CountOrders {
///     fn handle<'a>(
///         &'a self,
///         conn: &'a mut AsyncPgConnection,
///         message: &'a InboxMessage,
///     ) -> BoxFuture<'a, Result<(), HandlerError>> {
///         Box::pin(async move {
///             if message.event_type != "order.created" {
///                 return Ok(()); // recorded in the inbox, nothing else to do
///             }
///             let total = message.payload.as_ref().and_then(|p| p["total"].as_i64())
///                 .ok_or_else(|| HandlerError::permanent("order.created without a total"))?;
///             diesel::sql_query("UPDATE order_stats SET orders = orders + 1, total = total + $1")
///                 .bind::<diesel::sql_types::BigInt, _>(total)
///                 .execute(conn)
///                 .await?; // a failed statement is a HandlerError::Database
///             Ok(())
///         })
///     }
/// }
/// ```
pub trait InboxHandler: Send + Sync + 'static {
    /// Applies `message` on `conn`, inside the inbox's transaction.
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        message: &'a InboxMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// A shared handler: one value behind several supervisors (or kept by the application too).
impl<H: InboxHandler> InboxHandler for std::sync::Arc<H> {
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        message: &'a InboxMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        (**self).handle(conn, message)
    }
}

/// An [`InboxHandler`] made of a closure; see [`handler_fn`].
pub struct FnHandler<F>(F);

impl<F> std::fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnHandler")
    }
}

/// A handler from a closure that returns a boxed future:
///
/// ```
/// use actix_outbox::inbox::{HandlerError, handler_fn};
///
/// let handler = handler_fn(|_conn, message| {
///     Box::pin(async move {
///         if message.payload.is_none() {
///             return Err(HandlerError::permanent("this consumer takes JSON bodies only"));
///         }
///         Ok(())
///     })
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F>(f: F) -> FnHandler<F>
where
    F: for<'a> Fn(&'a mut AsyncPgConnection, &'a InboxMessage) -> BoxFuture<'a, Result<(), HandlerError>>
        + Send
        + Sync
        + 'static,
{
    FnHandler(f)
}

impl<F> InboxHandler for FnHandler<F>
where
    F: for<'a> Fn(&'a mut AsyncPgConnection, &'a InboxMessage) -> BoxFuture<'a, Result<(), HandlerError>>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        message: &'a InboxMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        (self.0)(conn, message)
    }
}

/// Why a handler did not apply a message. Whatever the variant, the transaction is rolled
/// back: neither the handler's writes nor the inbox row remain.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// A failure that may heal (a dependency is down, a lock timed out): the message is tried
    /// again after a backoff, and dead-lettered once its attempts reach the configured maximum.
    #[error("retryable: {0}")]
    Retryable(String),
    /// A failure that will not heal (invalid payload, a business rule refuses it): the message
    /// is dead-lettered at once.
    #[error("permanent: {0}")]
    Permanent(String),
    /// A statement the handler ran failed. A lost connection is an outage, not the message's
    /// fault: the consumer pauses and tries the same delivery again once the database answers,
    /// without spending an attempt. Any other database error is retryable.
    #[error("database: {0}")]
    Database(#[from] diesel::result::Error),
}

/// What the consumer does about a failed attempt; see [`HandlerError::class`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureClass {
    /// Try again after a backoff, spending an attempt; dead-letter when they are exhausted.
    Retryable,
    /// Dead-letter now.
    Permanent,
    /// The database is unreachable: hold the delivery, wait, and try it again without spending
    /// an attempt (consumption pauses until the database answers).
    Outage,
}

impl HandlerError {
    /// [`HandlerError::Retryable`] with `reason`.
    pub fn retryable(reason: impl std::fmt::Display) -> Self {
        HandlerError::Retryable(reason.to_string())
    }

    /// [`HandlerError::Permanent`] with `reason`.
    pub fn permanent(reason: impl std::fmt::Display) -> Self {
        HandlerError::Permanent(reason.to_string())
    }

    /// What the consumer does about this failure.
    pub fn class(&self) -> FailureClass {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        match self {
            HandlerError::Retryable(_) => FailureClass::Retryable,
            HandlerError::Permanent(_) => FailureClass::Permanent,
            HandlerError::Database(e) => match e {
                E::DatabaseError(K::ClosedConnection | K::UnableToSendCommand, _) | E::BrokenTransactionManager => {
                    FailureClass::Outage
                }
                _ => FailureClass::Retryable,
            },
        }
    }

    /// Whether the message is tried again (after a backoff, or once the database is back).
    pub fn will_retry(&self) -> bool {
        match self.class() {
            FailureClass::Retryable | FailureClass::Outage => true,
            FailureClass::Permanent => false,
        }
    }

    /// Whether this failure spends one of the message's attempts.
    pub fn spends_attempt(&self) -> bool {
        match self.class() {
            FailureClass::Retryable | FailureClass::Permanent => true,
            FailureClass::Outage => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use diesel::result::{DatabaseErrorKind, Error as E};

    use super::*;

    #[test]
    fn classifies() {
        assert_eq!(HandlerError::retryable("x").class(), FailureClass::Retryable);
        assert_eq!(HandlerError::permanent("x").class(), FailureClass::Permanent);
        let closed = E::DatabaseError(DatabaseErrorKind::ClosedConnection, Box::new("gone".to_owned()));
        let closed = HandlerError::from(closed);
        assert_eq!(closed.class(), FailureClass::Outage);
        assert!(closed.will_retry() && !closed.spends_attempt());
        let unique = E::DatabaseError(DatabaseErrorKind::UniqueViolation, Box::new("dup".to_owned()));
        assert_eq!(HandlerError::from(unique).class(), FailureClass::Retryable);
        assert!(!HandlerError::permanent("x").will_retry());
        assert_eq!(HandlerError::from(E::NotFound).class(), FailureClass::Retryable);
    }
}
