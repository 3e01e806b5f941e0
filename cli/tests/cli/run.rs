//! `run`, against the real RabbitMQ: signals, an unreachable or refusing broker, an
//! unmigrated database, `--log-format`, logging that cannot stop the work, and what it sends.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use actix_outbox::admin::{OutboxRow, Status};
use actix_outbox_test_support::{TestBroker, TestDb, amqp_addr, amqp_url, eventually, saw};
use serde_json::{Value, json};

use crate::common::*;

#[tokio::test]
async fn sigterm_in_the_middle_of_a_run_leaves_nothing_processing_and_a_rerun_finishes_every_row() {
    const ROWS: usize = 5_000;
    let db = TestDb::new().await;
    let ids = db.seed(ROWS, "agg").await;
    let (broker, queue) = TestBroker::with_queue("cli").await;
    let flags = [
        "--exchange",
        broker.exchange.as_str(),
        "--workers",
        "2",
        "--batch",
        "50",
        "--lease",
        "30s",
        "--publish-timeout",
        "5s",
        "--poll-interval",
        "100ms",
        "--amqp-url",
    ];
    let amqp = amqp_url();

    let mut first =
        Dispatcher::start(&db.url, &[&flags[..], &[amqp.as_str(), "--no-declare", "--owner", "first"]].concat());
    eventually(WITHIN, "the first run publishes some rows", || async {
        saw(db.count_status("done").await, |v| *v >= 200)
    })
    .await;
    first.signal("TERM");
    let status = first.exit(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "log:\n{}", first.log().join("\n"));

    let rows = db.rows().await;
    let done_after_first = rows.iter().filter(|r| r.status == Status::Done).count();
    assert_eq!(
        rows.iter().filter(|r| r.status == Status::Processing).count(),
        0,
        "nothing left processing; log:\n{}",
        first.log().join("\n")
    );
    assert_eq!(rows.len(), ROWS, "no row lost");
    assert!(done_after_first < ROWS, "the signal must land mid-run to test anything ({done_after_first} done)");
    for r in rows.iter().filter(|r| r.status == Status::Pending) {
        assert_eq!(r.attempts, 0, "row {} was never claimed, or its attempt was refunded", r.id);
    }
    assert_eq!(rows.iter().filter(|r| r.status == Status::Dead).count(), 0);
    let log = first.log();
    assert_eq!(first.logged("claimed batch"), 0, "per-batch lines are at debug");
    assert!(log.len() < 100, "a few lines, not one per batch or message: {} lines", log.len());
    assert!(first.logged("SIGTERM") >= 1, "the signal is logged");

    // The rerun declares the (existing) exchange itself and finishes everything.
    let mut second = Dispatcher::start(&db.url, &[&flags[..], &[amqp.as_str(), "--owner", "second"]].concat());
    eventually(WITHIN, "the rerun publishes every row", || async {
        saw(db.count_status("done").await, |v| *v == ROWS as i64)
    })
    .await;
    second.signal("INT");
    assert_eq!(second.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", second.log().join("\n"));

    let rows: Vec<OutboxRow> = db.rows().await;
    assert!(rows.iter().all(|r| r.status == Status::Done && r.done_at.is_some()));

    // At-least-once: every id reached the queue (a duplicate is allowed, a gap is not).
    let published = broker.message_ids(&queue, ROWS).await;
    let distinct: BTreeSet<i64> = published.iter().copied().collect();
    assert_eq!(distinct, ids.iter().copied().collect::<BTreeSet<_>>());
}

#[tokio::test]
async fn run_retries_an_unreachable_broker_with_backoff_and_stops_cleanly() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    let before = db.rows().await;
    let mut run = Dispatcher::start(&db.url, &["--amqp-url", "amqp://guest:s3cret@127.0.0.1:1/%2f"]);
    eventually(WITHIN, "two failed attempts to reach the broker are logged", || async {
        saw(run.lines_with("RabbitMQ unreachable; retrying"), |l| l.lines.len() >= 2)
    })
    .await;
    assert!(run.is_running(), "an unreachable broker is waited for, not a crash");
    let log = run.log().join("\n");
    assert!(log.contains("guest:***@127.0.0.1:1") && !log.contains("s3cret"), "{log}");
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(10)).await.code(), Some(0));
    assert_eq!(db.rows().await, before, "nothing was claimed");
}

/// While it waits for an unreachable broker, `run` logs the broker's URL with its password
/// masked, in the user info or in the query, and exactly the sink's reason.
#[tokio::test]
async fn run_masks_the_amqp_password_in_every_form_while_it_waits_for_the_broker() {
    let db = TestDb::new().await;
    for (amqp, masked) in [
        ("amqp://guest:s3cret@127.0.0.1:1/%2f", "amqp://guest:***@127.0.0.1:1/%2f"),
        ("amqp://guest@127.0.0.1:1/%2f?password=s3cret", "amqp://guest@127.0.0.1:1/%2f?password=***"),
    ] {
        let mut run = Dispatcher::start(&db.url, &["--amqp-url", amqp]);
        eventually(WITHIN, "a failed attempt to reach the broker is logged", || async {
            saw(run.lines_with("RabbitMQ unreachable; retrying"), |l| !l.lines.is_empty())
        })
        .await;
        run.signal("TERM");
        assert_eq!(run.exit(Duration::from_secs(10)).await.code(), Some(0));
        let log = run.log();
        let line = log.iter().find(|l| l.contains("RabbitMQ unreachable; retrying")).unwrap();
        let error = line.split(" error=").nth(1).and_then(|rest| rest.split(" retry_in=").next());
        assert_eq!(
            error,
            Some(format!("RabbitMQ is unreachable at {masked}: IO error: Connection refused (os error 111)").as_str())
        );
        assert!(!log.join("\n").contains("s3cret"), "{log:?}");
    }
}

#[tokio::test]
async fn a_second_signal_while_draining_exits_at_once_with_130() {
    let db = TestDb::new().await;
    db.seed(100, "agg").await;
    let (broker, _queue) = TestBroker::with_queue("cli").await;
    let proxy = crate::proxy::Proxy::start(amqp_addr()).await;
    let mut run = Dispatcher::start(
        &db.url,
        &[
            "--amqp-url",
            &proxy.amqp_url(),
            "--exchange",
            &broker.exchange,
            "--no-declare",
            "--workers",
            "1",
            "--batch",
            "50",
            "--lease",
            "60s",
            "--publish-timeout",
            "30s",
        ],
    );
    eventually(WITHIN, "the first rows published", || async { saw(db.count_status("done").await, |v| *v == 100) })
        .await;

    // Confirms stop coming back, then the broker blocks the connection (as under a memory
    // alarm): the publishes in flight wait for it, however long, so a graceful drain waits too.
    proxy.stall_downstream();
    db.seed(1_000, "agg").await;
    eventually(WITHIN, "a full window (2 x batch) of rows stuck waiting for confirms", || async {
        saw(db.count_status("processing").await, |v| *v >= 100)
    })
    .await;
    proxy.amqp_block();
    eventually(WITHIN, "the dispatcher sees the block", || async {
        saw(run.lines_with("claiming paused"), |l| !l.lines.is_empty())
    })
    .await;
    run.signal("TERM");
    eventually(WITHIN, "the drain starts", || async {
        saw(run.lines_with("stopping: claiming stopped"), |l| l.lines.len() == 1)
    })
    .await;
    assert!(run.is_running(), "draining waits for the stuck publishes");

    run.signal("TERM");
    let status = run.exit(Duration::from_secs(5)).await;
    assert_eq!(status.code(), Some(130), "log:\n{}", run.log().join("\n"));
    let last = run.log().last().cloned().unwrap_or_default();
    assert!(last.starts_with("error: SIGTERM again: exiting at once"), "{last}");
    // As documented: what was in flight stays leased until the lease expires.
    assert!(db.count_status("processing").await > 0);
    proxy.resume();
}

/// `run` on a database that was never migrated refuses to start, says what to run, and exits 1
/// (instead of logging a failed claim every poll).
#[tokio::test]
async fn run_on_an_unmigrated_database_exits_1_and_says_to_migrate() {
    let db = TestDb::new().await;
    execute(
        &db,
        "DROP TABLE outbox, outbox_horizon; DROP FUNCTION outbox_notify_insert(); DELETE FROM __diesel_schema_migrations",
    )
        .await;
    let ran = cli(&db.url, &["run", "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2f"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    let line = ran.error_line();
    assert!(line.contains("is not migrated") && line.contains("actix-outbox migrate"), "{line}");
    assert!(line.contains("create_outbox"), "names the pending migrations: {line}");

    ok(&db.url, &["migrate"]).await;
    assert!(db.rows().await.is_empty(), "migrate then works on the same database");
}

/// A broker that refuses the login: exit 1 with our one line, and nothing of lapin's own at
/// error level (the sink reports the failure itself).
#[tokio::test]
async fn run_with_a_refused_amqp_login_says_so_once() {
    let db = TestDb::new().await;
    let url = amqp_url().replacen("guest:guest@", "guest:wrong@", 1);
    assert_ne!(url, amqp_url(), "the test broker's URL carries guest:guest");
    // The same whether RUST_LOG is unset or names a level: lapin's own lines stay out unless
    // RUST_LOG names lapin.
    for rust_log in [None, Some("info"), Some("debug,actix_outbox=info")] {
        let mut cmd = command(&db.url);
        cmd.args(["run", "--amqp-url", &url]);
        if let Some(filter) = rust_log {
            cmd.env("RUST_LOG", filter);
        }
        let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(output.status.code(), Some(1), "RUST_LOG={rust_log:?}: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("ERROR") || l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "RUST_LOG={rust_log:?}: one error line: {errors:?}");
        assert!(errors[0].starts_with("error: RabbitMQ at ") && errors[0].contains("ACCESS_REFUSED"), "{errors:?}");
        assert!(!errors[0].contains("wrong"), "the password is masked: {errors:?}");
        assert!(!stderr.contains("lapin"), "RUST_LOG={rust_log:?}: nothing of lapin's: {stderr}");
    }
}

/// Every command that reads the outbox, on a database without one, names the database and the
/// `migrate` command, in one line, exit 1 (not `relation "outbox" does not exist`).
#[tokio::test]
async fn every_command_on_an_unmigrated_database_says_to_migrate() {
    let db = TestDb::new().await;
    execute(
        &db,
        "DROP TABLE outbox, outbox_horizon; DROP FUNCTION outbox_notify_insert(); DELETE FROM __diesel_schema_migrations",
    )
        .await;
    let expected = format!(
        "error: the database at {} has no outbox table: run `actix-outbox migrate --database-url '{}'` first",
        db.url, db.url
    );
    for args in [
        &["stats"][..],
        &["dead", "list"],
        &["dead", "retry", "1"],
        &["dead", "skip", "1", "--reason", "r"],
        &["dead", "blocked", "--fifo"],
        &["purge", "--older-than", "7d"],
        &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    ] {
        let ran = cli(&db.url, args).await;
        assert_eq!((ran.code, ran.error_line()), (1, expected.as_str()), "{args:?}");
    }
}

#[tokio::test]
async fn run_log_format_json_writes_one_json_object_a_line() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    let (broker, _queue) = TestBroker::with_queue("cli").await;
    let mut run = Dispatcher::start(
        &db.url,
        &[
            "--amqp-url",
            &amqp_url(),
            "--exchange",
            &broker.exchange,
            "--no-declare",
            "--log-format",
            "json",
            "--no-listen",
            "--summary-interval",
            "300ms",
        ],
    );
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 3) }).await;
    // A summary after the table sample (every 5 s) saw the backlog gone.
    eventually(WITHIN, "a summary with no backlog", || async {
        saw(run.lines_with("outbox summary"), |l| l.lines.iter().any(|l| l.contains(r#""backlog":0"#)))
    })
    .await;
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    let log = run.log();
    let lines: Vec<Value> =
        log.iter().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))).collect();
    assert!(lines.iter().all(|l| l["level"].is_string() && l["timestamp"].is_string()), "{log:?}");
    let messages: Vec<&str> = lines.iter().filter_map(|l| l["fields"]["message"].as_str()).collect();
    assert!(!messages.contains(&"claimed batch"), "per-batch lines are at debug: {messages:?}");
    let summaries: Vec<&Value> = lines.iter().filter(|l| l["fields"]["message"] == "outbox summary").collect();
    let published: u64 = summaries.iter().map(|l| l["fields"]["published"].as_u64().unwrap()).sum();
    assert_eq!(published, 3, "the summaries count every message once: {summaries:?}");
    let last = summaries.last().unwrap();
    assert_eq!((&last["fields"]["dead"], &last["fields"]["backlog"]), (&json!(0), &json!(0)), "{last}");
    assert_eq!(messages.last(), Some(&"dispatcher stopped cleanly; exiting 0"), "{messages:?}");
    let start = lines.iter().find(|l| l["fields"]["message"] == "outbox dispatcher starting").expect("start line");
    assert_eq!(start["fields"]["workers"], json!(4), "fields are JSON values: {start}");
}

/// A closed stderr and stdout (the log collector died) lose log lines, never work: the
/// dispatcher goes on moving rows, and SIGTERM still exits 0 with nothing left processing.
#[tokio::test]
async fn run_goes_on_and_exits_0_when_stdout_and_stderr_are_closed() {
    const ROWS: usize = 300;
    let db = TestDb::new().await;
    let (broker, _queue) = TestBroker::with_queue("cli").await;
    let mut cmd = command(&db.url);
    cmd.args(["run", "--amqp-url", &amqp_url(), "--exchange", &broker.exchange, "--no-declare"])
        .args(["--batch", "20", "--poll-interval", "50ms"])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the dispatcher");
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let started = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stderr).lines();
        let found = lines.by_ref().map_while(Result::ok).any(|l| l.contains("starting the dispatcher"));
        // Both read ends close here: every later write fails with EPIPE.
        drop((lines, stdout));
        found
    })
    .await
    .unwrap();
    assert!(started, "the dispatcher logged its start");

    // Rows inserted now are claimed and logged (to the closed pipe) line by line.
    db.seed(ROWS, "agg").await;
    let deadline = Instant::now() + WITHIN;
    while db.count_status("done").await < ROWS as i64 {
        assert!(child.try_wait().unwrap().is_none(), "the dispatcher died: {:?}", child.try_wait());
        assert!(Instant::now() < deadline, "only {} of {ROWS} rows done", db.count_status("done").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::task::spawn_blocking(move || child.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert_eq!(db.count_status("processing").await, 0);
    assert_eq!(db.count_status("done").await, ROWS as i64);
}

/// `run --retention delete` against the real broker: every row is published (persistent, with
/// its id) and then deleted; the table ends empty and the queue holds each id exactly once.
#[tokio::test]
async fn run_with_retention_delete_publishes_every_row_and_leaves_the_table_empty() {
    const ROWS: usize = 500;
    let db = TestDb::new().await;
    let ids = db.seed(ROWS, "agg").await;
    let (broker, queue) = TestBroker::with_queue("cli-delete").await;
    let amqp = amqp_url();
    let mut run = Dispatcher::start(
        &db.url,
        &["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--no-declare", "--retention", "delete"],
    );
    eventually(WITHIN, "every row deleted", || async { saw(db.rows().await.len(), |v| *v == 0) }).await;
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));

    assert_eq!(broker.depth(&queue).await, ROWS as u32, "one message a row, none twice");
    let mut published = broker.message_ids(&queue, ROWS).await;
    published.sort();
    assert_eq!(published, ids, "each id exactly once");
}

/// `run --no-outbox-headers`: the messages carry their id and type but no header table.
#[tokio::test]
async fn run_with_no_outbox_headers_sends_messages_without_a_header_table() {
    let db = TestDb::new().await;
    let ids = db.seed(3, "agg").await;
    let (broker, queue) = TestBroker::with_queue("cli-lean").await;
    let amqp = amqp_url();
    let mut run = Dispatcher::start(
        &db.url,
        &["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--no-declare", "--no-outbox-headers"],
    );
    let delivered = broker.take(&queue, 3).await;
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));

    let mut got: Vec<i64> =
        delivered.iter().map(|d| d.properties.message_id().as_ref().unwrap().as_str().parse().unwrap()).collect();
    got.sort();
    assert_eq!(got, ids);
    assert!(delivered.iter().all(|d| d.properties.headers().is_none()), "no header table");
    assert!(delivered.iter().all(|d| d.properties.kind().as_ref().map(|t| t.as_str()) == Some("test.happened")));
}

/// `run --bind-queue NAME:PATTERN` against the real broker: the dispatcher declares its
/// exchange and the queue, binds it, and every row's message lands there instead of going
/// dead as unroutable.
#[tokio::test]
async fn run_with_bind_queue_declares_the_queue_and_every_message_lands_in_it() {
    let db = TestDb::new().await;
    let ids = db.seed(3, "agg").await;
    let mut broker = TestBroker::new("cli-bind").await;
    let queue = actix_outbox_test_support::unique("cli-bound");
    broker.remove_queue_at_end(queue.clone());
    let amqp = amqp_url();
    let binding = format!("{queue}:test.#");
    let mut run = Dispatcher::start(
        &db.url,
        &["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--bind-queue", binding.as_str()],
    );
    // Done, not dead: each message was routed to the queue, which the run had declared.
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 3) }).await;
    let delivered = broker.take(&queue, 3).await;
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));

    let mut got: Vec<i64> =
        delivered.iter().map(|d| d.properties.message_id().as_ref().unwrap().as_str().parse().unwrap()).collect();
    got.sort();
    assert_eq!(got, ids);
    assert_eq!(db.count_status("dead").await, 0);
}

/// `run --max-rate 100` against the real broker: 300 rows are done at 100 a second, within
/// 10 % (first row done to last, database clock), and the start line names the cap.
#[tokio::test]
async fn run_with_max_rate_paces_the_drain() {
    const ROWS: usize = 300;
    let db = TestDb::new().await;
    db.seed(ROWS, "agg").await;
    let (broker, queue) = TestBroker::with_queue("cli-pace").await;
    let amqp = amqp_url();
    let mut run = Dispatcher::start(
        &db.url,
        &["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--no-declare", "--max-rate", "100"],
    );
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == ROWS as i64) }).await;
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    assert_eq!(run.logged("max_rate=100/s"), 1, "log:\n{}", run.log().join("\n"));

    let mut done: Vec<_> = db.rows().await.into_iter().map(|r| r.done_at.expect("done")).collect();
    done.sort();
    let span = (done[ROWS - 1] - done[0]).to_std().unwrap().as_secs_f64();
    let rate = (ROWS - 1) as f64 / span;
    assert!((90.0..=110.0).contains(&rate), "drained at {rate:.1}/s over {span:.2} s with --max-rate 100");
    assert_eq!(broker.message_ids(&queue, ROWS).await.into_iter().collect::<BTreeSet<_>>().len(), ROWS);
}
