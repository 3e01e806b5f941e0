//! Fixtures shared by the library's integration tests (`tests/it`), the command line's tests
//! (`cli/tests/cli`) and the chaos run (`chaos/`), so that all of them set up and fault the
//! services through one implementation.
//!
//! - [`db`]: databases of their own on the test server ([`TestDb`], [`ScratchDb`]) and helpers
//!   to read rows back.
//! - [`broker`]: the test's own exchange and queues on the test broker ([`TestBroker`]).
//! - [`proxy::Proxy`]: a TCP proxy in front of PostgreSQL or RabbitMQ that cuts, refuses,
//!   blackholes, delays and slows its connections, and plays RabbitMQ's `connection.blocked`.
//! - [`pgbouncer::PgBouncer`]: a PgBouncer of the test's own in transaction pooling mode.
//! - [`standby::ReplicatedPair`]: a primary and its streaming standby, both the test's own, to
//!   fail over from one to the other.
//! - [`cluster::RabbitCluster`]: three RabbitMQ nodes of the test's own, clustered, to kill,
//!   stop and restart (as the `rabbitmq` user, from Debian's `rabbitmq-server` package).
//!
//! PgBouncer and the pair start servers of their own as the `postgres` user (`runuser`, so the tests run
//! as root): PgBouncer from `/usr/sbin/pgbouncer`, PostgreSQL 15's server programs from
//! `/usr/lib/postgresql/15/bin` (Debian's packages `pgbouncer` and `postgresql-15`).
//!
//! Two environment variables say where the services are:
//!
//! - `TEST_DATABASE_URL`: the PostgreSQL server, as a URL or a `key=value` connection string;
//!   default `postgres://root@127.0.0.1:5432/test`. Its own database is never touched: each test
//!   creates a database of its own on that server (through the server's `postgres` database,
//!   with every other option of the string), so the role must be allowed to create databases.
//! - `TEST_AMQP_URL`: the RabbitMQ broker; default `amqp://guest:guest@127.0.0.1:5672/%2f`.
//!   Each test declares exchanges and queues of its own, uniquely named.
//!
//! Everything a test creates is removed when its fixture is dropped, even by a panic.
//!
//! Tests wait for conditions with [`eventually`], whose closure reports what it saw
//! ([`saw`]): a deadline sized for a slow host ([`PATIENCE`]) that, when it runs out, says
//! what was last seen.

#![warn(missing_docs)]

pub mod broker;
pub mod cluster;
pub mod db;
pub mod pgbouncer;
mod process;
pub mod proxy;
pub mod standby;

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub use broker::{TestBroker, amqp_addr, amqp_url};
pub use cluster::RabbitCluster;
pub use db::{ScratchDb, TestDb, database_addr, database_exists, database_url};
pub use pgbouncer::PgBouncer;
pub use standby::{ReplicatedPair, Replication};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// `outbox_it.<what>.<pid>.<n>.<random>`: unique across tests and concurrent runs.
pub fn unique(what: &str) -> String {
    format!("outbox_it.{what}.{}.{}.{:08x}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed), rand_suffix())
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    (h.finish() & 0xffff_ffff) as u32
}

/// How long a test waits for a condition by default: what a loaded two-core CI host (the
/// suite four tests at a time, a build beside it) needs with room to spare. A wait costs its
/// deadline only when it fails, so it is sized for the slowest host, not the usual one.
pub const PATIENCE: Duration = Duration::from_secs(120);

/// What one look at a condition saw: whether it holds, and what to report when a wait for it
/// runs out. Made by [`saw`]; a bare `bool` converts too, reporting nothing.
#[derive(Debug, Clone)]
pub struct Seen {
    met: bool,
    seen: Option<String>,
}

/// `value`, seen, and whether `met` holds of it: the closure of [`eventually`] returns this,
/// so that a wait that runs out says what it last saw (`saw(db.count_status("done").await,
/// |n| *n == 300)` reports the count).
pub fn saw<T: std::fmt::Debug>(value: T, met: impl FnOnce(&T) -> bool) -> Seen {
    Seen { met: met(&value), seen: Some(format!("{value:?}")) }
}

impl Seen {
    /// Whether the condition held.
    pub fn met(&self) -> bool {
        self.met
    }
}

/// For a check that reports nothing (its wait's message says so): prefer [`saw`].
impl From<bool> for Seen {
    fn from(met: bool) -> Seen {
        Seen { met, seen: None }
    }
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.seen {
            Some(seen) => write!(f, "last seen: {seen}"),
            None => write!(f, "the check reports nothing it saw (have it return `saw(..)`)"),
        }
    }
}

/// Polls `check` until what it saw meets its condition, failing the test after `within` with
/// `what` and the last thing seen. A deadline, not a measure: size it for a slow host
/// ([`PATIENCE`]); a test that asserts a time asserts it separately.
pub async fn eventually<F, Fut, S>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = S>,
    S: Into<Seen>,
{
    let deadline = Instant::now() + within;
    loop {
        let look = check().await.into();
        if look.met {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for: {what}; {look}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
