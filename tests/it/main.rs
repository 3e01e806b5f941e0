//! Integration tests against the real PostgreSQL (and RabbitMQ for the sink). One binary, one
//! module per area; every test gets a database of its own, so the suite runs in parallel.

use actix_outbox_test_support::proxy;
mod support;

mod actors;
mod connect;
mod fifo;
mod inbox;
mod metrics;
mod model;
mod outage;
mod producers;
mod rabbit;
mod store;
#[cfg(feature = "opentelemetry")]
mod trace;
mod web;
