//! The bench's own connections to its database in the steady phases, and how the meters tell
//! them apart from the relay's: each is named (`application_name`) for what it does, and each
//! counts the transactions it commits, so that the database's commit counter can be split into
//! the relay's, the producers' and the bench's.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use diesel_async::{AsyncConnection, AsyncPgConnection};

use crate::BoxError;

/// The name every connection of the bench's own starts with: the sampling and holding ones
/// (and the parent's), whose backends are neither the relay's nor the producers'.
pub(super) const BENCH_APP: &str = "outbox-bench";
/// The producers' connections (the bench's, and pgbench's clients through `PGAPPNAME`).
pub(super) const PRODUCER_APP: &str = "outbox-bench-producer";

/// `url` (no query string) with `application_name=app`.
pub(super) fn named(url: &str, app: &str) -> String {
    format!("{url}?application_name={app}")
}

/// A connection of the bench's own that counts its statements, each its own transaction.
pub(super) struct BenchConn {
    conn: AsyncPgConnection,
    xacts: Arc<AtomicU64>,
}

impl BenchConn {
    /// Connects to `url` as `outbox-bench-<role>`, counting into `xacts`.
    pub(super) async fn connect(url: &str, role: &str, xacts: Arc<AtomicU64>) -> Result<Self, BoxError> {
        let conn = AsyncPgConnection::establish(&named(url, &format!("{BENCH_APP}-{role}"))).await?;
        // diesel-async sets the time zone and the encoding on a new connection: two statements.
        xacts.fetch_add(2, Ordering::Relaxed);
        Ok(Self { conn, xacts })
    }

    /// The connection, for one statement (one autocommitted transaction).
    pub(super) fn one(&mut self) -> &mut AsyncPgConnection {
        self.count();
        &mut self.conn
    }

    /// The connection, for statements inside a transaction the caller opens and then counts
    /// with [`BenchConn::count`].
    pub(super) fn uncounted(&mut self) -> &mut AsyncPgConnection {
        &mut self.conn
    }

    /// Counts one transaction.
    pub(super) fn count(&self) {
        self.xacts.fetch_add(1, Ordering::Relaxed);
    }
}
