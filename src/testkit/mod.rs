//! Testing a service that uses the outbox: what an application's own tests need, against a real
//! PostgreSQL and without a broker. Behind the `testkit` feature, which a service enables in its
//! dev-dependencies only:
//!
//! ```toml
//! [dev-dependencies]
//! actix-outbox = { version = "0.1", features = ["testkit"] }
//! ```
//!
//! Unlike the crate's internal hooks, this module is covered by semver.
//!
//! - [`TestDatabase`]: a throwaway, migrated database per test, created on the server of
//!   `TEST_DATABASE_URL` ([`TestDatabase::from_env`], default
//!   `postgres://root@127.0.0.1:5432/postgres`) or of a URL, with the application's own
//!   migrations or setup ([`TestDatabaseOptions`]), and dropped when the test ends, retrying
//!   while the server is crowded; [`drop_stale_databases`] removes those a killed run left.
//! - [`MemorySink`]: a [`Publisher`](crate::Publisher) that records every message and answers
//!   what the test tells it to, per event type: success, a retryable or permanent failure, an
//!   unavailable sink, a deferral.
//! - [`drain_until_idle`] (and [`Drain`] to tune it): runs a real dispatcher, with every
//!   guarantee of production (claims, leases, fenced finalizes, backoff), until nothing is left
//!   to publish, stops it, and reports the table ([`Drained`], with
//!   [`assert_no_dead`](Drained::assert_no_dead)).
//! - With the `inbox` feature, [`deliver`]: hands one message to an inbox handler the way the
//!   consumer of a name (or a [`TestConsumer`] with settings) does (one transaction with the
//!   inbox row; a second copy is a duplicate), without a broker, and [`inbox_message`] turns a
//!   message the sink recorded into the message a consumer would receive.
//!
//! A test of an HTTP handler that writes an event, end to end:
//!
//! ```no_run
//! use actix_outbox::NewEvent;
//! use actix_outbox::testkit::{MemorySink, TestDatabase, drain_until_idle};
//! use diesel_async::AsyncConnection;
//!
//! #[actix::test]
//! async fn placing_an_order_publishes_order_placed() {
//!     // TEST_DATABASE_URL, else postgres://root@127.0.0.1:5432/postgres
//!     let db = TestDatabase::from_env().await.unwrap();
//!
//!     // What the code under test does: its business write and its event, in one transaction.
//!     let mut conn = db.pool().get().await.unwrap();
//!     let event = NewEvent::new("order", "7", "order.placed", serde_json::json!({"total": 12}));
//!     conn.transaction(async |tx| actix_outbox::enqueue(tx, &event).await).await.unwrap();
//!     drop(conn);
//!
//!     let sink = MemorySink::new();
//!     drain_until_idle(db.pool(), sink.clone()).await.unwrap().assert_no_dead();
//!     sink.assert_published("order.placed", 1);
//!     assert_eq!(sink.published_of("order.placed")[0].aggregate_id, "7");
//! }
//! ```
//!
//! The dispatcher is an actix actor: these functions run inside an actix system, so tests use
//! `#[actix::test]` (or `#[actix_rt::test]`, or `#[actix_web::test]`), not `#[tokio::test]`.
//!
//! docs/testing.md (in the package) tests an actix-web handler end to end, failures, a
//! scheduled event and a consumer, and says how databases left behind are told apart.

mod database;
mod drain;
#[cfg(feature = "inbox")]
mod inbox;
mod sink;
mod stale;

pub use database::{TestDatabase, TestDatabaseOptions};
pub use drain::{Drain, DrainError, Drained, drain_until_idle};
#[cfg(feature = "inbox")]
pub use inbox::{Delivered, TestConsumer, deliver, inbox_message};
pub use sink::{MemorySink, SinkCall};
pub use stale::drop_stale_databases;
