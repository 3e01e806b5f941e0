//! Integration tests against the real PostgreSQL (and RabbitMQ for the sink). One binary, one
//! module per area; every test gets a database of its own, so the suite runs in parallel.

// The fixtures (databases, brokers, the fault proxy) are actix-outbox-test-support's, shared
// with the command line's tests and the chaos run.
use actix_outbox_test_support::proxy;

mod actors;
mod alone;
mod cluster;
mod connect;
mod erase;
mod failover;
mod fifo;
mod fleet;
mod grey;
mod guide;
mod horizon;
mod inbox;
mod metrics;
mod model;
mod outage;
mod pace;
mod pooler;
mod producers;
mod queues;
mod rabbit;
mod retention;
mod roles;
mod routing;
mod scheduled;
mod startup;
mod store;
mod tenants;
mod testkit;
#[cfg(feature = "opentelemetry")]
mod trace;
mod web;
mod window;
