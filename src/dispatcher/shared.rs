//! What every actor of one dispatcher shares: set up once by the supervisor, read by all.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use diesel_async::AsyncPgConnection;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::gate::SinkGate;
use super::listener::Wakeups;
use crate::config::DispatcherConfig;
use crate::error::StoreError;
use crate::metrics::Metrics;
use crate::model::Fence;
use crate::publisher::Publisher;
use crate::store::{PgPool, Pooler};

/// How long the FIFO gate's index build may take (it reads the whole table once), at least.
const FIFO_INDEX_BUILD_TIMEOUT: Duration = Duration::from_secs(600);

/// The configuration, the pool, the sink and the counters of one dispatcher, and what it knows
/// of the health of the two services it depends on.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: DispatcherConfig,
    pub(crate) pool: PgPool,
    pub(crate) publisher: Arc<dyn Publisher>,
    pub(crate) metrics: Metrics,
    /// Whether claims may run, given the sink's health.
    pub(crate) gate: SinkGate,
    /// Whether the database answers, so that an outage is logged once, not once per statement.
    pub(crate) db: DbHealth,
    /// What the insert listener and the claim actors tell each other (see `listener`).
    pub(crate) wakeups: Arc<Wakeups>,
    /// Per worker, the claims its publishes hold, kept here rather than in the claim actor
    /// because publishes outlive a claim actor that dies. A claim whose answer was lost hands
    /// back that worker's other `processing` rows (see `store::release_unanswered`). By fence,
    /// not by id: a worker that stalled past its lease can reclaim its own row while the stale
    /// publish of it still runs, and the stale one finishing must not unmark the new one.
    publishing: Vec<Mutex<HashSet<Fence>>>,
    /// The outbox's source name, stamped on every claimed message: the configured one, or the
    /// one the first claim derives from the database (see `store::outbox_source`).
    source: OnceLock<Arc<str>>,
    /// The FIFO gate's index is known to be there (see `store::ensure_fifo_index`).
    fifo_index: AtomicBool,
    /// What the minute's summary reports.
    pub(crate) summary: super::summary::Summary,
    /// The cap on messages a second, shared by the workers (see `pace`).
    pub(crate) pace: super::pace::Pace,
    /// The rows in flight at most, all workers together (see `window`).
    pub(crate) window: Arc<super::window::Window>,
    /// The cursor over new rows, held by one claim at a time (see `cursor`).
    pub(crate) cursor: Arc<super::cursor::CursorSlot>,
    /// Set by the shutdown: the finalizer retries a failing database until then at the latest,
    /// so that a shutdown ends within the publish timeout and a few seconds whatever the
    /// database does (rows it could not finalize wait for their lease).
    pub(crate) drain_by: OnceLock<Instant>,
}

impl Shared {
    pub(crate) fn new(config: DispatcherConfig, pool: PgPool, publisher: Arc<dyn Publisher>) -> Self {
        let gate = SinkGate::new(config.sink_probe_interval, config.publish_timeout);
        let publishing = (0..config.workers).map(|_| Mutex::default()).collect();
        let pace = super::pace::Pace::new(config.max_rate, config.batch);
        let window = super::window::Window::new(config.workers, config.in_flight_limit(), config.batch);
        let wakeups = Arc::new(Wakeups::new(config.linger, config.batch));
        let source = OnceLock::new();
        if let Some(name) = &config.source {
            let _ = source.set(Arc::from(name.as_str()));
        }
        let metrics = Metrics::new(config.name.as_deref());
        Self {
            config,
            pool,
            publisher,
            metrics,
            gate,
            db: DbHealth::default(),
            wakeups,
            publishing,
            summary: Default::default(),
            source,
            fifo_index: AtomicBool::new(false),
            pace,
            window,
            cursor: Arc::default(),
            drain_by: OnceLock::new(),
        }
    }

    /// Under the FIFO gate, builds its index the first time (or waits for another dispatcher's
    /// build): before a gated claim or a count of the blocked aggregates, which would read the
    /// whole table without it. Nothing with the gate off.
    ///
    /// The build holds a session: on `conn` when it is one, on a connection of its own to the
    /// direct URL behind a transaction pooler. Behind one without a direct URL, the index must
    /// be there already.
    pub(crate) async fn fifo_index(&self, conn: &mut AsyncPgConnection) -> Result<(), StoreError> {
        if !self.config.fifo.is_on() || self.fifo_index.load(Ordering::Relaxed) {
            return Ok(());
        }
        // The build reads the whole table once: it gets a deadline of its own, not a statement's.
        let build = FIFO_INDEX_BUILD_TIMEOUT.max(self.pool.query_timeout());
        match self.pool.pooler() {
            Pooler::None => {
                self.pool.bounded(conn, Some(build), async |c| crate::store::ensure_fifo_index(c).await).await?;
            }
            Pooler::Transaction => match self.pool.session().await.zip(self.pool.session_url()) {
                Some((session, url)) => {
                    crate::store::within(&mut session?, build, &url, async |c| {
                        crate::store::ensure_fifo_index(c).await
                    })
                    .await?;
                }
                None if self.pool.bounded(conn, None, async |c| crate::store::fifo_index_valid(c).await).await? => {}
                None => {
                    return Err(StoreError::NeedsSession {
                        what: "building the FIFO gate's index outbox_fifo_gate (missing; `actix-outbox migrate --fifo` \
                               on a direct URL builds it ahead of time)",
                    });
                }
            },
        }
        self.fifo_index.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The outbox's source name, derived from the database on `conn` the first time when it
    /// was not configured.
    pub(crate) async fn source(&self, conn: &mut AsyncPgConnection) -> Result<Arc<str>, StoreError> {
        if let Some(source) = self.source.get() {
            return Ok(source.clone());
        }
        let derived = self.pool.bounded(conn, None, async |c| crate::store::outbox_source(c).await).await?;
        let source = self.source.get_or_init(|| {
            info!(source = %derived, "outbox source derived from the database: messages carry it in x-outbox-source");
            Arc::from(derived.as_str())
        });
        Ok(source.clone())
    }

    /// The source name, once known.
    pub(crate) fn known_source(&self) -> Option<Arc<str>> {
        self.source.get().cloned()
    }

    /// The claims worker `n`'s publishes hold.
    pub(crate) fn publishing(&self, n: usize) -> MutexGuard<'_, HashSet<Fence>> {
        self.publishing[n].lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The database's health as the dispatcher's statements see it: down from a statement's
/// transient failure until a write commits.
#[derive(Debug, Default)]
pub(crate) struct DbHealth {
    down: Mutex<Option<Down>>,
}

/// A spell of the database not being usable.
#[derive(Debug, Clone, Copy)]
struct Down {
    since: Instant,
    /// The last failure was a refused write (SQLSTATE 25006: a standby), not a lost server.
    read_only: bool,
}

impl DbHealth {
    /// A statement failed on a transient error. The first failure of a spell is logged as a
    /// warning, and so is a change between unreachable and read-only; the others at debug
    /// level.
    pub(crate) fn failed(&self, what: &str, e: &StoreError) {
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        let read_only = e.is_read_only();
        let changed = down.is_none_or(|d| d.read_only != read_only);
        let since = down.map_or_else(Instant::now, |d| d.since);
        *down = Some(Down { since, read_only });
        if !changed {
            debug!(error = %e, during = what, "database still not usable");
        } else if read_only {
            warn!(error = %e, during = what,
                "database is read-only (a standby?): nothing is claimed and no attempt is spent until it accepts \
                 writes; point the URL at the primary, or list every server with target_session_attrs=read-write");
        } else if matches!(e, StoreError::BehindTransactionPooler(_)) {
            // The pool switched to the pooler's path at this failure and said so once, with the
            // setting to make: the statements retried now take that path.
            debug!(error = %e, during = what, "a statement found the transaction pooler; retried on the pooler's path");
        } else {
            warn!(error = %e, during = what,
                "database unreachable: claims back off, finalizes keep their fences and retry while the leases run");
        }
    }

    /// Whether the database refused the last write as read-only (and none committed since).
    pub(crate) fn read_only(&self) -> bool {
        self.down.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|d| d.read_only)
    }

    /// Whether the database is usable: no statement failed on a transient error since the
    /// last write committed (true before the first).
    pub(crate) fn reachable(&self) -> bool {
        self.down.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// A write that began at `began` committed (a claim, a finalize): logs the end of an
    /// outage, with its length.
    ///
    /// Only a write ends one, and only a write sent after the outage's first failure. A read
    /// that answers proves the server reachable, not that it accepts writes: a standby answers
    /// the table sampler's reads while it refuses every claim. And a write sent before the
    /// failure may commit just after it (the other worker's claim, a finalize in flight when
    /// the primary went away): it says nothing of the server now. Ending the spell on either
    /// made the state flap, down, "reachable again", down.
    pub(crate) fn answered(&self, began: Instant) {
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        match *down {
            Some(Down { since, .. }) if began >= since => {
                *down = None;
                let outage = Duration::from_millis(since.elapsed().as_millis() as u64);
                info!(outage = %humantime::format_duration(outage), "database reachable again");
            }
            Some(_) => debug!("a write sent before the outage answered: the outage goes on"),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::result::{DatabaseErrorKind as K, Error as E};

    fn failure(kind: K) -> StoreError {
        StoreError::Query(E::DatabaseError(kind, Box::new("refused".to_owned())))
    }

    /// The state goes down once and up once: a write sent before the failure that commits after
    /// it (the other worker's claim, a finalize in flight) does not end the spell; the first
    /// write sent after it does.
    #[test]
    fn only_a_write_sent_after_the_first_failure_ends_an_outage() {
        for kind in [K::ClosedConnection, K::ReadOnlyTransaction] {
            let db = DbHealth::default();
            let sent_before = Instant::now();
            std::thread::sleep(Duration::from_millis(2));
            db.failed("claim", &failure(kind));
            let read_only = kind == K::ReadOnlyTransaction;
            assert_eq!((db.reachable(), db.read_only()), (false, read_only), "{kind:?}");
            db.answered(sent_before);
            assert_eq!((db.reachable(), db.read_only()), (false, read_only), "{kind:?}: still down");
            std::thread::sleep(Duration::from_millis(2));
            db.failed("claim", &failure(kind));
            db.answered(Instant::now());
            assert_eq!((db.reachable(), db.read_only()), (true, false), "{kind:?}: up");
        }
    }
}
