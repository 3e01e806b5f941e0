//! `run` against grey failures: a database link that stops answering without closing (the
//! test proxy's freeze), and a database that goes silent altogether. The run, as an
//! operator would meet it: every setting at its default.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use actix_outbox::admin::Status;
use actix_outbox_test_support::{TestBroker, TestDb, amqp_url, database_addr, eventually};

use crate::common::*;
use crate::proxy::Proxy;

/// The flags of a `run` that publishes to `broker`'s exchange, every other setting at its
/// default.
fn flags(broker: &TestBroker) -> Vec<String> {
    ["--exchange", broker.exchange.as_str(), "--no-declare", "--amqp-url", amqp_url().as_str()]
        .map(str::to_owned)
        .to_vec()
}

/// 20,000 rows; when a third are done, the connections open to PostgreSQL freeze (nothing
/// forwarded, nothing closed; new connections pass). A WARN names the server and how long it
/// did not answer, every row ends done, none dead, none with more than two attempts, and
/// SIGTERM then exits 0 with nothing left processing.
#[tokio::test]
async fn a_frozen_database_link_mid_run_is_found_out_and_every_row_done() {
    const ROWS: usize = 20_000;
    let db = TestDb::new().await;
    let ids: BTreeSet<i64> = db.seed(ROWS, "agg").await.into_iter().collect();
    let (broker, queue) = TestBroker::with_queue("cli-grey").await;
    let proxy = Proxy::start(database_addr()).await;
    let args = flags(&broker);
    let mut run = Dispatcher::start(&proxy.route(&db.url), &args.iter().map(String::as_str).collect::<Vec<_>>());
    eventually(WITHIN, "a third done", || async { db.count_status("done").await >= ROWS as i64 / 3 }).await;
    let open = proxy.connections();
    proxy.freeze();
    let frozen_at = Instant::now();
    let silent = |l: &String| l.contains(" WARN ") && l.contains("did not answer within 5s");
    eventually(WITHIN, "a WARN that the database did not answer", || async { run.log().iter().any(silent) }).await;
    let warned_after = frozen_at.elapsed();
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == ROWS as i64 }).await;
    let done_after = frozen_at.elapsed();
    run.signal("TERM");
    let status = run.exit(Duration::from_secs(20)).await;
    let log = run.log();
    assert_eq!(status.code(), Some(0), "log:\n{}", log.join("\n"));

    let rows = db.rows().await;
    let max_attempts = rows.iter().map(|r| r.attempts).max().unwrap_or(0);
    let warned: Vec<&String> = log.iter().filter(|l| silent(l)).collect();
    eprintln!(
        "grey (cli): frozen database link: {open} connections frozen; first WARN after {:.1}s; every row done after \
         {:.1}s; {} such WARN lines; max attempts {max_attempts}; dead {}",
        warned_after.as_secs_f64(),
        done_after.as_secs_f64(),
        warned.len(),
        rows.iter().filter(|r| r.status == Status::Dead).count()
    );
    assert!(warned[0].contains(&proxy.addr().to_string()), "the WARN names the server: {}", warned[0]);
    assert_eq!(rows.iter().filter(|r| r.status != Status::Done).count(), 0, "every row done");
    assert!(max_attempts <= 2, "max attempts {max_attempts}");
    // At least once: every row, maybe some twice (a confirm or a finalize lost to the freeze).
    let queued = broker.depth(&queue).await as usize;
    let delivered: BTreeSet<i64> = broker.message_ids(&queue, queued).await.into_iter().collect();
    assert_eq!(delivered, ids, "every row delivered");
}

/// The whole database goes silent mid-run (the open connections frozen, new ones refused):
/// SIGTERM still exits 0 within the publish timeout (10 s by default) and 5 s, the rows it could
/// not finalize left to their lease (20 s here, so that the second run need not wait a minute);
/// once the database answers again, a second run finishes every row, none dead.
#[tokio::test]
async fn sigterm_while_the_database_is_silent_exits_0_within_the_publish_timeout_and_five_seconds() {
    const ROWS: usize = 5_000;
    let db = TestDb::new().await;
    let ids: BTreeSet<i64> = db.seed(ROWS, "agg").await.into_iter().collect();
    let (broker, queue) = TestBroker::with_queue("cli-grey").await;
    let proxy = Proxy::start(database_addr()).await;
    let mut args = flags(&broker);
    args.extend(["--lease".to_owned(), "20s".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut run = Dispatcher::start(&proxy.route(&db.url), &args);
    eventually(WITHIN, "rows done", || async { db.count_status("done").await >= 500 }).await;
    proxy.freeze();
    proxy.refuse(true);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let signalled = Instant::now();
    run.signal("TERM");
    let status = run.exit(Duration::from_secs(60)).await;
    let took = signalled.elapsed();
    let log = run.log();
    eprintln!(
        "grey (cli): SIGTERM while the database is silent: exit {:?} after {:.1}s",
        status.code(),
        took.as_secs_f64()
    );
    assert_eq!(status.code(), Some(0), "log:\n{}", log.join("\n"));
    assert!(took <= Duration::from_secs(15), "exited {took:?} after SIGTERM; log:\n{}", log.join("\n"));

    proxy.heal();
    proxy.refuse(false);
    let mut again = Dispatcher::start(&db.url, &args);
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == ROWS as i64 }).await;
    again.signal("TERM");
    assert_eq!(again.exit(Duration::from_secs(20)).await.code(), Some(0));
    assert_eq!(db.count_status("dead").await, 0);
    // At least once: a row published and not finalized before the silence is published again.
    let queued = broker.depth(&queue).await as usize;
    let delivered: Vec<i64> = broker.message_ids(&queue, queued).await;
    let distinct: BTreeSet<i64> = delivered.iter().copied().collect();
    eprintln!("grey (cli): after the silence, {} deliveries of {} rows", delivered.len(), distinct.len());
    assert_eq!(distinct, ids, "every row delivered");
}
