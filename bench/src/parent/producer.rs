//! The steady phases' producer: single-row commits at a rate for a time, each row's commit
//! instant handed to the tally's [`Join`](super::latencies::Join).
//!
//! - `--producer bench`: this process, on `--producers` connections. Row *k* has the slot
//!   *start + k / rate*; each connection takes the next slot, waits for its instant and commits
//!   (a late slot goes at once, so a producer that cannot keep up shows as a lower achieved
//!   rate, never as fewer rows). Its commit instant is when the `INSERT` (autocommit) returned.
//! - `--producer pgbench`: PostgreSQL's `pgbench -R rate -T seconds` (Poisson arrivals) with
//!   `--producers` clients, the plain four-column `INSERT`, `synchronous_commit = off` (its
//!   commits do not wait for the WAL flush, so they cost the machine little). Its commit
//!   instants are the rows' `created_at` (the transaction's start, which precedes its commit
//!   by the insert itself), read from the table every [`POLL`] by primary key; rows commit out
//!   of id order, so the reading keeps a low-water mark and looks above it again.

use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::sql_types::{BigInt, Int4, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde::Serialize;
use tokio::sync::oneshot;

use super::bench_conn::{BenchConn, PRODUCER_APP, named};
use super::own_server::BIN;
use super::tally::{Tally, tally_of};
use crate::{BoxError, EVENT_TYPE, ProducerKind};

/// How often pgbench's new rows are read.
const POLL: Duration = Duration::from_millis(500);

/// How long a missing id may stay missing below rows that are there (a transaction still
/// open, or one rolled back) before the reading stops waiting for it.
const GIVE_UP: Duration = Duration::from_secs(30);

/// How long after pgbench ends its last rows may take to be read.
const LAST_ROWS_WITHIN: Duration = Duration::from_secs(10);

/// What to produce.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) rate: u32,
    pub(super) seconds: u32,
    pub(super) connections: usize,
    /// Bytes of padding in each payload.
    pub(super) pad: usize,
}

impl Plan {
    pub(super) fn rows(&self) -> usize {
        self.rate as usize * self.seconds as usize
    }
}

/// What the producer did.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Produced {
    pub(super) rows: u64,
    /// Seconds from the start to the last commit.
    pub(super) last_commit_s: f64,
    /// pgbench: ids the reading gave up waiting for (none without a fault).
    pub(super) skipped: u64,
    /// pgbench: the lines of its own summary that say what it did.
    pub(super) summary: Vec<String>,
}

/// A producer on a thread of its own, with its own runtime and connections: the instant it
/// notes a commit does not wait for whatever else the bench is doing (sampling `/proc`, reading
/// counters). Dropping it stops the production.
pub(super) struct ProducerThread {
    go: Option<oneshot::Sender<tokio::time::Instant>>,
    done: oneshot::Receiver<Result<Produced, String>>,
    /// Dropped to stop the production early.
    _stop: oneshot::Sender<()>,
}

impl ProducerThread {
    /// Starts the thread and connects the producer (`kind`, to `url`); returns once it is
    /// ready to [`ProducerThread::go`].
    pub(super) async fn start(
        kind: ProducerKind,
        plan: Plan,
        url: String,
        tally: Arc<Mutex<Tally>>,
        xacts: Arc<AtomicU64>,
    ) -> Result<Self, BoxError> {
        let (ready_tx, ready_rx) = oneshot::channel::<()>();
        let (go_tx, go_rx) = oneshot::channel::<tokio::time::Instant>();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (done_tx, mut done) = oneshot::channel();
        std::thread::Builder::new().name("producer".into()).spawn(move || {
            let produce = async move {
                let poller = BenchConn::connect(&url, "poller", xacts).await?;
                let producer = Producer::connect(kind, plan, &url, poller).await?;
                let _ = ready_tx.send(());
                let started = go_rx.await.map_err(|_| "the producer was not started")?;
                tokio::select! {
                    produced = producer.run(plan, &tally, started) => produced,
                    _ = stop_rx => Err("the production was stopped".into()),
                }
            };
            let result = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt.block_on(produce).map_err(|e: BoxError| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let _ = done_tx.send(result);
        })?;
        if ready_rx.await.is_err() {
            let failure = (&mut done).await.ok().and_then(Result::err);
            return Err(failure.unwrap_or_else(|| "the producer's thread ended".to_owned()).into());
        }
        Ok(Self { go: Some(go_tx), done, _stop: stop_tx })
    }

    /// Starts producing: row *k*'s slot is `started + k / rate`.
    pub(super) fn go(&mut self, started: tokio::time::Instant) {
        if let Some(go) = self.go.take() {
            let _ = go.send(started);
        }
    }

    /// What the producer did, once it is done.
    pub(super) async fn done(&mut self) -> Result<Produced, BoxError> {
        match (&mut self.done).await {
            Ok(result) => result.map_err(Into::into),
            Err(_) => Err("the producer's thread ended without a word".into()),
        }
    }
}

/// A producer, connected and ready to start.
enum Producer {
    Bench(Vec<AsyncPgConnection>),
    Pgbench(Box<Pgbench>),
}

/// pgbench, ready to start: its command, its folder, and the reading of its rows.
struct Pgbench {
    command: Command,
    dir: Folder,
    poller: BenchConn,
}

impl Producer {
    /// Opens the producer's connections to `url` (or prepares pgbench's run, and `poller` to
    /// read its rows).
    async fn connect(kind: ProducerKind, plan: Plan, url: &str, poller: BenchConn) -> Result<Self, BoxError> {
        match kind {
            ProducerKind::Bench => {
                let mut conns = Vec::with_capacity(plan.connections);
                for _ in 0..plan.connections {
                    conns.push(AsyncPgConnection::establish(&named(url, PRODUCER_APP)).await?);
                }
                Ok(Self::Bench(conns))
            }
            ProducerKind::Pgbench => Ok(Self::Pgbench(Box::new(Pgbench::prepare(plan, url, poller).await?))),
        }
    }

    /// Produces the plan from `started` on, handing each commit to `tally`'s join.
    async fn run(self, plan: Plan, tally: &Mutex<Tally>, started: tokio::time::Instant) -> Result<Produced, BoxError> {
        match self {
            Self::Bench(conns) => produce(conns, plan, tally, started).await,
            Self::Pgbench(pgbench) => pgbench.run(tally, started).await,
        }
    }
}

/// The bench's own producer.
async fn produce(
    conns: Vec<AsyncPgConnection>,
    plan: Plan,
    tally: &Mutex<Tally>,
    started: tokio::time::Instant,
) -> Result<Produced, BoxError> {
    let total = plan.rows();
    let pad = plan.pad as i32;
    let next = std::cell::Cell::new(0_usize);
    let slot = |k: usize| started + Duration::from_secs_f64(k as f64 / f64::from(plan.rate));
    let produce = |mut conn: AsyncPgConnection| {
        let next = &next;
        async move {
            loop {
                let k = next.get();
                if k >= total {
                    break;
                }
                next.set(k + 1);
                tokio::time::sleep_until(slot(k)).await;
                let id = insert_row(&mut conn, k, pad).await?;
                // The autocommit INSERT has returned: the row is committed and visible.
                let committed = SystemTime::now();
                if let Some(join) = tally_of(tally).join.as_mut() {
                    join.committed(id, committed);
                }
            }
            Ok::<_, BoxError>(())
        }
    };
    for done in futures_util::future::join_all(conns.into_iter().map(produce)).await {
        done?;
    }
    Ok(Produced { rows: total as u64, last_commit_s: started.elapsed().as_secs_f64(), ..Produced::default() })
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Commits the bench's row number `n` (its aggregate `n % 1000`, `pad` bytes of padding) in a
/// transaction of its own, as a producer would; returns its id.
pub(super) async fn insert_row(conn: &mut AsyncPgConnection, n: usize, pad: i32) -> diesel::QueryResult<i64> {
    let row: Id = diesel::sql_query(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('bench', $1, $2, jsonb_build_object('n', $3::bigint, 'pad', repeat('x', $4)))
         RETURNING id",
    )
    .bind::<Text, _>((n % 1000).to_string())
    .bind::<Text, _>(EVENT_TYPE)
    .bind::<BigInt, _>(n as i64)
    .bind::<Int4, _>(pad)
    .get_result(conn)
    .await?;
    Ok(row.id)
}

impl Pgbench {
    async fn prepare(plan: Plan, url: &str, poller: BenchConn) -> Result<Self, BoxError> {
        let config = tokio_postgres::Config::from_str(url)?;
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
            _ => return Err("--producer pgbench needs a database URL with a TCP host".into()),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432).to_string();
        let user = config.get_user().ok_or("--producer pgbench needs a database URL with a user")?;
        let database = config.get_dbname().ok_or("--producer pgbench needs a database URL with a database")?;
        let dir = Folder::new()?;
        let script = dir.0.join("insert.sql");
        // The plain four-column INSERT any producer writes; the body as the bench's own rows'.
        let pad = "x".repeat(plan.pad);
        std::fs::write(
            &script,
            format!(
                "\\set n random(0, 999)\n\
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('bench', CAST(:n AS text), '{EVENT_TYPE}', '{{\"n\": 0, \"pad\": \"{pad}\"}}');\n"
            ),
        )?;
        let program = match std::path::Path::new(BIN).join("pgbench") {
            path if path.exists() => path.into_os_string(),
            _ => "pgbench".into(),
        };
        let log = std::fs::File::create(dir.0.join("pgbench.log"))?;
        let mut command = Command::new(program);
        command
            .args(["-n", "-h", &host, "-p", &port, "-U", user, "-j", "1"])
            .args(["-c", &plan.connections.to_string(), "-R", &plan.rate.to_string(), "-T", &plan.seconds.to_string()])
            .arg("-f")
            .arg(&script)
            .arg(database)
            .env("PGOPTIONS", "-c synchronous_commit=off")
            .env("PGAPPNAME", PRODUCER_APP)
            // Ctrl-C reaches the bench, which ends pgbench itself (see `Running`).
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(password) = config.get_password() {
            command.env("PGPASSWORD", String::from_utf8_lossy(password).as_ref());
        }
        Ok(Self { command, dir, poller })
    }

    async fn run(mut self, tally: &Mutex<Tally>, started: tokio::time::Instant) -> Result<Produced, BoxError> {
        // Every row there now (the relay's probe among them) is older than pgbench's.
        #[derive(diesel::QueryableByName)]
        struct Floor {
            #[diesel(sql_type = BigInt)]
            floor: i64,
        }
        let floor: Floor =
            diesel::sql_query("SELECT coalesce(max(id), 0) AS floor FROM outbox").get_result(self.poller.one()).await?;
        let mut child = Running(self.command.spawn().map_err(|e| format!("pgbench: {e}"))?);
        let mut seen = Seen::new(floor.floor);
        let mut last_commit = None;
        let status = loop {
            let exited = child.0.try_wait()?;
            self.read(&mut seen, tally, &mut last_commit).await?;
            if let Some(status) = exited {
                break status;
            }
            tokio::time::sleep(POLL).await;
        };
        let output = std::fs::read_to_string(self.dir.0.join("pgbench.log")).unwrap_or_default();
        if !status.success() {
            return Err(format!("pgbench failed ({status}): {}", output.trim()).into());
        }
        let processed = output
            .lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .and_then(|n| n.split(['/', ' ']).next()?.parse::<u64>().ok())
            .ok_or_else(|| format!("pgbench said nothing of its transactions: {}", output.trim()))?;
        let deadline = Instant::now() + LAST_ROWS_WITHIN;
        while seen.count < processed && Instant::now() < deadline {
            tokio::time::sleep(POLL / 2).await;
            self.read(&mut seen, tally, &mut last_commit).await?;
        }
        let last_commit_s = last_commit
            .and_then(|t| Some(tally_of(tally).join.as_ref()?.offset(t)))
            .unwrap_or_else(|| started.elapsed().as_secs_f64());
        let summary = output
            .lines()
            .filter(|l| {
                ["number of transactions actually processed", "number of failed", "rate limit schedule lag", "tps = "]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .map(str::to_owned)
            .collect();
        Ok(Produced {
            rows: seen.count,
            last_commit_s,
            skipped: seen.skipped + processed.saturating_sub(seen.count),
            summary,
        })
    }

    /// Reads the rows above the low-water mark and hands the new ones to the join.
    async fn read(
        &mut self,
        seen: &mut Seen,
        tally: &Mutex<Tally>,
        last_commit: &mut Option<SystemTime>,
    ) -> Result<(), BoxError> {
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            id: i64,
            #[diesel(sql_type = BigInt)]
            us: i64,
        }
        const PAGE: i64 = 50_000;
        loop {
            let rows: Vec<Row> = diesel::sql_query(
                "SELECT id, (extract(epoch FROM created_at) * 1e6)::int8 AS us
                 FROM outbox WHERE id > $1 ORDER BY id LIMIT $2",
            )
            .bind::<BigInt, _>(seen.after())
            .bind::<BigInt, _>(PAGE)
            .get_results(self.poller.one())
            .await?;
            let full = rows.len() as i64 == PAGE;
            let mut tally = tally_of(tally);
            for row in rows {
                if seen.see(row.id) {
                    let at = UNIX_EPOCH + Duration::from_micros(row.us.max(0) as u64);
                    *last_commit = Some(last_commit.map_or(at, |l| l.max(at)));
                    if let Some(join) = tally.join.as_mut() {
                        join.committed(row.id, at);
                    }
                }
            }
            drop(tally);
            seen.advance(Instant::now());
            if !full {
                return Ok(());
            }
        }
    }
}

/// The ids the reading has seen: every id up to `upto`, and those in `above`.
#[derive(Debug)]
struct Seen {
    upto: i64,
    above: BTreeSet<i64>,
    /// The lowest missing id and since when it has been missing.
    gap: Option<(i64, Instant)>,
    count: u64,
    skipped: u64,
}

impl Seen {
    fn new(floor: i64) -> Self {
        Self { upto: floor, above: BTreeSet::new(), gap: None, count: 0, skipped: 0 }
    }

    /// The reading looks at ids above this.
    fn after(&self) -> i64 {
        self.upto
    }

    /// Notes `id`; whether it is new.
    fn see(&mut self, id: i64) -> bool {
        if id <= self.upto || !self.above.insert(id) {
            return false;
        }
        self.count += 1;
        true
    }

    /// Moves the low-water mark over the ids seen without a gap, and over a gap missing for
    /// [`GIVE_UP`] already.
    fn advance(&mut self, now: Instant) {
        loop {
            while self.above.remove(&(self.upto + 1)) {
                self.upto += 1;
            }
            let Some(&next) = self.above.iter().next() else {
                self.gap = None;
                return;
            };
            let missing = self.upto + 1;
            match self.gap {
                Some((id, since)) if id == missing && now.duration_since(since) >= GIVE_UP => {
                    self.skipped += (next - missing) as u64;
                    self.upto = next - 1;
                    self.gap = None;
                }
                Some((id, _)) if id == missing => return,
                _ => {
                    self.gap = Some((missing, now));
                    return;
                }
            }
        }
    }
}

/// A temporary folder of the bench's own, removed when dropped.
struct Folder(PathBuf);

impl Folder {
    fn new() -> Result<Self, BoxError> {
        let dir = std::env::temp_dir().join(format!("outbox_bench_pgbench.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// pgbench running: killed if the phase ends before it does.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_committed_out_of_id_order_are_each_read_once() {
        let t0 = Instant::now();
        let mut seen = Seen::new(100);
        // 102 and 103 commit before 101.
        assert!(seen.see(102) && seen.see(103));
        seen.advance(t0);
        assert_eq!(seen.after(), 100, "101 may still commit: the next reading looks from 100 on");
        // Read again: 102 and 103 are not new; 101 is.
        assert!(!seen.see(102) && !seen.see(103));
        assert!(seen.see(101));
        seen.advance(t0);
        assert_eq!((seen.after(), seen.count, seen.skipped), (103, 3, 0));
        assert!(!seen.see(101), "below the mark");
    }

    #[test]
    fn a_gap_that_never_fills_is_given_up_after_a_while() {
        let t0 = Instant::now();
        let mut seen = Seen::new(0);
        // 1 and 2 are rolled back (or still open); 3 and 5 are there, 4 is missing too.
        assert!(seen.see(3) && seen.see(5));
        seen.advance(t0);
        seen.advance(t0 + GIVE_UP / 2);
        assert_eq!(seen.after(), 0);
        seen.advance(t0 + GIVE_UP);
        // 1 and 2 given up; 3 taken; 4 starts its own wait.
        assert_eq!((seen.after(), seen.skipped), (3, 2));
        assert!(seen.see(4), "a late row above the mark is still read");
        seen.advance(t0 + GIVE_UP);
        assert_eq!((seen.after(), seen.count, seen.skipped), (5, 3, 2));
    }
}
