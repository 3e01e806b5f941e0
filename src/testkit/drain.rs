//! Running a real dispatcher until the outbox is idle.

use std::time::{Duration, Instant};

use crate::config::DispatcherConfig;
use crate::dispatcher::Shutdown;
use crate::dispatcher::supervisor::OutboxSupervisor;
use crate::error::{Error, StoreError};
use crate::model::OutboxRow;
use crate::publisher::Publisher;
use crate::store::{self, PgPool, Unsettled};

/// How often the drain looks at the table.
const CHECK_EVERY: Duration = Duration::from_millis(10);
/// Dead rows a [`Drained`] carries at most.
const DEAD_ROWS_KEPT: i64 = 100;

/// Why a drain did not end idle.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum DrainError {
    /// The dispatcher did not start (its configuration is invalid).
    #[error("the dispatcher did not start: {0}")]
    Start(#[from] Error),
    /// The database failed a query of the drain's.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Rows were still due or being published when the drain's timeout ran out (a sink that
    /// stays unavailable, a row retried for longer than the timeout). The dispatcher was stopped.
    #[error("the outbox was not idle after {waited:?}: {processing} row(s) processing, {due} due")]
    NotIdle {
        /// How long the drain waited.
        waited: Duration,
        /// Rows being published at the end.
        processing: i64,
        /// Pending rows due within the horizon at the end.
        due: i64,
    },
}

crate::error::readable_debug!(DrainError);

/// The outbox table after a drain.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Drained {
    /// Rows `done`.
    pub done: i64,
    /// Rows `dead`.
    pub dead: i64,
    /// Rows still `pending`: only rows due later than the drain's horizon (deferred, backing off
    /// for longer, or scheduled by their producer for later: `NewEvent::not_before`).
    pub pending: i64,
    /// The dead rows, oldest first (the first 100), with their `last_error`.
    pub dead_rows: Vec<OutboxRow>,
}

impl Drained {
    /// Panics if any row is dead, listing the dead rows' ids, event types and errors.
    #[track_caller]
    pub fn assert_no_dead(&self) {
        if self.dead > 0 {
            let rows: Vec<String> = self
                .dead_rows
                .iter()
                .map(|r| format!("#{} {} ({})", r.id, r.event_type, r.last_error.as_deref().unwrap_or("no error")))
                .collect();
            panic!("expected no dead rows, found {}: {}", self.dead, rows.join("; "));
        }
    }

    /// Panics if any row is left pending.
    #[track_caller]
    pub fn assert_nothing_pending(&self) {
        assert_eq!(self.pending, 0, "expected no pending rows after the drain");
    }
}

/// A drain, configured: which dispatcher configuration, how long to wait, and which pending rows
/// count as still to do. [`drain_until_idle`] is `Drain::new().run(pool, sink)`.
///
/// ```no_run
/// # async fn example(db: actix_outbox::testkit::TestDatabase, sink: actix_outbox::testkit::MemorySink) {
/// use std::time::Duration;
/// use actix_outbox::Fifo;
/// use actix_outbox::testkit::Drain;
///
/// let drained = Drain::new()
///     .configure(|config| config.fifo(Fifo::All).max_attempts(3))
///     .timeout(Duration::from_secs(60))
///     .run(db.pool(), sink.clone())
///     .await
///     .unwrap();
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Drain {
    config: DispatcherConfig,
    timeout: Duration,
    horizon: Duration,
}

impl Default for Drain {
    fn default() -> Self {
        Self::new()
    }
}

impl Drain {
    /// The defaults: [`DispatcherConfig::default`] made quick for a test (two workers, a 10 ms
    /// poll, backoff from 5 ms capped at 50 ms, a 5 s lease, no periodic summary or table
    /// metrics), a 30 s timeout, and a 1 s horizon.
    pub fn new() -> Self {
        let config = DispatcherConfig::default()
            .workers(2)
            .poll_interval(Duration::from_millis(10))
            .backoff_base(Duration::from_millis(5))
            .backoff_cap(Duration::from_millis(50))
            .sink_probe_interval(Duration::from_millis(20))
            .lease(Duration::from_secs(5))
            .publish_timeout(Duration::from_secs(4))
            .summary_interval(None)
            .table_metrics_interval(None);
        Drain { config, timeout: Duration::from_secs(30), horizon: Duration::from_secs(1) }
    }

    /// Changes the dispatcher's configuration, starting from the drain's.
    #[must_use]
    pub fn configure(mut self, f: impl FnOnce(DispatcherConfig) -> DispatcherConfig) -> Self {
        self.config = f(self.config);
        self
    }

    /// Gives up (with [`DrainError::NotIdle`]) after this long.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Pending rows due within this much of now count as still to do; rows due later (a
    /// deferral, a long backoff) are left pending and reported in [`Drained::pending`].
    #[must_use]
    pub fn horizon(mut self, horizon: Duration) -> Self {
        self.horizon = horizon;
        self
    }

    /// Starts a dispatcher on `pool` publishing to `sink`, waits until no row is being
    /// published and none is due within the horizon, stops it ([`Shutdown`]: every publish
    /// started is finalized) and reads the table. Runs inside an actix system.
    pub async fn run(self, pool: &PgPool, sink: impl Publisher) -> Result<Drained, DrainError> {
        let started = Instant::now();
        let dispatcher = OutboxSupervisor::start(self.config.clone(), pool.clone(), sink)?;
        let waited = self.wait_idle(pool, started).await;
        // Stopped whatever the wait found, so that a failed drain leaves no dispatcher running.
        let _ = dispatcher.send(Shutdown).await;
        match waited? {
            Unsettled { processing: 0, due: 0, .. } => {}
            Unsettled { processing, due, .. } => {
                return Err(DrainError::NotIdle { waited: started.elapsed(), processing, due });
            }
        }
        let mut conn = pool.get().await.map_err(StoreError::from)?;
        let stats = store::stats(&mut conn).await?;
        let count = |status: &str| stats.by_status.get(status).copied().unwrap_or(0);
        let dead_rows = if count("dead") > 0 { store::dead_list(&mut conn, DEAD_ROWS_KEPT).await? } else { Vec::new() };
        Ok(Drained { done: count("done"), dead: count("dead"), pending: count("pending"), dead_rows })
    }

    /// The first idle reading, or the last reading when the timeout ran out.
    async fn wait_idle(&self, pool: &PgPool, started: Instant) -> Result<Unsettled, StoreError> {
        loop {
            let unsettled = {
                let mut conn = pool.get().await?;
                store::unsettled(&mut conn, self.horizon).await?
            };
            if (unsettled.processing == 0 && unsettled.due == 0) || started.elapsed() >= self.timeout {
                return Ok(unsettled);
            }
            tokio::time::sleep(CHECK_EVERY).await;
        }
    }
}

/// Runs a dispatcher with [`Drain::new`]'s settings until the outbox is idle, stops it, and
/// reports the table. `sink` is any [`Publisher`]: a [`MemorySink`](super::MemorySink) (pass a
/// clone and keep the original to read what was published), or a real one.
pub async fn drain_until_idle(pool: &PgPool, sink: impl Publisher) -> Result<Drained, DrainError> {
    Drain::new().run(pool, sink).await
}
