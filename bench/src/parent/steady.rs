//! The driver of the steady phases (loaded latency, held horizon, soak): the relay's children
//! started over an empty table and shown to deliver, a producer at a steady rate, the
//! consumer's deliveries joined with the commits, and every [`SAMPLE`] a hand back to the
//! phase, which takes the [`Reading`]s it wants meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use diesel_async::SimpleAsyncConnection;

use super::Names;
use super::bench_conn::BenchConn;
use super::kids::Kids;
use super::latencies::Join;
use super::meter::{Now, Reading};
use super::pg_procs::PgProcs;
use super::producer::{Plan, Produced, ProducerThread, insert_row};
use super::statements::{self, Statements};
use super::tally::{Tally, tally_of};
use crate::{BoxError, Opts, REPORT_PERIOD, RetentionArg, SETTLE};

/// How often PostgreSQL's processes are sampled and the phase gets the hand.
pub(super) const SAMPLE: Duration = Duration::from_millis(250);

/// How long the relay has to deliver the probe row that shows it is up.
const PROBE_WITHIN: Duration = Duration::from_secs(30);

/// One steady phase under way.
pub(super) struct Steady<'a> {
    kids: Kids,
    tally: &'a Mutex<Tally>,
    /// The bench's sampling connection: readings, `pg_stat_activity`, statements.
    sampler: BenchConn,
    procs: Option<PgProcs>,
    /// Whether the server keeps `pg_stat_statements`.
    statements: bool,
    /// Until it is done.
    producing: Option<ProducerThread>,
    produced: Option<Produced>,
    started: tokio::time::Instant,
    next_sample: tokio::time::Instant,
    /// Transactions of the bench's own connections to its database.
    bench_xacts: Arc<AtomicU64>,
    /// What the children print that the phase does not need.
    ignored: HashMap<i64, SystemTime>,
}

impl<'a> Steady<'a> {
    /// Empties the table, starts the relay (`args`: one child each), waits until it has
    /// delivered a probe row, and starts producing `plan` with `opts.producer`.
    pub(super) async fn start(
        opts: &Opts,
        names: &Names,
        args: &[Vec<String>],
        plan: Plan,
        tally: &'a Arc<Mutex<Tally>>,
    ) -> Result<Self, BoxError> {
        if plan.rate == 0 || plan.seconds == 0 || plan.connections == 0 {
            return Err("--rate, --seconds (--minutes) and --producers must be at least 1".into());
        }
        if opts.producer == crate::ProducerKind::Pgbench && opts.retention == RetentionArg::Delete {
            return Err("--producer pgbench reads each row's commit from the table: not with --retention delete".into());
        }
        let bench_xacts = Arc::new(AtomicU64::new(0));
        let mut sampler = BenchConn::connect(&names.database_url, "sampler", bench_xacts.clone()).await?;
        sampler.one().batch_execute("TRUNCATE outbox").await?;
        let statements = statements::enable(sampler.one()).await?;
        let mut producer =
            ProducerThread::start(opts.producer, plan, names.database_url.clone(), tally.clone(), bench_xacts.clone())
                .await?;
        let (mut kids, mut ignored) = Kids::settled(args, SETTLE).await?;
        probe(&mut kids, &mut ignored, &mut sampler, tally, plan.pad as i32).await?;
        let procs = PgProcs::begin(&mut sampler, &names.database).await?;
        let origin = SystemTime::now();
        let started = tokio::time::Instant::now();
        {
            let mut tally = tally_of(tally);
            tally.expect(0, 0, false);
            tally.join = Some(Join::new(origin));
        }
        producer.go(started);
        Ok(Self {
            kids,
            tally,
            sampler,
            procs,
            statements,
            producing: Some(producer),
            produced: None,
            started,
            next_sample: started + SAMPLE,
            bench_xacts,
            ignored,
        })
    }

    /// Seconds since production started.
    pub(super) fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Waits for the next sample and returns the seconds since production started, or `None`
    /// once the producer is done (then [`Steady::produced`] says what it did).
    pub(super) async fn tick(&mut self) -> Result<Option<f64>, BoxError> {
        loop {
            let Some(producing) = self.producing.as_mut() else { return Ok(None) };
            tokio::select! {
                done = producing.done() => {
                    self.produced = Some(done?);
                    self.producing = None;
                    self.sample().await?;
                    return Ok(None);
                }
                line = self.kids.lines.recv() => match line {
                    Some(line) => self.kids.apply(line, &mut self.ignored)?,
                    None => return Err("relay children vanished".into()),
                },
                () = tokio::time::sleep_until(self.next_sample) => {
                    self.next_sample += SAMPLE;
                    self.sample().await?;
                    return Ok(Some(self.elapsed()));
                }
            }
        }
    }

    async fn sample(&mut self) -> Result<(), BoxError> {
        if let Some(procs) = &mut self.procs {
            procs.sample(&mut self.sampler).await?;
        }
        Ok(())
    }

    /// What the producer did (once [`Steady::tick`] has returned `None`).
    pub(super) fn produced(&self) -> Option<&Produced> {
        self.produced.as_ref()
    }

    /// `f` of the join of commits and deliveries.
    pub(super) fn with_join<R>(&self, f: impl FnOnce(&mut Join) -> R) -> R {
        let mut tally = tally_of(self.tally);
        f(tally.join.as_mut().expect("a steady phase has a join"))
    }

    /// Every counter, now.
    pub(super) async fn reading(&mut self) -> Result<Reading, BoxError> {
        self.sample().await?;
        let (committed, delivered) = self.with_join(|j| (j.committed, j.arrivals));
        let pids = self.kids.pids();
        let now = Now {
            procs: self.procs.as_ref(),
            relay_pids: &pids,
            committed,
            delivered,
            bench_xacts: self.bench_xacts(),
        };
        Reading::take(&mut self.sampler, now).await
    }

    /// The statements' counters now, where the server keeps them.
    pub(super) async fn statements(&mut self) -> Result<Option<Statements>, BoxError> {
        match self.statements {
            true => Ok(Some(Statements::read(&mut self.sampler).await?)),
            false => Ok(None),
        }
    }

    /// Transactions the bench's own connections to its database have committed so far.
    pub(super) fn bench_xacts(&self) -> u64 {
        self.bench_xacts.load(Ordering::Relaxed)
    }

    /// A connection of the bench's own to its database, counted with the others.
    pub(super) async fn connect(&self, names: &Names, role: &str) -> Result<BenchConn, BoxError> {
        BenchConn::connect(&names.database_url, role, self.bench_xacts.clone()).await
    }

    /// The sampling connection, for the phase's own statements.
    pub(super) fn sampler(&mut self) -> &mut BenchConn {
        &mut self.sampler
    }

    /// Waits until every committed row is delivered, for `within` at most; returns how many
    /// were not.
    pub(super) async fn drain(&mut self, within: Duration) -> Result<usize, BoxError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let backlog = self.with_join(|j| j.backlog());
            if backlog == 0 {
                return Ok(0);
            }
            tokio::select! {
                line = self.kids.lines.recv() => match line {
                    Some(line) => self.kids.apply(line, &mut self.ignored)?,
                    None => return Err("relay children vanished".into()),
                },
                () = tokio::time::sleep(REPORT_PERIOD) => {}
                () = tokio::time::sleep_until(deadline) => return Ok(backlog),
            }
        }
    }

    /// Stops the relay; its children's final reports.
    pub(super) async fn stop(self) -> Result<Vec<serde_json::Value>, BoxError> {
        self.kids.stop(Duration::from_secs(90)).await
    }
}

/// Inserts one row and waits until the consumer has it: the relay is up and delivering.
async fn probe(
    kids: &mut Kids,
    ignored: &mut HashMap<i64, SystemTime>,
    sampler: &mut BenchConn,
    tally: &Mutex<Tally>,
    pad: i32,
) -> Result<(), BoxError> {
    tally_of(tally).expect(0, 0, true);
    let id = insert_row(sampler.one(), 0, pad).await?;
    let deadline = tokio::time::Instant::now() + PROBE_WITHIN;
    while !tally_of(tally).arrivals.as_ref().is_some_and(|a| a.contains_key(&id)) {
        tokio::select! {
            line = kids.lines.recv() => match line {
                Some(line) => kids.apply(line, ignored)?,
                None => return Err("relay children vanished".into()),
            },
            () = tokio::time::sleep(REPORT_PERIOD) => {}
            () = tokio::time::sleep_until(deadline) => {
                return Err(format!("the relay did not deliver a probe row within {PROBE_WITHIN:?}").into());
            }
        }
    }
    Ok(())
}

/// The command line of a child of the held-horizon and soak phases: `actix-outbox run` with
/// [`run_args`].
pub(super) fn run_child(opts: &Opts, names: &Names) -> Vec<String> {
    ["child-run", "--"].into_iter().map(str::to_owned).chain(run_args(opts, names)).collect()
}

/// `actix-outbox run`'s arguments: the bench's database, exchange and broker, the bench's
/// dispatcher options that differ from the defaults, then `--relay-arg`s.
pub(super) fn run_args(opts: &Opts, names: &Names) -> Vec<String> {
    let defaults = actix_outbox::DispatcherConfig::default();
    let mut args: Vec<String> = Vec::new();
    args.extend(["--database-url", &names.database_url, "--amqp-url", &opts.amqp_url].map(str::to_owned));
    args.extend(["--exchange".to_owned(), names.exchange.clone()]);
    if opts.workers != defaults.workers {
        args.extend(["--workers".to_owned(), opts.workers.to_string()]);
    }
    if opts.batch != defaults.batch {
        args.extend(["--batch".to_owned(), opts.batch.to_string()]);
    }
    if let Some(n) = opts.max_in_flight {
        args.extend(["--max-in-flight".to_owned(), n.to_string()]);
    }
    if let Some(rate) = opts.max_rate {
        args.extend(["--max-rate".to_owned(), rate.to_string()]);
    }
    if opts.fifo {
        args.push("--fifo".to_owned());
    }
    if opts.retention == RetentionArg::Delete {
        args.extend(["--retention".to_owned(), "delete".to_owned()]);
    }
    if opts.no_outbox_headers {
        args.push("--no-outbox-headers".to_owned());
    }
    args.extend(opts.relay_args());
    args
}
