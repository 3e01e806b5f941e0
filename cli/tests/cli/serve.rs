//! `run --metrics-addr` and `--console-addr`: what `run` serves over HTTP.

use std::time::{Duration, Instant};

use actix_outbox_test_support::{TestBroker, TestDb, amqp_addr, amqp_url, eventually, saw};

use crate::common::*;

/// `GET path` over plain HTTP/1.1: the status code and the body.
async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP head: {response:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{head}"));
    (status, body.to_owned())
}

/// Polls `check` until it finds something (`Ok`), failing the test after [`WITHIN`] with what
/// it last saw instead (`Err`).
async fn until<T, S: std::fmt::Debug>(what: &str, mut check: impl AsyncFnMut() -> Result<T, S>) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        let seen = match check().await {
            Ok(found) => return found,
            Err(seen) => seen,
        };
        assert!(Instant::now() < deadline, "timed out after {WITHIN:?} waiting for: {what}; last seen: {seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of the series `series` (name and labels, as printed) in a Prometheus text page.
fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The address `run` logged it serves its probes on.
async fn served_addr(run: &Dispatcher) -> String {
    let mut addr = None;
    eventually(WITHIN, "the probe address is logged", || {
        let logged = run.lines_with("serving /metrics");
        addr = logged
            .lines
            .first()
            .and_then(|l| l.split("addr=").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap().to_owned());
        std::future::ready(saw(logged, |_| addr.is_some()))
    })
    .await;
    addr.unwrap()
}

#[tokio::test]
async fn run_serves_metrics_that_match_the_table_and_readiness_that_follows_the_broker() {
    const ROWS: usize = 50;
    let db = TestDb::new().await;
    db.seed(ROWS, "agg").await;
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
            "--batch",
            "10",
            "--poll-interval",
            "100ms",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    );
    let addr = served_addr(&run).await;
    assert_eq!(http_get(&addr, "/health/live").await, (200, "ok".to_owned()));
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == ROWS as i64) }).await;

    // The table gauges are sampled every 5 s: wait for a sample taken after the last row.
    let page = until("the sampled gauge says every row is done", async || {
        let page = http_get(&addr, "/metrics").await.1;
        let done = sample(&page, "outbox_rows{status=\"done\"}");
        (done == Some(ROWS as f64)).then_some(page).ok_or(done)
    })
    .await;
    let done = db.count_status("done").await as f64;
    assert_eq!(sample(&page, "outbox_published_total"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_finalized_total{outcome=\"done\"}"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_claimed_total"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_rows{status=\"pending\"}"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "outbox_in_flight"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "outbox_sink_up"), Some(1.0), "{page}");
    // One outbox alone in the process: every worker's window, 4 × 2 × 10.
    assert_eq!(sample(&page, "outbox_in_flight_limit"), Some(80.0), "{page}");
    assert_eq!(sample(&page, "outbox_publish_seconds_count"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_delivery_lag_seconds_count"), Some(done), "{page}");
    assert!(!page.contains("worker") && !page.contains("owner="), "no process-specific label: {page}");
    assert!(page.contains("# HELP outbox_claimed_total Rows leased by claims"), "{page}");
    assert!(page.contains("# HELP outbox_rows Rows in the outbox table per status"), "{page}");
    assert_eq!(http_get(&addr, "/health/ready").await, (200, "ready".to_owned()));

    // The broker goes away: not ready, with the reason; back: ready again.
    proxy.refuse(true);
    proxy.sever();
    let reason = until("readiness says 503 while the broker is unreachable", async || {
        let (status, body) = http_get(&addr, "/health/ready").await;
        (status == 503).then_some(body).ok_or(status)
    })
    .await;
    assert!(reason.starts_with("the sink is down"), "{reason}");
    assert_eq!(reason.lines().count(), 1, "{reason}");
    assert_eq!(http_get(&addr, "/health/live").await.0, 200, "live while the broker is away");
    proxy.refuse(false);
    eventually(WITHIN, "ready again once the broker is back", || {
        let addr = addr.clone();
        async move { saw(http_get(&addr, "/health/ready").await, |(status, _)| *status == 200) }
    })
    .await;

    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    assert!(tokio::net::TcpStream::connect(&addr).await.is_err(), "the server stopped with the dispatcher");
}

/// `POST path` with an empty form over plain HTTP/1.1, with extra header lines: the status code
/// and the body.
async fn http_post(addr: &str, path: &str, headers: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP head: {response:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{head}"));
    (status, body.to_owned())
}

#[tokio::test]
async fn run_serves_the_console_with_the_dispatchers_health_behind_the_token() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    let (broker, _queue) = TestBroker::with_queue("cli").await;
    let token_file = std::env::temp_dir().join(format!("{}.console-token", db.name));
    std::fs::write(&token_file, "cli-console-token-7d2e\n").unwrap();
    let mut run = Dispatcher::start(
        &db.url,
        &[
            "--amqp-url",
            &amqp_url(),
            "--exchange",
            &broker.exchange,
            "--no-declare",
            "--console-addr",
            "0",
            "--console-token-file",
            token_file.to_str().unwrap(),
        ],
    );
    let mut addr = None;
    eventually(WITHIN, "the console's address is logged", || {
        let logged = run.lines_with("serving the web console; changes need the operator token");
        addr = logged
            .lines
            .first()
            .and_then(|l| l.split("addr=").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap().to_owned());
        std::future::ready(saw(logged, |_| addr.is_some()))
    })
    .await;
    let addr = addr.unwrap();
    assert!(addr.starts_with("127.0.0.1:"), "a port alone listens on the loopback interface: {addr}");
    eventually(WITHIN, "every row done", || async { saw(db.count_status("done").await, |v| *v == 3) }).await;

    let (status, page) = http_get(&addr, "/").await;
    assert_eq!(status, 200);
    assert!(page.contains(r#"<div class="value" id="count-pending">0</div>"#), "{page}");
    assert!(page.contains(r#"<td id="health-sink"><span class="ok">"#), "{page}");
    assert!(!page.contains("read-only"), "{page}");
    let (status, json) = http_get(&addr, "/api/stats").await;
    assert_eq!(status, 200);
    assert!(json.starts_with(r#"{"by_status":{"dead":0,"done":3,"pending":0,"processing":0}"#), "{json}");

    // Changes need the token; the one from the file is taken (an id that is not dead: 409).
    assert_eq!(http_post(&addr, "/dead/1/retry", "").await.0, 401);
    let bearer = "Authorization: Bearer cli-console-token-7d2e\r\n";
    assert_eq!(
        http_post(&addr, "/dead/1/retry", bearer).await,
        (409, r#"{"error":"not a dead row: 1 (no row changed)"}"#.to_owned())
    );
    assert_eq!(db.count_status("done").await, 3);

    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    assert!(tokio::net::TcpStream::connect(&addr).await.is_err(), "the console stopped with the dispatcher");
    std::fs::remove_file(&token_file).unwrap();
}

/// The `x-outbox-source` header of a delivery.
fn source_of(delivery: &lapin::message::Delivery) -> String {
    let headers = delivery.properties.headers().as_ref().expect("headers");
    match headers.inner().get("x-outbox-source") {
        Some(lapin::types::AMQPValue::LongString(s)) => s.to_string(),
        other => panic!("x-outbox-source: {other:?}"),
    }
}

/// `migrate --schema` makes an outbox in a schema of its own (once), `enqueue --schema` writes
/// to it, and one `run --outbox A --outbox B` relays both: each message carries its outbox's
/// source, each outbox has its own metrics series (`outbox="tenant_a.outbox"`) and summary.
#[tokio::test]
async fn run_relays_the_outboxes_of_several_schemas_each_under_its_own_name() {
    let db = TestDb::new().await;
    for tenant in ["tenant_a", "tenant_b"] {
        let first = ok(&db.url, &["migrate", "--schema", tenant]).await;
        assert!(first.starts_with(&format!("created schema {tenant}\n")), "{first}");
        assert_eq!(first.lines().filter(|l| l.starts_with("applied migration ")).count(), 13, "{first}");
        let again = ok(&db.url, &["migrate", "--schema", tenant]).await;
        assert_eq!(again.trim(), format!("database {} is up to date: no pending migrations", db.name));
    }
    let enqueue = |tenant: &'static str, id: &'static str| {
        let url = db.url.clone();
        async move {
            let args =
                ["enqueue", "--schema", tenant, "--aggregate-type", "t", "--aggregate-id", id, "--event-type", "e"];
            ok(&url, &[&args[..], &["--payload", "{}"]].concat()).await
        }
    };
    for id in ["a1", "a2", "a3"] {
        enqueue("tenant_a", id).await;
    }
    for id in ["b1", "b2"] {
        enqueue("tenant_b", id).await;
    }
    assert_eq!(db.count_status("pending").await, 0, "public.outbox holds none of them");

    let (mut broker, _) = TestBroker::with_queue("cli-tenants").await;
    let queue = broker.queue(&["#"], Default::default()).await;
    let amqp = amqp_url();
    let flags = ["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--no-declare"];
    let more = ["--outbox", "tenant_a", "--outbox", "tenant_b.outbox", "--metrics-addr", "127.0.0.1:0"];
    let mut run = Dispatcher::start(&db.url, &[&flags[..], &more[..]].concat());
    let addr = served_addr(&run).await;
    let deliveries = broker.take(&queue, 5).await;
    let mut sources: Vec<String> = deliveries.iter().map(source_of).collect();
    sources.sort();
    let tail = |s: &String| s.rsplit('/').next().unwrap().to_owned();
    assert_eq!(
        sources.iter().map(tail).collect::<Vec<_>>(),
        ["tenant_a.outbox", "tenant_a.outbox", "tenant_a.outbox", "tenant_b.outbox", "tenant_b.outbox"]
    );
    // The broker had the messages before their confirms reached the relay: wait for both
    // outboxes' rows to be done (each publish is counted before its row's outcome is written).
    let page = until("both outboxes' counters", async || {
        let page = http_get(&addr, "/metrics").await.1;
        let done = ["tenant_a", "tenant_b"]
            .map(|t| sample(&page, &format!(r#"outbox_finalized_total{{outcome="done",outbox="{t}.outbox"}}"#)));
        (done == [Some(3.0), Some(2.0)]).then_some(page).ok_or(done)
    })
    .await;
    assert_eq!(sample(&page, r#"outbox_published_total{outbox="tenant_a.outbox"}"#), Some(3.0), "{page}");
    assert_eq!(sample(&page, r#"outbox_published_total{outbox="tenant_b.outbox"}"#), Some(2.0), "{page}");
    assert_eq!(sample(&page, "outbox_published_total"), None, "no unlabelled series: {page}");
    assert_eq!(http_get(&addr, "/health/ready").await, (200, "ready".to_owned()));
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    for tenant in ["tenant_a", "tenant_b"] {
        let stopped =
            run.log().iter().filter(|l| l.contains("outbox dispatcher stopped") && l.contains(tenant)).count();
        assert_eq!(stopped, 1, "{tenant}: log:\n{}", run.log().join("\n"));
    }
}

/// `--database-url` repeated: one run relays the outbox of each database, each named
/// `DATABASE/outbox` in its metrics, with its own source; `--console-addr` then lists both and
/// serves each one's console under its name, its own rows only.
#[tokio::test]
async fn run_relays_the_outboxes_of_several_databases_and_its_console_picks_between_them() {
    let (one, two) = (TestDb::new().await, TestDb::new().await);
    let enqueue = ["enqueue", "--aggregate-type", "t", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"];
    for _ in 0..2 {
        ok(&one.url, &enqueue).await;
    }
    ok(&two.url, &enqueue).await;
    let (mut broker, _) = TestBroker::with_queue("cli-databases").await;
    let queue = broker.queue(&["#"], Default::default()).await;
    let amqp = amqp_url();
    let flags = ["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--no-declare"];
    let more = ["--database-url", &one.url, "--database-url", &two.url, "--metrics-addr", "127.0.0.1:0"];
    let mut run = Dispatcher::start(&one.url, &[&flags[..], &more[..], &["--console-addr", "0"]].concat());
    let addr = served_addr(&run).await;
    let deliveries = broker.take(&queue, 3).await;
    let mut sources: Vec<String> = deliveries.iter().map(source_of).collect();
    sources.sort();
    let (a, b) = (format!("/{}/public.outbox", one.name), format!("/{}/public.outbox", two.name));
    let ends = |s: &String| {
        if s.ends_with(&a) {
            1
        } else if s.ends_with(&b) {
            2
        } else {
            0
        }
    };
    let mut which: Vec<i32> = sources.iter().map(ends).collect();
    which.sort();
    assert_eq!(which, [1, 1, 2], "{sources:?}");
    let (name_one, name_two) = (format!("{}/outbox", one.name), format!("{}/outbox", two.name));
    let page = until("both outboxes' counters", async || {
        let page = http_get(&addr, "/metrics").await.1;
        let done = |name: &str| sample(&page, &format!(r#"outbox_finalized_total{{outcome="done",outbox="{name}"}}"#));
        let seen = (done(&name_one), done(&name_two));
        (seen == (Some(2.0), Some(1.0))).then_some(page).ok_or(seen)
    })
    .await;
    assert_eq!(sample(&page, "outbox_published_total"), None, "no unlabelled series: {page}");
    // Two outboxes in one process share the broker: each one's window is one worker's (2 × 200)
    // rather than all four workers' (1,600), which the first kept while it ran alone (the gauge
    // follows within 100 ms); three rows never made a claim wait, so neither grew.
    until("each outbox's window at one worker's", async || {
        let page = http_get(&addr, "/metrics").await.1;
        let window = |name: &str| sample(&page, &format!(r#"outbox_in_flight_limit{{outbox="{name}"}}"#));
        let seen = (window(&name_one), window(&name_two));
        (seen == (Some(400.0), Some(400.0))).then_some(()).ok_or(seen)
    })
    .await;

    let console = run
        .log()
        .iter()
        .find(|l| l.contains("serving the web console, read-only"))
        .and_then(|l| l.split("addr=").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap().to_owned())
        .unwrap_or_else(|| panic!("the console's address is logged: {}", run.log().join("\n")));
    let (status, list) = http_get(&console, "/").await;
    assert_eq!(status, 200, "{list}");
    let slug_two = name_two.replace('/', "-");
    for (name, slug) in [(&name_one, name_one.replace('/', "-")), (&name_two, slug_two.clone())] {
        assert!(list.contains(&format!(r#"<a href="/{slug}/">{name}</a>"#)), "{list}");
    }
    let (status, overview) = http_get(&console, &format!("/{slug_two}/")).await;
    assert_eq!(status, 200, "{overview}");
    assert!(overview.contains(&format!("<summary>{name_two}</summary>")), "{overview}");
    let (_, json) = http_get(&console, &format!("/{slug_two}/api/stats")).await;
    assert!(json.starts_with(r#"{"by_status":{"dead":0,"done":1,"pending":0,"processing":0}"#), "{json}");
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
}

/// Other commands act on one database: a repeated `--database-url` is a usage error.
#[tokio::test]
async fn commands_but_run_refuse_several_databases() {
    let db = TestDb::new().await;
    let ran = cli(&db.url, &["stats", "--database-url", &db.url, "--database-url", &db.url]).await;
    assert_eq!(ran.code, 2, "{}", ran.stderr);
    assert!(
        ran.stderr.contains("--database-url is given 2 times: only `run` relays several databases"),
        "{}",
        ran.stderr
    );
}

/// `run --outbox-schemas 'tenant_%'` relays the schemas it finds, and one migrated while it
/// runs from the next look on; schemas that do not match are left alone.
#[tokio::test]
async fn run_picks_up_an_outbox_schema_created_while_it_runs() {
    let db = TestDb::new().await;
    ok(&db.url, &["migrate", "--schema", "tenant_a"]).await;
    ok(&db.url, &["migrate", "--schema", "other"]).await;
    let (mut broker, _) = TestBroker::with_queue("cli-discover").await;
    let queue = broker.queue(&["#"], Default::default()).await;
    let amqp = amqp_url();
    let flags = ["--exchange", broker.exchange.as_str(), "--amqp-url", amqp.as_str(), "--no-declare"];
    let more = ["--outbox-schemas", "tenant_%", "--discover-interval", "200ms"];
    let mut run = Dispatcher::start(&db.url, &[&flags[..], &more[..]].concat());
    let row = |tenant: &'static str| {
        let url = db.url.clone();
        async move {
            let args = ["enqueue", "--schema", tenant, "--aggregate-type", "t", "--aggregate-id", "1", "--event-type"];
            ok(&url, &[&args[..], &["e", "--payload", "{}"]].concat()).await
        }
    };
    row("tenant_a").await;
    row("other").await;
    ok(&db.url, &["migrate", "--schema", "tenant_b"]).await;
    row("tenant_b").await;
    let deliveries = broker.take(&queue, 2).await;
    let mut tails: Vec<String> =
        deliveries.iter().map(|d| source_of(d).rsplit('/').next().unwrap().to_owned()).collect();
    tails.sort();
    assert_eq!(tails, ["tenant_a.outbox", "tenant_b.outbox"]);
    assert_eq!(run.logged("new outbox schema found: relaying it"), 1, "log:\n{}", run.log().join("\n"));
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    let mut conn = db.conn().await;
    let pending: i64 = diesel_async::RunQueryDsl::get_result(
        diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "(SELECT count(*) FROM other.outbox WHERE status = 'pending')",
        )),
        &mut conn,
    )
    .await
    .unwrap();
    assert_eq!(pending, 1, "the schema that does not match is not relayed");
}
