//! # actix-outbox
//!
//! A transactional-outbox dispatcher for actix applications: it moves rows that a service wrote
//! to a PostgreSQL `outbox` table, in the same transaction as its business change, to a sink
//! (RabbitMQ, or any [`Publisher`]), with many workers in many processes, without losing a row
//! and without letting a stale worker overwrite a newer one's state.
//!
//! ## How a row travels
//!
//! ```text
//!  producer tx ──INSERT──▶ outbox (pending)
//!                              │  ClaimActor: one short statement reaps, then leases a batch:
//!                              ▼  status=processing, lease_until=now()+lease, lease_version+1, attempts+1
//!                          processing ──▶ PublishActor (one per message, no transaction open)
//!                              │                 │  sink outcome: Ok / Retryable / Permanent / Defer / panic
//!                              ▼                 ▼
//!                          FinalizeActor: batched fenced UPDATE ... WHERE id, status='processing', lease_version
//!                              │
//!              done ◀──────────┼──────────▶ pending (backoff / deferral)   dead (exhausted, permanent, reaped)
//! ```
//!
//! Correctness rests on the fencing token `lease_version`: a worker whose lease was taken over
//! updates 0 rows and logs a lost lease. Delivery is at-least-once; a message's identity is the
//! pair of its row id (the AMQP `message_id`) and its outbox ([`wire::SOURCE`],
//! `x-outbox-source`), the same on every attempt and unique across producer databases:
//! consumers deduplicate on the pair ([`wire`](crate::wire#message-identity); the `inbox`
//! feature does it for them).
//!
//! ## What is where
//!
//! - The crate root: what an application uses. Start a dispatcher ([`OutboxSupervisor`],
//!   [`DispatcherConfig`]), write events in the business transaction ([`NewEvent`],
//!   [`enqueue`]), set the database up ([`migrate`], [`connect_pool`]), plug a sink in
//!   ([`Publisher`], [`OutboxMessage`], [`PublishError`]).
//! - [`dispatcher`]: the messages the supervisor answers ([`Shutdown`](dispatcher::Shutdown),
//!   [`GetHealth`](dispatcher::GetHealth), ...).
//! - [`sink`]: the sinks that ship with the crate ([`RabbitSink`](sink::RabbitSink),
//!   [`ChannelSink`](sink::ChannelSink), [`ActorPublisher`](sink::ActorPublisher)) and what a
//!   sink of one's own returns.
//! - [`admin`]: what the `actix-outbox` command line does, from Rust: one-off connections,
//!   migrations and checks, the table's counts, dead rows and their repair.
//! - [`schema`] (the table, for Diesel queries of one's own) and [`wire`] (the message format).
//! - `inbox`, with the `inbox` feature: the consumer side, one effect per message.
//! - `testkit`, with the `testkit` feature: for an application's own tests, a throwaway
//!   database, a recording sink, a drain until idle, and inbox delivery without a broker.
//! - `testing`, with the `test-util` feature: the claim protocol and crash hooks, for tests and
//!   drills; not covered by semver.
//!
//! Inside, three layers: the store (`src/store/`: the schema, models and every SQL statement;
//! it knows no actor and no sink), the sinks (they know no database), and the actors (the
//! supervisor and its claim, publish and finalize actors) that connect the two.
//!
//! ## Example
//!
//! ```no_run
//! use actix_outbox::dispatcher::Shutdown;
//! use actix_outbox::sink::ChannelSink;
//! use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor};
//! use diesel_async::AsyncConnection;
//!
//! #[actix::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let url = "postgres://root@127.0.0.1:5432/app";
//!     actix_outbox::migrate(url).await?;
//!     let pool = actix_outbox::connect_pool(url, 8).await?;
//!
//!     // A producer: the business write and its event commit together.
//!     let mut conn = pool.get().await?;
//!     conn.transaction(async |tx| {
//!         actix_outbox::enqueue(tx, &NewEvent::new("order", "42", "order.created", serde_json::json!({"total": 10}))).await
//!     })
//!     .await?;
//!     drop(conn);
//!
//!     let (sink, mut published) = ChannelSink::new();
//!     let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink)?;
//!     let message = published.recv().await.unwrap();
//!     println!("published outbox id {}", message.id);
//!     dispatcher.send(Shutdown).await?;
//!     Ok(())
//! }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations, rust_2018_idioms)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod amqp;
mod backoff;
mod config;
pub mod dispatcher;
mod error;
#[cfg(feature = "inbox")]
pub mod inbox;
mod lifecycle;
mod metrics;
mod model;
mod publisher;
/// The `outbox` table as Diesel sees it, for queries of an application's own (reports,
/// joins with business tables). Its columns are part of the crate's interface: they change
/// only with a migration and a major version.
#[allow(missing_docs)]
pub mod schema;
pub mod sink;
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
mod step;
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;
#[cfg(feature = "opentelemetry")]
mod trace;
mod url;
pub mod wire;

// The dispatcher and its configuration.
pub use config::{ConfigError, DispatcherConfig, Fifo, Retention};
pub use dispatcher::supervisor::OutboxSupervisor;
pub use metrics::MetricsSnapshot;
// The producer's side.
pub use model::{NewEvent, OutboxMessage};
pub use store::{enqueue, enqueue_many, enqueue_ordered, lock_aggregate};
// The database.
pub use store::{PgPool, PoolConfig, Pooler, connect_pool, migrate};
pub use url::{ConnectionString, InvalidConnectionString};
// The publish step and its outcome; the errors.
pub use error::{Error, PublishError, StoreError};
pub use publisher::{PublishResult, Publisher};

/// Setting up and operating an outbox database from Rust: what the `actix-outbox` command line
/// does (create the database, check and apply migrations, show the table, repair dead rows,
/// purge), for applications that do the same (an admin page, a health check, a scheduled
/// purge, a `main` that migrates before the actix system starts).
///
/// The queries take a connection (from [`connect`](crate::admin::connect), or a pooled one),
/// so each can run inside the caller's transaction. None of them touches a row that is
/// `processing`.
pub mod admin {
    pub use crate::error::EraseError;
    pub use crate::model::{OutboxRow, Status, UnknownStatus};
    pub use crate::store::{
        BlockedAggregate, Erasure, MIGRATIONS, Overview, PurgeStretch, SKIPPED_PREFIX, Stats, blocked_aggregates,
        blocked_aggregates_count, check_connection, connect, dead_available_at, dead_list, dead_retry, dead_retry_all,
        dead_skip, ensure_database, ensure_fifo_index, ensure_schema, erase, migrate_blocking, outbox_schemas,
        outbox_source, overview, pending_migrations, purge_done, purge_done_batch, stats,
    };
}

/// The claim and finalize protocol itself, and hooks that crash actors on request: for the
/// crate's own tests, for drills, and for tools that inspect the claim (`fifo-explain` in the workspace's `tools/`).
/// Behind the `test-util` feature; nothing here is covered by semver.
#[cfg(feature = "test-util")]
pub mod testing {
    pub use crate::dispatcher::supervisor::{CrashFinalizer, CrashWorker};
    pub use crate::step::{Step, decide};
    pub use crate::store::{
        AggregateKey, BadSnapshot, Bury, Claim, ClaimParams, Cursor, HeadsScan, Position, Reschedule, Rescheduled,
        Snapshot, SweepParams, Swept, Taken, claim, claim_plan, delete_done, explain_claim, extend_leases, horizon,
        mark_dead, mark_done, release_unanswered, reschedule, settled, sweep,
    };

    /// The inbox's crash hook and its SQL (recording a message, the per-aggregate high-water
    /// mark), for tests of the inbox's guarantees.
    #[cfg(feature = "inbox")]
    pub mod inbox {
        pub use crate::inbox::store::{
            AggregateOrder, AggregateRef, advance_aggregate, is_recorded, last_applied, record,
        };
        pub use crate::inbox::supervisor::CrashConsumer;
    }
}

/// The README's Rust blocks, compiled by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
