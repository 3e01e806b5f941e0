//! Deadlines on the database's answers: no statement of the crate waits for ever.
//!
//! A link can go silent without closing: a frozen VM, a storage stall, a NAT or load balancer
//! that dropped its state, a hung pooler. The kernel of whatever is at the other end may even
//! keep acknowledging bytes, so TCP keepalives and a user timeout (which [`super::open`] sets
//! too, for a peer that is really gone) see nothing wrong, and a statement on that link would
//! wait for an answer that never comes, holding its caller (a claim, the finalizer, a shutdown)
//! with it. So every unit of work the crate runs is bounded by the pool's query timeout
//! ([`PoolConfig::query_timeout`](crate::PoolConfig::query_timeout)). Past it:
//!
//! - the connection is given up: its transaction state is marked broken, so the pool drops it
//!   instead of handing it to the next caller (a query future dropped outside a transaction
//!   would otherwise leave a connection that looks idle and healthy, on the silent link);
//! - the server is asked, on a connection of its own, to cancel the statement, so that a
//!   statement that is only slow (or waits on a lock) does not go on running for nobody;
//! - the caller gets [`StoreError::NoAnswer`], transient, naming the server (password masked)
//!   and how long it waited. The statement may have committed before the silence: callers treat
//!   it as a connection lost mid-statement (a claim's rows are handed back, a finalize reads its
//!   rows back).

use std::time::Duration;

use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};

use super::io;
use crate::error::StoreError;
use crate::url::ConnectionString;

/// How long the crate waits for the database's answer to one unit of work, by default.
pub(crate) const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a cancel request may take before it is given up in turn.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `f` on `conn`, waiting at most `limit` for it; past it, gives `conn` up (see the
/// module's docs) and fails with [`StoreError::NoAnswer`] about `server`.
pub(crate) async fn within<T, E>(
    conn: &mut AsyncPgConnection,
    limit: Duration,
    server: &ConnectionString,
    f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<StoreError>,
{
    match tokio::time::timeout(limit, f(conn)).await {
        Ok(result) => result,
        Err(_elapsed) => {
            abandon(conn);
            Err(StoreError::NoAnswer { server: server.to_string(), waited: limit }.into())
        }
    }
}

/// Marks `conn` broken, so that a pool drops it rather than reuse it, and asks the server to
/// cancel whatever it still runs for it. The connection itself closes when its owner drops it.
pub(crate) fn abandon(conn: &mut AsyncPgConnection) {
    AnsiTransactionManager::transaction_manager_status_mut(conn).set_in_error();
    let cancel = conn.cancel_token();
    // The cancel request opens a connection of its own (the silent one cannot carry it); it
    // runs beside the caller, which has waited long enough.
    io::detach(async move {
        let _ = tokio::time::timeout(CANCEL_TIMEOUT, cancel.cancel_query(tokio_postgres::NoTls)).await;
    });
}
