//! What both tools do first: a database of their own, migrated, on a connection set up as the
//! dispatcher's pool sets its own, then filled and vacuumed; and the claim they inspect.

use std::time::{Duration, Instant};

use actix_outbox::Fifo;
use actix_outbox::testing::ClaimParams;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};

pub(crate) type BoxError = Box<dyn std::error::Error>;

/// `DATABASE_URL`, or `default_url`: created if missing and migrated; a connection to it with
/// custom plans, whatever the driver prepares (as on the dispatcher's pooled connections).
pub(crate) async fn open(default_url: &str) -> Result<AsyncPgConnection, BoxError> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| default_url.to_owned());
    actix_outbox::admin::ensure_database(&url).await?;
    actix_outbox::migrate(&url).await?;
    let mut conn = AsyncPgConnection::establish(&url).await?;
    conn.batch_execute("SET plan_cache_mode = force_custom_plan").await?;
    Ok(conn)
}

/// Runs `fill`, builds the FIFO gate's index as a dispatcher with the gate on does, and
/// vacuums and analyses the table as autovacuum would have; returns how long it all took.
pub(crate) async fn fill(conn: &mut AsyncPgConnection, fill: &str) -> Result<Duration, BoxError> {
    let started = Instant::now();
    conn.batch_execute(fill).await?;
    actix_outbox::admin::ensure_fifo_index(conn).await?;
    conn.batch_execute("VACUUM ANALYZE outbox").await?;
    Ok(started.elapsed())
}

/// A claim of up to `batch` rows under `fifo`, with a 60 s lease (so that nothing expires while
/// a tool looks) and 12 attempts.
pub(crate) fn claim_params(fifo: &Fifo, batch: usize) -> ClaimParams<'_> {
    ClaimParams {
        owner: "explain",
        batch,
        max_bytes: usize::MAX,
        lease: Duration::from_secs(60),
        max_attempts: 12,
        fifo,
        cursor: None,
        heads_after: None,
    }
}
