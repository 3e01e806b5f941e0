//! The consumer side: an inbox that turns the dispatcher's at-least-once delivery into exactly
//! one effect per message, for services that consume from RabbitMQ into PostgreSQL. Behind the
//! `inbox` feature (`actix-outbox = { version = "0.1", features = ["inbox"] }`): a service that
//! only produces does not compile it.
//!
//! ```text
//!  RabbitMQ queue ──delivery──▶ InboxConsumer (lane by aggregate, prefetch window, manual acks)
//!                                   │  BEGIN
//!                                   │    INSERT INTO inbox (consumer, message_id) ON CONFLICT DO NOTHING
//!                                   │    new? ──▶ handler(conn, message)      duplicate? ──▶ nothing
//!                                   │  COMMIT
//!                                   ▼
//!                                 basic.ack
//! ```
//!
//! # The guarantee
//!
//! For each consumer name and message id (the AMQP `message_id`, which the outbox's sink sets to
//! the outbox id), the handler's writes on the connection it is given commit **once**: together
//! with the message's inbox row, in one transaction, or not at all. The delivery is acknowledged
//! only after that commit. A crash anywhere before the commit rolls everything back and the
//! broker delivers the message again; a crash after it makes the next copy a duplicate, which is
//! acknowledged without calling the handler. Two copies handled at the same moment (on two
//! consumers of the queue) take turns on the inbox row's primary key: the second waits for the
//! first's transaction and then sees a duplicate.
//!
//! Its limits: effects outside the transaction (HTTP calls, e-mails, other databases) happen at
//! least once per attempt; an inbox row removed by [`purge_inbox`] no longer recognises later
//! copies; two consumer names are two inboxes. [`erase_aggregate`] blanks an aggregate's
//! strings but keeps the rows' keys, so it does not weaken this.
//!
//! # Failures
//!
//! [`HandlerError`] (see [`HandlerError::class`]); whatever happens, the transaction is rolled
//! back first:
//!
//! | outcome | what the consumer does |
//! | --- | --- |
//! | `Ok(())` | commit, acknowledge |
//! | duplicate (inbox row already there) | acknowledge, handler not called |
//! | [`HandlerError::Retryable`], any database error of the handler but a lost connection, a handler timeout, a **panic** | another attempt after a full-jitter backoff, dead-lettered once `max_attempts` are spent |
//! | [`HandlerError::Permanent`] | dead-lettered at once |
//! | the database does not answer (checkout, the inbox's own statements, commit, or the handler's lost connection) | the delivery is held and tried again after a backoff (100 ms doubling to 5 s by default), no attempt spent |
//! | no usable message id | dead-lettered at once, never handled |
//!
//! **Retries are counted in the message.** A failed attempt waits its backoff (holding its
//! delivery, off its lane), then republishes a copy of the message to the same queue through the
//! default exchange with `x-inbox-attempt` one higher (and `x-inbox-last-error`), and only once
//! the broker confirmed that copy acknowledges the original. The count therefore survives
//! restarts, reconnects and other consumers, and works on classic and quorum queues alike. What
//! it costs: a publish and a confirm per retry; the copy goes to the back of the queue (an
//! ordered consumer may then find it late); while it waits, a delivery takes a prefetch slot;
//! and if the link drops between the copy's confirm and the original's acknowledgement, both
//! copies exist: the inbox still applies the message once, but it may get an attempt more. The
//! alternative, a quorum queue's `x-delivery-count` with `nack`-and-requeue, needs quorum
//! queues, cannot wait before the redelivery without holding the message anyway, and counts
//! every redelivery (a consumer crash, a lost connection) as a failed attempt; but it does catch
//! a message that kills the whole process, which a per-message header cannot: set a quorum
//! queue's `delivery-limit` on top of this if handlers can abort the process.
//!
//! **Dead letters** are published, confirmed, to the dead-letter exchange (default
//! `<queue>.dlx`, direct, bound to the dead-letter queue `<queue>.dlq` with the consumed queue's
//! name as routing key; the consumer declares both unless told not to), with every original
//! property and header plus `x-inbox-error` (the reason), `x-inbox-attempt`,
//! `x-inbox-consumer`, `x-inbox-queue`, `x-inbox-exchange` and `x-inbox-routing-key`; then the
//! original is acknowledged. A copy the broker refuses (nobody bound, nack) is held and tried
//! again, never dropped; nothing is retried at full speed.
//!
//! **A panicking handler** does not kill the actor: the call is wrapped in `catch_unwind`, the
//! transaction rolled back, and the attempt counted as a retryable failure (so a message that
//! always panics ends in the dead-letter queue with `handler panicked: …`). A panic elsewhere in
//! the consumer actor kills the actor; its supervisor replaces it within 200 ms.
//!
//! **Outages.** A lost broker connection ends the consumer stream: the consumer makes a new
//! connection after a backoff (100 ms doubling to 10 s by default), and the broker delivers
//! again everything that was not acknowledged. A database that does not answer holds each
//! delivery where it is: the prefetch window fills, the broker stops sending, and consumption
//! resumes by itself when the database answers.
//!
//! # Order
//!
//! With [`InboxConfig::ordered`], the consumer keeps the highest message id applied per
//! `(consumer, aggregate_type, aggregate_id)` (table `inbox_aggregates`, updated in the same
//! transaction) and notices a message older than one already applied. Outbox ids increase per
//! aggregate when producers use the FIFO gate. [`LateEvents`] says what happens to a late
//! message: recorded and skipped (acknowledged, handler not called), or handed to the handler
//! with [`InboxMessage::late`] set. Messages of one aggregate always go to the same lane of a
//! consumer, so that its own concurrency never reorders them.
//!
//! # Shutdown
//!
//! [`Shutdown`] cancels the consumer, finishes the deliveries in hand (commit, acknowledge),
//! closes the connection and answers; see its docs.
//!
//! # Layout
//!
//! - `config`: [`InboxConfig`], [`LateEvents`], [`InboxError`];
//! - `handler`: [`InboxHandler`], [`HandlerError`], [`FailureClass`], [`handler_fn`];
//! - `message`: [`InboxMessage`] and the header names;
//! - `store`: the migrations ([`migrate_inbox`]) and the SQL, on [`schema`];
//! - `supervisor`: [`InboxSupervisor`] and its messages;
//! - `consumer`: the consumer actor; `link`: its broker connection, on a thread of its own.
//! - `attempt`: one delivery's transaction and the loop around it; `settle`: how a delivery
//!   leaves our hands (acknowledged, given back, forwarded);
//! - `delivery`: a delivery in hand and how it was settled, and `shared`: what the consumer
//!   actors share; both are named by the consumer, the attempt and the settling alike.
//!
//! `examples/inbox_consumer.rs` is a complete consumer.

pub(crate) mod attempt;
mod config;
mod consumer;
pub(crate) mod delivery;
mod handler;
mod link;
mod message;
mod metrics;
#[allow(missing_docs)]
pub mod schema;
mod settle;
mod shared;
// The SQL of the inbox; `testing::inbox` shows it to the crate's tests (feature `test-util`).
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
pub(crate) mod store;
pub(crate) mod supervisor;

pub use config::{InboxConfig, InboxError, LateEvents};
/// The boxed future [`InboxHandler::handle`] returns (`futures_util`'s), re-exported so that a
/// handler needs no dependency of its own for it.
pub use futures_util::future::BoxFuture;
pub use handler::{FailureClass, FnHandler, HandlerError, InboxHandler, handler_fn};
pub use message::{
    ATTEMPT_HEADER, CONSUMER_HEADER, ERROR_HEADER, EXCHANGE_HEADER, InboxMessage, LAST_ERROR_HEADER, QUEUE_HEADER,
    ROUTING_KEY_HEADER,
};
pub use metrics::InboxMetrics;
pub use store::{
    INBOX_MIGRATIONS, InboxErasure, erase_aggregate, has_inbox_tables, migrate_inbox, migrate_inbox_blocking,
    pending_inbox_migrations, purge_inbox,
};
pub use supervisor::{GetMetrics, InboxSupervisor, Shutdown};
