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
//! updates 0 rows and logs a lost lease. Delivery is at-least-once; every message carries its
//! outbox id so that consumers deduplicate.
//!
//! ## Layers
//! - [`store`]: the schema, models and every SQL statement; knows no actor and no sink.
//! - [`sink`]: publishers; know no database.
//! - the actors ([`OutboxSupervisor`] and its claim, publish and finalize actors) connect the two.
//!
//! ## Example
//!
//! ```no_run
//! use actix_outbox::{ChannelSink, DispatcherConfig, NewEvent, OutboxSupervisor, Shutdown};
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

mod backoff;
pub mod config;
mod dispatcher;
mod error;
pub mod inbox;
mod metrics;
mod model;
mod publisher;
#[allow(missing_docs)]
pub mod schema;
pub mod sink;
mod step;
pub mod store;
#[cfg(feature = "opentelemetry")]
mod trace;
mod url;

pub use backoff::{backoff_ceiling, full_jitter};
pub use config::{ConfigError, DispatcherConfig, Fifo, default_owner};
#[doc(hidden)]
pub use dispatcher::{CrashFinalizer, CrashWorker};
pub use dispatcher::{GetMetrics, OutboxSupervisor, Shutdown, WakeWorkers};
pub use error::{Error, PublishError, StoreError};
pub use metrics::MetricsSnapshot;
pub use model::{Fence, NewEvent, OutboxMessage, OutboxRow, Status, UnknownStatus};
pub use publisher::{ActorPublisher, Publish, PublishFuture, PublishResult, Publisher, SinkState};
pub use sink::{ChannelSink, RabbitConfig, RabbitError, RabbitSink, SinkAction};
pub use step::{Step, decide};
pub use store::{
    BlockedAggregate, MIGRATIONS, PgPool, blocked_aggregates, blocked_aggregates_count, check_connection, connect_pool,
    enqueue, enqueue_many, enqueue_ordered, ensure_database, lock_aggregate, migrate, migrate_blocking,
};
pub use url::{ConnectionString, InvalidConnectionString, mask_url};
