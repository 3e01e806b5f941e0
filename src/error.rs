//! Errors, one enum per layer, each classified by what the caller should do.

use std::error::Error as StdError;

use diesel_async::pooled_connection::bb8::RunError;

use crate::config::ConfigError;
use crate::url::{InvalidConnectionString, with_causes};

/// A cause kept whole: its type depends on where the failure happened.
type Cause = Box<dyn StdError + Send + Sync>;

/// `{:?}` of the crate's errors is their message, causes included, as `{}` prints it: what a
/// `main` returning `Result<(), Box<dyn Error>>` prints after `Error: `, and what `unwrap()`
/// and `expect()` print in a failed test. `{:#?}` names the type and shows the source chain as
/// the sources' own `Debug` writes it, for a look inside.
macro_rules! readable_debug {
    ($($error:ty),* $(,)?) => {$(
        impl std::fmt::Debug for $error {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                if f.alternate() {
                    let source = std::error::Error::source(self);
                    f.debug_struct(stringify!($error))
                        .field("message", &self.to_string())
                        .field("source", &source)
                        .finish()
                } else {
                    std::fmt::Display::fmt(self, f)
                }
            }
        }
    )*};
}
pub(crate) use readable_debug;

readable_debug!(StoreError, EraseError, Error);

/// A failure of the store (PostgreSQL or its pool).
///
/// Each message includes its cause's, so a log line that prints the error (`{e}`, or `{e:?}`,
/// which prints the same) says everything, the server's own words included (`database
/// connection failed: db error: FATAL: role "app" does not exist`); `source()` gives the cause
/// itself to callers that inspect it (for instance, the `tokio_postgres::Error` of a refused
/// connection, with its SQLSTATE). `{e:#?}` shows the variant's source chain as the sources'
/// `Debug` writes it.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No connection could be checked out of the pool in time: the database is unreachable, or
    /// every connection is busy. The pool keeps trying to open connections in the background.
    #[error("database unreachable: {}", pool_reason(.0))]
    Pool(#[source] RunError),
    /// A connection could not be established. The cause is the driver's error (refused,
    /// unknown database, authentication failed...) or the timeout's.
    #[error("database connection failed: {}", with_causes(.0.as_ref()))]
    Connect(#[source] Cause),
    /// A statement failed.
    #[error("database query failed: {0}")]
    Query(diesel::result::Error),
    /// The database did not answer within the pool's query timeout
    /// ([`PoolConfig::query_timeout`](crate::PoolConfig::query_timeout)): a link that went
    /// silent without closing (a frozen VM, a storage stall, a NAT or load balancer that
    /// dropped its state, a hung pooler), or a statement slower than the timeout. The
    /// connection was given up (never returned to the pool) and the server asked to cancel the
    /// statement. The statement may still have committed: the dispatcher treats it as it
    /// treats a connection lost mid-statement. Transient.
    #[error(
        "database at {server} did not answer within {}: the connection was dropped (a frozen or silent link, a          stalled server or storage, or a statement slower than the query timeout)",
        humantime::format_duration(*waited)
    )]
    NoAnswer {
        /// The connection string of the silent connection, password masked.
        server: String,
        /// How long it waited for the answer.
        waited: std::time::Duration,
    },
    /// A statement failed because the prepared statement it ran on was missing, or its name
    /// was taken, on the server connection it reached: what a transaction pooler (PgBouncer in
    /// `pool_mode = transaction`) does to a client that keeps statements prepared from one
    /// transaction to the next. Configure the pool for the pooler
    /// ([`Pooler::Transaction`](crate::Pooler::Transaction)), or connect to the server directly.
    /// Retrying may succeed (the next statement gets another name), so it counts as transient.
    #[error(
        "database query failed: {0}: the connection seems to go through a transaction pooler (PgBouncer with \
         pool_mode = transaction), which keeps no prepared statement from one transaction to the next; \
         configure the pool for it (PoolConfig::pooler(Pooler::Transaction), `--pooler transaction`) or connect \
         to the server directly"
    )]
    BehindTransactionPooler(diesel::result::Error),
    /// Work that holds a session of its own (the FIFO gate's index build, which takes a session
    /// lock and runs `CREATE INDEX CONCURRENTLY`) was asked of a pool behind a transaction pooler
    /// that has no direct URL ([`PoolConfig::direct_url`](crate::PoolConfig::direct_url)).
    #[error(
        "{what} needs a session of its own, which a transaction pooler does not give: give the pool a direct URL to \
         the server (PoolConfig::direct_url, `--direct-url`)"
    )]
    NeedsSession {
        /// What was asked, and what else would do.
        what: &'static str,
    },
    /// An event that could never be published was refused before it was written: its own
    /// routing key or exchange ([`NewEvent::routing_key`](crate::NewEvent::routing_key),
    /// [`NewEvent::exchange`](crate::NewEvent::exchange)) is one AMQP or RabbitMQ does not accept.
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// A migration failed (the harness's error), or its thread did (the join error).
    #[error("migration failed: {}", with_causes(.0.as_ref()))]
    Migration(#[source] Cause),
    /// The database the migrations were to go into does not exist (the server answered SQLSTATE
    /// 3D000). [`ensure_database`](crate::admin::ensure_database) creates it; `actix-outbox migrate`
    /// does both.
    #[error(
        "database {database:?} does not exist: create it first with `actix_outbox::admin::ensure_database(url)` \
         (`actix-outbox migrate` creates it and migrates)"
    )]
    NoDatabase {
        /// The database the connection string names.
        database: String,
    },
    /// A connection string that cannot be used (passwords masked in the message).
    #[error(transparent)]
    BadUrl(#[from] InvalidConnectionString),
    /// A function that must run inside the caller's transaction was called outside one (the
    /// name says which); nothing was written.
    #[error("{0} must be called inside a transaction: its lock would be released before the insert commits")]
    OutsideTransaction(&'static str),
    /// The database has no `outbox` table: it was never migrated (or the connection's
    /// `search_path` does not reach the table).
    #[error(
        "database {database:?} has no outbox table: run `actix-outbox migrate` (or `actix_outbox::migrate`) against it first"
    )]
    NoOutboxTable {
        /// The database that was connected to.
        database: String,
    },
    /// The outbox's source name cannot be derived: the role may not call
    /// `pg_control_system()`, which gives the cluster's system identifier.
    #[error(
        "cannot derive the outbox's source name on database {database:?}: this role may not call pg_control_system(); \
         set the source by hand (DispatcherConfig::source, `run --source`)"
    )]
    NoSystemIdentifier {
        /// The database that was connected to.
        database: String,
    },
}

fn pool_reason(e: &RunError) -> String {
    match e {
        RunError::User(e) => e.to_string(),
        RunError::TimedOut => "timed out waiting for a connection from the pool".into(),
    }
}

impl StoreError {
    /// Whether the database has no `outbox` table (it was never migrated): a
    /// [`StoreError::NoOutboxTable`], or a statement that failed on the missing relation.
    pub fn is_missing_outbox(&self) -> bool {
        match self {
            StoreError::NoOutboxTable { .. } => true,
            StoreError::Query(diesel::result::Error::DatabaseError(_, info)) => {
                info.message() == r#"relation "outbox" does not exist"#
            }
            _ => false,
        }
    }

    /// Whether the database refused a write because it is read-only (SQLSTATE 25006,
    /// `read_only_sql_transaction`): a standby (hot standby refuses every write until it is
    /// promoted), or a server or role with `default_transaction_read_only`. Transient (a
    /// promotion ends it), but not the message's fault and not an unreachable database: the
    /// dispatcher spends no attempt, claims nothing until writes work, and says the connection
    /// string should reach the primary.
    pub fn is_read_only(&self) -> bool {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        match self {
            StoreError::Query(E::DatabaseError(K::ReadOnlyTransaction, _)) => true,
            StoreError::Query(_)
            | StoreError::Pool(_)
            | StoreError::NoAnswer { .. }
            | StoreError::Connect(_)
            | StoreError::Migration(_)
            | StoreError::NoDatabase { .. }
            | StoreError::BadUrl(_)
            | StoreError::OutsideTransaction(_)
            | StoreError::NoOutboxTable { .. }
            | StoreError::NoSystemIdentifier { .. }
            | StoreError::BehindTransactionPooler(_)
            | StoreError::InvalidEvent(_)
            | StoreError::NeedsSession { .. } => false,
        }
    }

    /// Whether trying again later may succeed (the database was unreachable or read-only, or the
    /// statement lost a race), as opposed to a bug or bad input that will fail the same way again.
    pub fn is_transient(&self) -> bool {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        match self {
            StoreError::Pool(_)
            | StoreError::Connect(_)
            | StoreError::NoAnswer { .. }
            | StoreError::BehindTransactionPooler(_) => true,
            StoreError::Query(e) => match e {
                // diesel-async reports a connection that died mid-statement as
                // `UnableToSendCommand` ("connection closed"): the next checkout gets a new one.
                E::DatabaseError(kind, _) => matches!(
                    kind,
                    K::SerializationFailure | K::ClosedConnection | K::UnableToSendCommand | K::ReadOnlyTransaction
                ),
                E::BrokenTransactionManager => true,
                _ => false,
            },
            StoreError::Migration(_)
            | StoreError::NoDatabase { .. }
            | StoreError::BadUrl(_)
            | StoreError::OutsideTransaction(_)
            | StoreError::NoOutboxTable { .. }
            | StoreError::NoSystemIdentifier { .. }
            | StoreError::InvalidEvent(_)
            | StoreError::NeedsSession { .. } => false,
        }
    }
}

/// Why [`erase`](crate::admin::erase) erased nothing.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum EraseError {
    /// Rows of the aggregate are still `pending` or `processing`: deleting the published ones
    /// now would leave the unpublished ones to carry the data out later, so nothing was
    /// deleted. Wait until they are done and erase again; under the FIFO gate a dead head
    /// holds the aggregate's later rows back, so retry or skip it first.
    #[error(
        "the aggregate still has {pending} pending and {processing} processing rows, so nothing was erased: wait \
         until they are done and erase again (under the FIFO gate a dead head holds later rows back: retry or skip \
         it first)"
    )]
    InFlight {
        /// Rows waiting to be claimed.
        pending: u64,
        /// Rows a worker holds.
        processing: u64,
    },
    /// The store failed; the transaction was rolled back, nothing was deleted.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A failed statement, as [`StoreError`] classifies it.
impl From<diesel::result::Error> for EraseError {
    fn from(e: diesel::result::Error) -> Self {
        EraseError::Store(e.into())
    }
}

/// A failed statement: [`StoreError::BehindTransactionPooler`] when the server says a prepared
/// statement of the driver's (`s1`, `s2`, ...) is missing or already exists, which the crate's
/// own SQL never causes on a session of its own; [`StoreError::Query`] otherwise.
impl From<diesel::result::Error> for StoreError {
    fn from(e: diesel::result::Error) -> Self {
        if let diesel::result::Error::DatabaseError(_, info) = &e
            && is_lost_prepared_statement(info.message())
        {
            return StoreError::BehindTransactionPooler(e);
        }
        StoreError::Query(e)
    }
}

/// `prepared statement "s12" does not exist` (SQLSTATE 26000) or `... already exists` (42P05)
/// about a name of the driver's.
fn is_lost_prepared_statement(message: &str) -> bool {
    let Some(rest) = message.strip_prefix("prepared statement \"s") else { return false };
    let Some((number, tail)) = rest.split_once('"') else { return false };
    !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit())
        && matches!(tail, " does not exist" | " already exists")
}

impl From<diesel::ConnectionError> for StoreError {
    fn from(e: diesel::ConnectionError) -> Self {
        StoreError::Connect(Box::new(e))
    }
}

/// Pool checkouts: `pool.get().await?` in a function returning [`StoreError`].
impl From<RunError> for StoreError {
    fn from(e: RunError) -> Self {
        StoreError::Pool(e)
    }
}

/// What a sink reports when a publish did not succeed. The dispatcher turns it into the row's
/// next state; a sink that cannot classify a failure should panic rather than guess, and the
/// lease plus the attempt budget bound the damage.
///
/// The classes say whose fault the failure is. [`PublishError::Retryable`] and
/// [`PublishError::Permanent`] are the message's: they spend one of its attempts.
/// [`PublishError::Unavailable`] is the sink's: the message is put back untouched and the
/// dispatcher pauses until the sink is back, so an outage of any length costs no attempt.
/// [`PublishError::Refused`] is the sink's too (a full queue): the message is put back
/// untouched and the dispatcher slows down until the sink takes messages again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// A transient failure of the message (a timeout, a missing exchange): retried after a full-jitter
    /// backoff, dead once the row's attempts reach the maximum.
    #[error("retryable: {0}")]
    Retryable(String),
    /// The sink cannot take messages right now (its link is down, it is reconnecting, the
    /// transport failed mid-publish): not this message's fault. The row goes back to pending
    /// at once with its attempt refunded, and the dispatcher stops claiming until the sink is
    /// back (see [`SinkState`](crate::sink::SinkState)). Never sends a row dead. A message whose
    /// transport failed after it was handed over may have arrived: it is published again with
    /// the same id.
    #[error("sink unavailable: {0}")]
    Unavailable(String),
    /// The sink refused the message for now, for its own sake rather than the message's: a
    /// broker's nack (RabbitMQ nacks a publish that a queue at its length limit with
    /// `overflow=reject-publish` turns away, or that a queue cannot take for a reason of its
    /// own). Pushback, as a blocked broker is: the row goes back to pending after about a second
    /// with its attempt refunded (never dead, however long the refusals last), and the
    /// dispatcher slows its claims while refusals go on, with or without
    /// [`DispatcherConfig::max_rate`](crate::DispatcherConfig::max_rate), speeding up again as
    /// soon as the sink takes messages. A message the broker returns as unroutable is
    /// [`PublishError::Permanent`], not this: it is about the message.
    #[error("refused for now: {0}")]
    Refused(String),
    /// A failure that will not heal by retrying (unroutable, rejected): dead at once.
    #[error("permanent: {0}")]
    Permanent(String),
    /// Not a failure: the message cannot be published yet (a business precondition). Back to
    /// pending after `delay`, the attempt refunded; dead when the row is older than the
    /// configured maximum deferral age.
    #[error("deferred for {delay:?}: {reason}")]
    Defer {
        /// How long to wait before the row is claimable again.
        delay: std::time::Duration,
        /// Why, recorded in `last_error`.
        reason: String,
    },
}

impl PublishError {
    /// Whether the row is tried again (after a backoff or a deferral).
    pub fn will_retry(&self) -> bool {
        match self {
            PublishError::Retryable(_)
            | PublishError::Unavailable(_)
            | PublishError::Refused(_)
            | PublishError::Defer { .. } => true,
            PublishError::Permanent(_) => false,
        }
    }

    /// Whether the sink as a whole is unavailable (the dispatcher pauses), rather than this
    /// message having failed.
    pub fn is_unavailable(&self) -> bool {
        match self {
            PublishError::Unavailable(_) => true,
            PublishError::Retryable(_)
            | PublishError::Refused(_)
            | PublishError::Permanent(_)
            | PublishError::Defer { .. } => false,
        }
    }

    /// Whether this failure spends one of the row's attempts.
    pub fn spends_attempt(&self) -> bool {
        match self {
            PublishError::Retryable(_) | PublishError::Permanent(_) => true,
            PublishError::Unavailable(_) | PublishError::Refused(_) | PublishError::Defer { .. } => false,
        }
    }
}

/// Why a dispatcher could not start.
///
/// Starting checks the configuration and nothing else: the pool it is given was checked when it
/// was opened ([`connect_pool`](crate::connect_pool) fails on a database that refuses or does
/// not answer), and a database that goes down later, even before the first claim, is a
/// transient failure the claim actors retry (each logged). To fail fast on an unmigrated
/// database, call [`pending_migrations`](crate::admin::pending_migrations) before starting; it
/// returns a [`StoreError`].
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration breaks a rule; fix it, retrying will not help.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
}

impl Error {
    /// Whether starting again later may succeed: never, for the failures there are today
    /// (kept so that a future transient failure does not change callers' code).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Config(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::result::{DatabaseErrorKind as K, Error as E};

    fn database_error(kind: K) -> StoreError {
        StoreError::Query(E::DatabaseError(kind, Box::new("refused".to_owned())))
    }

    /// A refused write on a standby (25006) waits like an unreachable database, and is told
    /// apart from one.
    #[test]
    fn a_read_only_database_is_transient_and_told_apart() {
        let read_only = database_error(K::ReadOnlyTransaction);
        assert!(read_only.is_transient() && read_only.is_read_only());
        for other in [database_error(K::ClosedConnection), database_error(K::SerializationFailure)] {
            assert!(other.is_transient() && !other.is_read_only(), "{other}");
        }
        assert!(!database_error(K::UniqueViolation).is_read_only());
    }

    #[test]
    fn a_lost_prepared_statement_is_the_drivers_name_missing_or_taken() {
        assert!(is_lost_prepared_statement(r#"prepared statement "s1" already exists"#));
        assert!(is_lost_prepared_statement(r#"prepared statement "s4711" does not exist"#));
        assert!(!is_lost_prepared_statement(r#"prepared statement "s" does not exist"#));
        assert!(!is_lost_prepared_statement(r#"prepared statement "mine" does not exist"#));
        assert!(!is_lost_prepared_statement(r#"prepared statement "s1x" already exists"#));
        assert!(!is_lost_prepared_statement(r#"relation "outbox" does not exist"#));
    }
}
