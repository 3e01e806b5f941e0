//! The dispatcher's in-flight window, shared by its workers: every worker's window for a
//! dispatcher alone in its actix system; beside another, kept short in front of a sink whose
//! answers queue, and opened to every worker's window for a sink slow in parallel.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_outbox::dispatcher::{GetMetrics, Shutdown};
use actix_outbox::sink::{ChannelSink, publisher_fn};
use actix_outbox::{DispatcherConfig, OutboxMessage, OutboxSupervisor};

use actix_outbox_test_support::{PATIENCE, TestDb, eventually, saw};

/// Publishes under way at once, and the most seen.
#[derive(Default)]
struct Concurrency {
    now: AtomicUsize,
    peak: AtomicUsize,
    published: AtomicUsize,
}

impl Concurrency {
    fn enter(&self) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
        self.published.fetch_add(1, Ordering::SeqCst);
    }
}

/// Four workers claiming 50 rows, each holding up to 100: one worker's window is 100 rows,
/// all of theirs 400.
fn config() -> DispatcherConfig {
    DispatcherConfig::default().workers(4).batch(50).max_in_flight(100).poll_interval(Duration::from_millis(50))
}

/// Whether another dispatcher (of another outbox, idle) runs in the same actix system.
#[derive(Clone, Copy)]
enum Beside {
    Nothing,
    AnotherOutbox,
}

/// How long a run goes on.
#[derive(Clone, Copy)]
enum Until {
    /// Every one of this many rows is done: for a bound the whole drain must keep.
    AllDone(usize),
    /// The sink has seen this many publishes at once: for a window that must open, however
    /// long the host takes to get there (a backlog far larger than it needs is seeded).
    PeakReaches(usize),
}

/// Rows seeded for [`Until::PeakReaches`]: at 400 in flight and 300 ms a publish, a minute's
/// worth on a fast host.
const BACKLOG: usize = 20_000;

/// Runs the dispatcher over a seeded table through `sink`, counting its concurrency, until
/// `until`; returns the peak.
async fn drain(
    until: Until,
    concurrency: Arc<Concurrency>,
    sink: impl actix_outbox::Publisher,
    beside: Beside,
) -> usize {
    let db = TestDb::new().await;
    let rows = match until {
        Until::AllDone(rows) => rows,
        Until::PeakReaches(_) => BACKLOG,
    };
    db.seed(rows, "a").await;
    let other = match beside {
        Beside::Nothing => None,
        Beside::AnotherOutbox => Some(TestDb::new().await),
    };
    let neighbour = other
        .as_ref()
        .map(|other| OutboxSupervisor::start(config(), other.pool.clone(), ChannelSink::new().0).unwrap());
    let dispatcher = OutboxSupervisor::start(config(), db.pool.clone(), sink).unwrap();
    match until {
        Until::AllDone(rows) => {
            eventually(PATIENCE, &format!("{rows} rows done"), || async {
                saw(db.count_status("done").await, |v| *v == rows as i64)
            })
            .await
        }
        Until::PeakReaches(peak) => {
            eventually(PATIENCE, &format!("{peak} publishes at once"), || async {
                saw(concurrency.peak.load(Ordering::SeqCst), |v| *v >= peak)
            })
            .await
        }
    }
    dispatcher.send(Shutdown).await.unwrap();
    let metrics = dispatcher.send(GetMetrics).await.unwrap();
    if let Some(neighbour) = neighbour {
        neighbour.send(Shutdown).await.unwrap();
    }
    // The shutdown waited for every publish under way and its finalize.
    let published = concurrency.published.load(Ordering::SeqCst);
    assert_eq!((metrics.published, metrics.done, metrics.lost_leases), (published as u64, published as u64, 0));
    assert_eq!(db.count_status("done").await, published as i64, "each row published once, and done");
    if let Until::AllDone(rows) = until {
        assert_eq!((metrics.claimed, published), (rows as u64, rows), "each row published once");
    }
    concurrency.peak.load(Ordering::SeqCst)
}

/// A sink that takes one message at a time, a millisecond each (a broker's queue): every row in
/// flight beyond what it is working on only waits.
fn queueing_sink(concurrency: &Arc<Concurrency>) -> impl actix_outbox::Publisher {
    let queue = Arc::new(tokio::sync::Mutex::new(()));
    let seen = concurrency.clone();
    publisher_fn(async move |_: Arc<OutboxMessage>| {
        seen.enter();
        {
            let _turn = queue.lock().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen.leave();
        Ok(())
    })
}

/// Beside another outbox's dispatcher, in front of a queueing sink the window stays at one
/// worker's window, 100 rows, where the four workers would hold 400: the other outbox's
/// messages would wait behind them.
#[actix_rt::test]
async fn beside_another_outbox_a_sink_whose_answers_queue_gets_one_workers_window_not_four() {
    let concurrency = Arc::new(Concurrency::default());
    let peak =
        drain(Until::AllDone(2_000), concurrency.clone(), queueing_sink(&concurrency), Beside::AnotherOutbox).await;
    assert!(peak <= 100, "at most one worker's window in flight in front of a queueing sink, saw {peak}");
    assert!(peak >= 50, "at least a batch in flight, saw {peak}");
}

/// Alone in its actix system, the dispatcher keeps every worker's window whatever the sink's
/// answer times: nobody else's messages wait behind its rows.
#[actix_rt::test]
async fn alone_a_dispatcher_keeps_every_workers_window() {
    let concurrency = Arc::new(Concurrency::default());
    // Not exactly 400 at the sink: a row whose answer came is in flight until its finalize, while
    // the sink already works on the next.
    let peak = drain(Until::PeakReaches(301), concurrency.clone(), queueing_sink(&concurrency), Beside::Nothing).await;
    assert!(peak > 300, "more than three workers' windows in flight at once, saw {peak}");
}

/// A sink that answers in 300 ms whatever the load (an HTTP endpoint serving in parallel): no
/// queueing, so even beside another outbox the window opens to every worker's, 400 rows.
#[actix_rt::test]
async fn beside_another_outbox_a_sink_slow_in_parallel_gets_every_workers_window() {
    let concurrency = Arc::new(Concurrency::default());
    let seen = concurrency.clone();
    let sink = publisher_fn(async move |_: Arc<OutboxMessage>| {
        seen.enter();
        tokio::time::sleep(Duration::from_millis(300)).await;
        seen.leave();
        Ok(())
    });
    let peak = drain(Until::PeakReaches(400), concurrency, sink, Beside::AnotherOutbox).await;
    assert_eq!(peak, 400, "every worker's window in flight, and never more");
}
