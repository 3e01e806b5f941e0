//! The insert listener: a dedicated connection that `LISTEN`s for the outbox trigger's
//! notifications and wakes one idle claim actor, so that a new row is claimed at once instead of
//! at the next poll. Polling stays as the fallback: a dropped connection or a lost notification
//! costs latency, never a row.
//!
//! **Armed and busy.** A transaction that calls `NOTIFY` takes a lock of the whole cluster at
//! commit and holds it across its WAL flush, so notifying commits run one at a time: on a disk
//! that flushes in ~2 ms that caps the producers at a few hundred commits a second, whatever
//! the dispatcher does. So the trigger notifies only while a dispatcher is *armed*: while this
//! connection holds the session advisory lock of the table's *armed* key (see [`KEYS_SQL`]). A
//! producer's trigger tries the same key in shared mode for its own transaction: when that succeeds nobody is armed, and it
//! holds the shared lock until it commits, without notifying.
//!
//! The listener arms when the dispatcher has drained the table (two claims in a row came back
//! empty) and disarms at the first notification. Disarmed (busy), it wakes a worker after a
//! pause instead while rows come in, so that each claim gathers what arrived meanwhile: the
//! pause in which a quarter of a batch arrives at the rate rows are claimed, between
//! [`BUSY_TICK`] and the dispatcher's `linger` (see [`Linger`]), doubling while claims come back empty, up to
//! [`BUSY_TICK_MAX`]. No row can fall between the two modes: arming succeeds only once every
//! producer transaction that saw the lock free has committed (each held the lock in shared mode
//! until then), and arming is followed by one more claim, which sees their rows.
//! A producer that started after arming finds the lock taken and notifies.
//!
//! **One leader in a fleet.** Several dispatchers on one outbox would otherwise each listen,
//! each be woken by every insert and each tick while busy: every row chased by every process,
//! a claim that finds it and others that find nothing, so the database's work per message grew
//! with the fleet. So only one listener of the outbox *leads*: the one whose session holds the
//! advisory lock of the table's *lead* key. It listens, arms and ticks as above, waking its own
//! workers. The others follow: they neither listen nor tick, and their workers find rows by
//! their poll (`poll_interval`), which also serves rows that come due for a retry; a worker
//! whose claim comes back full claims again at once, so a backlog beyond the leader's pace is
//! shared by the whole fleet. A follower tries the lock every [`FOLLOW_CHECK`]: when the
//! leader's process dies or stops, its session ends, the lock is free, and a follower leads
//! within that time (meanwhile the polls find new rows).
//!
//! **A silent connection.** Every statement of the listener is bounded by the pool's query
//! timeout, and an armed listener, which otherwise only waits for notifications, asks its
//! connection for an answer every [`ARMED_CHECK`] it hears nothing: a link that went silent
//! without closing would otherwise hold the lead (and leave inserts unannounced) for ever. A
//! connection that misses its deadline is closed, and the listener reconnects (the workers'
//! polls find new rows meanwhile).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use diesel::sql_types::{BigInt, Bool};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::{FutureExt, StreamExt};
use tracing::{debug, info, warn};

use crate::error::StoreError;
use crate::store::PgPool;
use crate::url::ConnectionString;

/// The channel the migration's trigger notifies on every `INSERT` statement into an outbox
/// table, with the table's qualified name (`tenant_a.outbox`) as the payload: several outboxes
/// of one database share the channel, and each listener heeds its own table's notifications.
pub(crate) const CHANNEL: &str = "outbox_insert";

/// The outbox table the session's `search_path` reaches, qualified, and the two advisory-lock
/// keys (64-bit space) of its listeners, each a hash of a prefix and that name: the *armed*
/// key, which an armed listener holds and the insert trigger tries
/// (`pg_try_advisory_xact_lock_shared`; the migration `2026-12-04-000009_notify_per_outbox`
/// spells the same expression), and the *lead* key, which the leading listener of the outbox
/// holds for its session and nothing else takes. Keys of their own per table: the outboxes of
/// one database each have their leader, armed or not.
const KEYS_SQL: &str = "
SELECT t.outbox,
       hashtextextended('actix-outbox:armed:' || t.outbox, 0) AS armed,
       hashtextextended('actix-outbox:lead:' || t.outbox, 0) AS lead
FROM (SELECT (SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.oid = to_regclass('outbox')) AS outbox) t";

/// How often a following listener tries to lead.
pub(crate) const FOLLOW_CHECK: Duration = Duration::from_secs(1);

/// How long an armed listener waits for a notification before it asks its connection for an
/// answer (and the dispatcher whether it is still there).
const ARMED_CHECK: Duration = Duration::from_secs(5);

/// While disarmed, the first pause between two wake-ups, and the shortest: rows arrive so fast
/// that a quarter of a batch comes in this time or less.
pub(crate) const BUSY_TICK: Duration = Duration::from_millis(2);

/// While disarmed, the longest pause between two wake-ups (claims keep coming back empty and
/// arming keeps failing: another dispatcher is armed, or a producer transaction is open).
pub(crate) const BUSY_TICK_MAX: Duration = Duration::from_millis(100);

/// While disarmed, arm once this many looks in a row found only empty claims since the one
/// before (and no claim with rows).
const ARM_AFTER: u32 = 2;

/// The channel a leading listener notifies (with its table's qualified name, as [`CHANNEL`])
/// when its workers find a backlog (claims that come
/// back with a whole batch), so that the followers' workers help at once rather than at their
/// next poll. At most one notification every [`HELP_EVERY`].
pub(crate) const HELP_CHANNEL: &str = "outbox_fleet_help";

/// Whole batches the leader's workers claim before it calls for help.
const HELP_AFTER: u64 = 2;

/// The shortest pause between two of the leader's calls for help.
const HELP_EVERY: Duration = Duration::from_millis(50);

/// A follower's workers poll this many times less often than `poll_interval`: the leader's
/// wake-ups and calls for help do the work their polls would.
pub(crate) const FOLLOWER_POLL_FACTOR: u32 = 4;

/// What the listener asks of the dispatcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Nothing: only whether the dispatcher is still there.
    Check,
    /// Wake one worker (in turn).
    One,
    /// Wake every worker: the leader found a backlog.
    All,
}

/// What the listener and the claim actors tell each other.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    /// The dispatcher's [`linger`](crate::DispatcherConfig::linger).
    linger: Duration,
    /// Claims that came back empty (the table drained).
    empty_claims: AtomicU64,
    /// Claims that came back with rows.
    full_claims: AtomicU64,
    /// Claims that came back with a whole batch (a backlog).
    whole_batches: AtomicU64,
    /// Rows claimed.
    rows: AtomicU64,
    /// The dispatcher's batch.
    batch: u64,
    /// The listener holds the armed lock.
    armed: AtomicBool,
    /// Another dispatcher's listener leads: this one's workers poll less often.
    following: AtomicBool,
}

impl Wakeups {
    /// For a dispatcher whose rows wait at most `linger` for company and whose batch is `batch`.
    pub(crate) fn new(linger: Duration, batch: usize) -> Self {
        Self { linger, batch: batch as u64, ..Self::default() }
    }

    /// A claim that asked for `asked` rows came back with `rows`.
    pub(crate) fn claimed(&self, rows: usize, asked: usize) {
        let counter = if rows == 0 { &self.empty_claims } else { &self.full_claims };
        counter.fetch_add(1, Relaxed);
        if rows == asked {
            self.whole_batches.fetch_add(1, Relaxed);
        }
        self.rows.fetch_add(rows as u64, Relaxed);
    }

    /// Whether this dispatcher's listener follows another's lead.
    pub(crate) fn following(&self) -> bool {
        AtomicBool::load(&self.following, Relaxed)
    }

    /// (empty claims, claims with rows) so far.
    fn counts(&self) -> (u64, u64) {
        (AtomicU64::load(&self.empty_claims, Relaxed), AtomicU64::load(&self.full_claims, Relaxed))
    }

    /// Whether inserts notify this dispatcher's listener now.
    pub(crate) fn armed(&self) -> bool {
        AtomicBool::load(&self.armed, Relaxed)
    }
}

/// Listens until the dispatcher is gone, reconnecting with a capped backoff.
///
/// `wake(what)` wakes one worker or all ([`Wake`]) and returns false once the dispatcher is
/// gone. The supervisor hands in one
/// that holds a weak address, so the listener never keeps a dropped dispatcher alive.
pub(crate) async fn listen(pool: PgPool, wakeups: Arc<Wakeups>, wake: impl Fn(Wake) -> bool) {
    let mut backoff = Duration::from_millis(100);
    let mut reconnecting = false;
    // A pool that found a transaction pooler it was not told about may have no session left
    // to give: then the workers poll.
    while wake(Wake::Check) && pool.has_session() {
        let result = listen_once(&pool, &wakeups, &wake, reconnecting).await;
        reconnecting = true;
        wakeups.armed.store(false, Relaxed);
        wakeups.following.store(false, Relaxed);
        match result {
            Ok(()) => return,
            Err(Failed::Store(e @ StoreError::BehindTransactionPooler(_))) => {
                // The pool learns of its pooler (and says once what to set); without a session
                // of its own the listener stops at the top of the loop, and the workers poll.
                pool.learn(&e);
                debug!(error = %e, "the insert listener's session goes through a transaction pooler");
                tokio::time::sleep(backoff).await;
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff, "insert listener lost its connection; polling meanwhile");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// Why the listener's session failed: a statement (in the store's words, so that a lost
/// prepared statement of a session that goes through a transaction pooler names the pooler and
/// the fix rather than the server's bare `prepared statement "s1" does not exist`), or the
/// session itself.
#[derive(Debug)]
enum Failed {
    Store(StoreError),
    Session(String),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Store(e) => e.fmt(f),
            Failed::Session(why) => f.write_str(why),
        }
    }
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Self {
        Failed::Store(e)
    }
}

impl From<diesel::result::Error> for Failed {
    fn from(e: diesel::result::Error) -> Self {
        Failed::Store(e.into())
    }
}

/// The listener's session: its connection, where it goes, and how long a statement on it may
/// wait for its answer.
struct Session {
    conn: AsyncPgConnection,
    server: ConnectionString,
    limit: Duration,
}

impl Session {
    /// Runs `f` on the connection within the query timeout: past it, the connection is given
    /// up (the listener reconnects).
    async fn run<T>(&mut self, f: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, Failed>) -> Result<T, Failed> {
        crate::store::within(&mut self.conn, self.limit, &self.server, f).await
    }

    /// A statement, within the query timeout.
    async fn statement(&mut self, sql: &str) -> Result<(), Failed> {
        self.run(async |c| Ok(c.batch_execute(sql).await?)).await
    }
}

#[derive(diesel::QueryableByName)]
struct Locked {
    #[diesel(sql_type = Bool)]
    ok: bool,
}

/// The outbox this listener serves and its keys (see [`KEYS_SQL`]).
#[derive(diesel::QueryableByName)]
struct Keys {
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    outbox: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    armed: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    lead: Option<i64>,
}

/// The outbox `conn` reaches and its keys: (qualified name, armed key, lead key).
async fn keys_of(conn: &mut AsyncPgConnection) -> Result<(String, i64, i64), Failed> {
    let keys: Keys = diesel::sql_query(KEYS_SQL).get_result(conn).await?;
    match keys {
        Keys { outbox: Some(outbox), armed: Some(armed), lead: Some(lead) } => Ok((outbox, armed, lead)),
        _ => Err(Failed::Session("no outbox table on the listener's search_path (is the database migrated?)".into())),
    }
}

#[derive(diesel::QueryableByName)]
struct Server {
    #[diesel(sql_type = diesel::sql_types::Text)]
    addr: String,
}

/// The address of the server `conn` reached (`host:port`), as the server sees itself: with a
/// connection string that lists several hosts, the one actually connected.
async fn server_of(conn: &mut AsyncPgConnection) -> Result<String, Failed> {
    let row: Server = diesel::sql_query(
        "SELECT coalesce(host(inet_server_addr()), 'socket') || ':' || current_setting('port') AS addr",
    )
    .get_result(conn)
    .await?;
    Ok(row.addr)
}

/// Takes the session lock `key` if nobody holds it: the lead if no other listener of the
/// outbox holds it, the armed lock if no producer transaction holds it in shared mode.
async fn try_lock(conn: &mut AsyncPgConnection, key: i64) -> Result<bool, Failed> {
    let row: Locked =
        diesel::sql_query("SELECT pg_try_advisory_lock($1) AS ok").bind::<BigInt, _>(key).get_result(conn).await?;
    Ok(row.ok)
}

/// Releases the armed lock `key`.
async fn disarm(conn: &mut AsyncPgConnection, key: i64) -> Result<(), Failed> {
    let _: Locked =
        diesel::sql_query("SELECT pg_advisory_unlock($1) AS ok").bind::<BigInt, _>(key).get_result(conn).await?;
    Ok(())
}

/// Notifies `channel` with `outbox` as the payload.
async fn notify(conn: &mut AsyncPgConnection, channel: &str, outbox: &str) -> Result<(), Failed> {
    diesel::sql_query("SELECT pg_notify($1, $2)")
        .bind::<diesel::sql_types::Text, _>(channel)
        .bind::<diesel::sql_types::Text, _>(outbox)
        .execute(conn)
        .await?;
    Ok(())
}

/// Notifications already arrived, without waiting.
fn swallow(conn: &mut AsyncPgConnection) -> Result<usize, Failed> {
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    let mut burst = 0usize;
    loop {
        match notifications.next().now_or_never() {
            Some(Some(Ok(_))) => burst += 1,
            Some(Some(Err(e))) => return Err(e.into()),
            Some(None) => return Err(Failed::Session("notification stream ended".into())),
            None => return Ok(burst),
        }
    }
}

/// The next notification about `outbox` (`Ok(false)` when `within` passed first); those
/// about the database's other outboxes are passed over.
async fn notified(conn: &mut AsyncPgConnection, outbox: &str, within: Duration) -> Result<bool, Failed> {
    let deadline = tokio::time::Instant::now() + within;
    let mut notifications = std::pin::pin!(conn.notifications_stream());
    loop {
        match tokio::time::timeout_at(deadline, notifications.next()).await {
            Err(_elapsed) => return Ok(false),
            Ok(Some(Ok(n))) if n.payload == outbox => return Ok(true),
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(e))) => return Err(e.into()),
            // The backend went away; polling this stream again would panic.
            Ok(None) => return Err(Failed::Session("notification stream ended".into())),
        }
    }
}

/// `Ok` when the dispatcher is gone.
async fn listen_once(
    pool: &PgPool,
    wakeups: &Wakeups,
    wake: &impl Fn(Wake) -> bool,
    reconnecting: bool,
) -> Result<(), Failed> {
    // Not a pooled connection: LISTEN state and the session lock must not leak to other users,
    // and the connection is held for as long as we listen. The supervisor starts no listener
    // on a pool that has no session to give.
    let Some(conn) = pool.session().await else { return Ok(()) };
    let Some(url) = pool.session_url() else { return Ok(()) };
    let mut session = Session { conn: conn?, server: url, limit: pool.query_timeout() };
    let server = session.run(server_of).await?;
    let (outbox, armed_key, lead_key) = session.run(keys_of).await?;
    if reconnecting {
        info!(%server, %outbox, "insert listener reconnected");
    } else {
        info!(%server, %outbox, "insert listener connected");
    }
    let mut followed = false;
    while !session.run(async |c| try_lock(c, lead_key).await).await? {
        if !followed {
            debug!("another dispatcher's listener leads on this outbox: following");
            session.statement(&format!("LISTEN {HELP_CHANNEL}")).await?;
            wakeups.following.store(true, Relaxed);
            followed = true;
        }
        // The leader found a backlog: every worker claims, and goes on while its claims come
        // back whole.
        let help = notified(&mut session.conn, &outbox, FOLLOW_CHECK).await?;
        let _ = swallow(&mut session.conn)?;
        if !wake(if help { Wake::All } else { Wake::Check }) || !pool.has_session() {
            return Ok(());
        }
    }
    if followed {
        session.statement(&format!("UNLISTEN {HELP_CHANNEL}")).await?;
        let _ = swallow(&mut session.conn)?;
        wakeups.following.store(false, Relaxed);
        info!("the dispatcher that led the insert wake-ups is gone: this one leads them now");
    }
    session.statement(&format!("LISTEN {CHANNEL}")).await?;
    debug!("insert listener connected and leading");
    // Rows inserted while nobody was armed (or before we listened) are found by the claim that
    // follows the first arming, or by the busy ticks.
    let mut tick = BUSY_TICK;
    let mut seen = wakeups.counts();
    let mut empty_looks = 0;
    let mut try_now = true;
    let mut whole_seen = AtomicU64::load(&wakeups.whole_batches, Relaxed);
    let mut linger = Linger::new(AtomicU64::load(&wakeups.rows, Relaxed));
    let mut help_sent: Option<std::time::Instant> = None;
    loop {
        if wakeups.armed() {
            // Poll the supervisor's liveness now and then, so a stopped dispatcher frees the
            // connection, and the connection's: a silent one would never notify.
            if !notified(&mut session.conn, &outbox, ARMED_CHECK).await? {
                session.statement("SELECT 1").await?;
                if wake(Wake::Check) && pool.has_session() {
                    continue;
                }
                return Ok(());
            }
            // A burst of inserts is one wake-up: swallow what has already arrived.
            let burst = 1 + swallow(&mut session.conn)?;
            debug!(burst, "rows inserted; waking a worker and disarming");
            if !wake(Wake::One) {
                return Ok(());
            }
            // Rows are coming: stop the producers' notifications (each serialises their commits)
            // and tick instead.
            session.run(async |c| disarm(c, armed_key).await).await?;
            wakeups.armed.store(false, Relaxed);
            tick = BUSY_TICK;
            seen = wakeups.counts();
            empty_looks = 0;
            linger = Linger::new(AtomicU64::load(&wakeups.rows, Relaxed));
            try_now = false;
            continue;
        }
        // Disarmed: arm once the table is drained, else wake a worker every tick: the pause in
        // which a quarter of a batch comes in (see `Linger`).
        let now = wakeups.counts();
        let drained = now.0 > seen.0;
        let rows = AtomicU64::load(&wakeups.rows, Relaxed);
        let pause = linger.next(rows, wakeups.batch, wakeups.linger);
        if now.1 > seen.1 {
            tick = pause;
            empty_looks = 0;
        } else if drained {
            tick = (tick * 2).min(BUSY_TICK_MAX);
            empty_looks += 1;
        }
        seen = now;
        // Arm after empty claims in a row, not after the first: a producer committing row after
        // row would otherwise find it armed between two rows, and notify. Never while claims
        // still find rows (an empty claim beside them is a worker that raced another): armed
        // with a backlog left, the listener would neither tick nor call the fleet for help.
        let drained = drained && empty_looks >= ARM_AFTER;
        if (try_now || drained) && session.run(async |c| try_lock(c, armed_key).await).await? {
            debug!("table drained: armed, inserts notify");
            wakeups.armed.store(true, Relaxed);
            // Every producer that saw the lock free has committed: one more claim finds its rows.
            let _ = swallow(&mut session.conn)?;
            if !wake(Wake::One) {
                return Ok(());
            }
            continue;
        }
        try_now = false;
        // No other listener arms while this one leads; a notification is a producer that saw
        // the lock taken just before the disarm.
        if notified(&mut session.conn, &outbox, tick).await? {
            let _ = swallow(&mut session.conn)?;
        }
        if !wake(Wake::One) || !pool.has_session() {
            return Ok(());
        }
        // The workers found a backlog since the last call (more than one whole batch: one is
        // a pause of this process as often as a backlog): the followers help.
        let whole = AtomicU64::load(&wakeups.whole_batches, Relaxed);
        if whole >= whole_seen + HELP_AFTER && help_sent.is_none_or(|at| at.elapsed() >= HELP_EVERY) {
            session.run(async |c| notify(c, HELP_CHANNEL, &outbox).await).await?;
            help_sent = Some(std::time::Instant::now());
            whole_seen = whole;
        }
    }
}

/// The pause of a busy listener between two wake-ups: the time in which a quarter of a batch
/// arrives at the rate rows were claimed lately, at least [`BUSY_TICK`] and at most the
/// dispatcher's [`linger`](crate::DispatcherConfig::linger).
///
/// In steady traffic a claim then takes a quarter of a batch, or what arrives within the
/// linger, rather than the few rows a fixed short pause gathers: a claim costs the database a
/// statement, a commit and a finalize of its own whatever it takes (docs/benchmarks.md, "Cost
/// per message in steady traffic", has the figures). A faster stream gets a shorter pause and
/// claims as large.
#[derive(Debug)]
struct Linger {
    /// Rows claimed a second, smoothed over the last wake-ups (0: not known yet).
    rate: f64,
    /// Rows claimed by `at`.
    rows: u64,
    at: std::time::Instant,
}

impl Linger {
    /// Weight of the newest measure in the smoothed rate.
    const WEIGHT: f64 = 0.3;

    fn new(rows: u64) -> Self {
        Self { rate: 0.0, rows, at: std::time::Instant::now() }
    }

    /// The next pause, the claims having taken `rows` rows so far, the batch being `batch` and
    /// the linger `most`.
    fn next(&mut self, rows: u64, batch: u64, most: Duration) -> Duration {
        let now = std::time::Instant::now();
        let elapsed = now.duration_since(self.at).as_secs_f64();
        if elapsed >= BUSY_TICK.as_secs_f64() / 2.0 {
            let measured = rows.saturating_sub(self.rows) as f64 / elapsed;
            self.rate = if self.rate == 0.0 { measured } else { self.rate + Self::WEIGHT * (measured - self.rate) };
            self.rows = rows;
            self.at = now;
        }
        Self::pause(self.rate, batch, most)
    }

    /// The time in which a quarter of `batch` arrives at `rate` rows a second, at least
    /// [`BUSY_TICK`] and at most `most` (when that is longer).
    fn pause(rate: f64, batch: u64, most: Duration) -> Duration {
        // A rate of 0 (or one so small that the time is past any `Duration`): the linger.
        let fill = Duration::try_from_secs_f64((batch / 4).max(1) as f64 / rate).unwrap_or(most);
        fill.min(most).max(BUSY_TICK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A busy listener's pause: the time a quarter of a batch takes to arrive, within 2 ms and
    /// the linger.
    #[test]
    fn the_pause_gathers_a_quarter_of_a_batch_within_the_linger() {
        let ms = Duration::from_millis;
        let linger = ms(20);
        assert_eq!(Linger::pause(10_000.0, 200, linger), ms(5), "50 rows at 10,000 a second");
        assert_eq!(Linger::pause(2_000.0, 200, linger), ms(20), "50 rows would take 25 ms: the linger");
        assert_eq!(Linger::pause(2_000.0, 80, linger), ms(10), "20 rows at 2,000 a second");
        assert_eq!(Linger::pause(100_000.0, 200, linger), BUSY_TICK, "never under the busy tick");
        assert_eq!(Linger::pause(0.0, 200, linger), linger, "no rate known yet: the linger");
        assert_eq!(Linger::pause(1e-300, 200, linger), linger, "a rate near 0: the linger");
        assert_eq!(Linger::pause(2_000.0, 200, Duration::ZERO), BUSY_TICK, "a linger of 0 is the busy tick");
    }

    /// The rate is measured from the rows the claims took between two wake-ups.
    #[test]
    fn the_pause_follows_the_rate_rows_are_claimed_at() {
        let mut linger = Linger::new(0);
        linger.at -= Duration::from_millis(100);
        // 1,000 rows in 100 ms: 10,000 a second, 50 rows in 5 ms.
        let pause = linger.next(1_000, 200, Duration::from_millis(20));
        assert!((5.0..=6.0).contains(&(pause.as_secs_f64() * 1e3)), "{pause:?}");
    }
    use diesel::result::{DatabaseErrorKind, Error};

    /// The listener's session through a transaction pooler loses its prepared statements too:
    /// its log line says what is wrong and what to set, as the claims' and finalizes' do.
    #[test]
    fn a_lost_prepared_statement_of_the_listener_names_the_pooler_and_the_fix() {
        let lost = Error::DatabaseError(
            DatabaseErrorKind::Unknown,
            Box::new(r#"prepared statement "s16" does not exist"#.to_owned()),
        );
        let failed = Failed::from(lost);
        assert!(matches!(failed, Failed::Store(StoreError::BehindTransactionPooler(_))), "{failed:?}");
        let message = failed.to_string();
        assert!(message.contains(r#"prepared statement "s16" does not exist"#), "{message}");
        assert!(message.contains("transaction pooler") && message.contains("`--pooler transaction`"), "{message}");
        let other = Error::DatabaseError(DatabaseErrorKind::Unknown, Box::new("canceling statement".to_owned()));
        assert_eq!(Failed::from(other).to_string(), "database query failed: canceling statement");
    }
}
