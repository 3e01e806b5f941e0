//! The `actix-outbox` binary, run as an operator runs it: the real executable, a fresh database
//! per test, the real RabbitMQ (a uniquely named exchange and queue per test, deleted at the
//! end). Every test checks the exit code, what was printed, and the rows afterwards.
//!
//! One module per command, as the banners of the old single file had them; the helpers they
//! share are in `common`.

// `crate::proxy::Proxy`, the fault proxy in front of the broker or the database.
use actix_outbox_test_support::proxy;

mod common;

mod dead;
mod docs;
mod enqueue;
mod erase;
mod fifo;
mod grey;
mod migrate;
mod pooler;
mod purge;
mod run;
mod serve;
mod stats;
mod unreachable;
mod usage;
