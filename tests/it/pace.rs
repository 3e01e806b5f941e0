//! The pace (`DispatcherConfig::max_rate`): a capped drain through the real broker keeps to
//! its cap, a queue that rejects publishes slows the pace until it takes them again, and the
//! cap changes while the dispatcher runs.

use std::collections::BTreeSet;
use std::time::Duration;

use actix_outbox::admin::Status;
use actix_outbox::dispatcher::{GetPace, SetMaxRate, Shutdown};
use actix_outbox::sink::{RabbitConfig, RabbitSink};
use actix_outbox::testkit::MemorySink;
use actix_outbox::{ConfigError, DispatcherConfig, OutboxSupervisor};
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::{AMQPValue, FieldTable};

use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_url, eventually, saw, unique};

const WITHIN: Duration = PATIENCE;

fn sink_config(exchange: &str) -> RabbitConfig {
    RabbitConfig::new(amqp_url())
        .exchange(exchange)
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

/// Every row's `done_at`, oldest first.
async fn done_times(db: &TestDb) -> Vec<DateTime<Utc>> {
    let mut times: Vec<_> = db.rows().await.into_iter().map(|r| r.done_at.expect("every row done")).collect();
    times.sort();
    times
}

/// 1,500 rows through the real broker at a cap of 300 a second: the drain's rate, first row
/// done to last (database clock), is not over the cap, and no three seconds of it finished more
/// than 10 % over the cap. (The pace gates claims; a
/// row is done a claim, a publish and a finalize later, and that lag varies with the host's
/// load: over one second a lag that shrinks by a tenth of a second would show as a burst of a
/// tenth of the cap that no claim made. Three seconds leave the lag's swing a third of that.)
/// How close to the cap a drain keeps depends on the host's speed (a confirm slower than a
/// second counts as pushback and slows the pace): that figure is the bench's (`--phases drain`,
/// docs/benchmarks.md, "A paced drain").
#[actix_rt::test]
async fn a_capped_drain_never_goes_over_its_cap() {
    const CAP: f64 = 300.0;
    const ROWS: usize = 1500;
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("pace").await;
    db.seed(ROWS, "a").await;
    let sink = RabbitSink::connect(sink_config(&broker.exchange)).await.unwrap();
    let config = DispatcherConfig::default().poll_interval(Duration::from_millis(50)).max_rate(CAP);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();
    assert_eq!(dispatcher.send(GetPace).await.unwrap().max_rate, Some(CAP));

    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == ROWS as i64) }).await;
    dispatcher.send(Shutdown).await.unwrap();
    let times = done_times(&db).await;
    let span = (times[ROWS - 1] - times[0]).to_std().unwrap().as_secs_f64();
    let rate = (ROWS - 1) as f64 / span;
    assert!(rate <= CAP * 1.1, "drained at {rate:.1}/s over {span:.2} s, cap {CAP}/s");
    for (i, start) in times.iter().enumerate() {
        let in_three = times[i..].iter().take_while(|t| **t - *start < chrono::TimeDelta::seconds(3)).count();
        assert!(in_three as f64 <= 3.0 * CAP * 1.1, "{in_three} rows done in the three seconds from row {i}");
    }
    let delivered: BTreeSet<i64> = broker.message_ids(&queue, ROWS).await.into_iter().collect();
    assert_eq!(delivered.len(), ROWS);
    sink.close().await;
}

/// A queue over its `x-max-length` with `reject-publish` nacks the dispatcher's publishes: the
/// pace halves below its cap while they are refused, every row stays pending for another try
/// (none dead), and once a consumer empties the queue every row arrives once and the pace goes
/// back to its cap.
#[actix_rt::test]
async fn a_queue_that_rejects_publishes_slows_the_pace_until_it_takes_them() {
    const CAP: f64 = 200.0;
    const ROWS: usize = 300;
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("pushback").await;
    broker.declare(lapin::ExchangeKind::Topic).await;
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongInt(20));
    arguments.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    let queue = broker.queue(&["#"], arguments).await;
    let ids: BTreeSet<i64> = db.seed(ROWS, "a").await.into_iter().collect();
    let sink = RabbitSink::connect(sink_config(&broker.exchange)).await.unwrap();
    let config = DispatcherConfig::default()
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(20))
        .backoff_cap(Duration::from_millis(200))
        .max_attempts(1000)
        .max_rate(CAP);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();

    eventually(WITHIN, "the pace below its cap", || async {
        saw(dispatcher.send(GetPace).await.unwrap(), |pace| pace.is_pushed_back())
    })
    .await;
    let pace = dispatcher.send(GetPace).await.unwrap();
    assert!(pace.rate.unwrap() <= CAP / 2.0, "{pace:?}");
    assert_eq!(db.count_status("dead").await, 0);
    assert!(db.count_status("done").await < ROWS as i64);

    // A consumer drains the queue: the publishes are taken again.
    let mut consumer = broker
        .channel
        .basic_consume(
            queue.as_str().into(),
            unique("c").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut delivered = Vec::new();
    tokio::time::timeout(WITHIN, async {
        while delivered.len() < ROWS {
            let delivery = consumer.next().await.expect("consumer open").expect("delivery");
            delivered.push(delivery.properties.message_id().as_ref().unwrap().as_str().parse::<i64>().unwrap());
            delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
    })
    .await
    .unwrap_or_else(|_| panic!("only {} of {ROWS} arrived", delivered.len()));
    assert_eq!(delivered.iter().copied().collect::<BTreeSet<_>>(), ids, "every row once");
    assert_eq!(delivered.len(), ROWS, "no row twice");
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == ROWS as i64) }).await;
    eventually(WITHIN, "the pace back at its cap", || async {
        saw(dispatcher.send(GetPace).await.unwrap().rate, |v| *v == Some(CAP))
    })
    .await;
    for id in &ids {
        assert_eq!(db.row(*id).await.status, Status::Done, "row {id}");
    }
    dispatcher.send(Shutdown).await.unwrap();
    sink.close().await;
}

/// The cap of a running dispatcher: at 5 a second, no more rows are done after two seconds than
/// the cap allows; a cap that is not a number above zero is refused and the old one stays; lifting the
/// cap drains the rest at once.
#[actix_rt::test]
async fn the_cap_changes_while_the_dispatcher_runs() {
    let db = TestDb::new().await;
    db.seed(400, "a").await;
    let sink = MemorySink::new();
    let config = DispatcherConfig::default().poll_interval(Duration::from_millis(50)).max_rate(5.0);
    let started = std::time::Instant::now();
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), sink.clone()).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let early = sink.published().len();
    // At 5 a second since the start (two seconds, or more on a loaded host that wakes the test
    // late), plus the bucket it starts with (one row).
    let allowed = 1 + (5.0 * started.elapsed().as_secs_f64()).ceil() as usize;
    assert!(early <= allowed, "{early} published in the first {:?} at 5/s", started.elapsed());

    for bad in [0.0, -3.0, f64::NAN, f64::INFINITY] {
        let refused = dispatcher.send(SetMaxRate(Some(bad))).await.unwrap().unwrap_err();
        assert!(matches!(refused, ConfigError::BadMaxRate(_)), "{bad}: {refused:?}");
    }
    let pace = dispatcher.send(GetPace).await.unwrap();
    assert_eq!((pace.max_rate, pace.rate), (Some(5.0), Some(5.0)));

    dispatcher.send(SetMaxRate(None)).await.unwrap().unwrap();
    let pace = dispatcher.send(GetPace).await.unwrap();
    assert_eq!((pace.max_rate, pace.rate), (None, None));
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 400) }).await;
    let mut ids = sink.published_ids();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 400);
    dispatcher.send(Shutdown).await.unwrap();

    let refused = DispatcherConfig::default().max_rate(0.0).validate().unwrap_err();
    assert_eq!(refused, ConfigError::BadMaxRate("0".into()));
    assert_eq!(refused.to_string(), "max rate must be a number of messages a second above zero, not 0");
}
