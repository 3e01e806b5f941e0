//! Every command through a transaction pooler: a PgBouncer of the test's own
//! (`pool_mode = transaction`, Debian's 1.18) in front of the test server, each test its own
//! database and bouncer. PgBouncer cannot create a database, so each database is created on the
//! server itself and only the commands' URL goes through the bouncer; the direct URL, where a
//! test gives one, is the server's own.
//!
//! With `--pooler transaction` no command may print anything about a prepared statement; with the
//! default (`--pooler none`), what goes wrong must say what to set.

use std::collections::BTreeSet;
use std::time::Duration;

use actix_outbox::admin::{SKIPPED_PREFIX, Status};
use actix_outbox_test_support::{PgBouncer, ScratchDb, TestBroker, TestDb, amqp_url, database_addr, eventually, saw};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use serde_json::{Value, json};

use crate::common::*;

/// A test's database on the server, and the bouncer in front of it.
struct Behind {
    db: TestDb,
    bouncer: PgBouncer,
    /// The database's URL through the bouncer.
    url: String,
}

async fn behind() -> Behind {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let url = bouncer.route(&db.url);
    Behind { db, bouncer, url }
}

/// Runs `actix-outbox <args> --pooler transaction` against `url` (through a bouncer); nothing it
/// prints may mention a prepared statement.
async fn pooled(url: &str, args: &[&str]) -> Ran {
    let ran = cli(url, &[args, &["--pooler", "transaction"]].concat()).await;
    assert!(
        !ran.stdout.contains("prepared statement") && !ran.stderr.contains("prepared statement"),
        "actix-outbox {args:?} --pooler transaction: {ran:?}"
    );
    ran
}

/// [`pooled`], insisting on success: what it printed.
async fn pooled_ok(url: &str, args: &[&str]) -> String {
    let ran = pooled(url, args).await;
    assert_eq!((ran.code, ran.stderr.as_str()), (0, ""), "actix-outbox {args:?} --pooler transaction: {ran:?}");
    ran.stdout
}

/// Whether the FIFO gate's index exists in the database at `url`.
async fn has_fifo_index(url: &str) -> bool {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = diesel_async::AsyncPgConnection::establish(url).await.unwrap();
    let count: Count = diesel::sql_query("SELECT count(*) AS n FROM pg_indexes WHERE indexname = $1")
        .bind::<Text, _>("outbox_fifo_gate")
        .get_result(&mut conn)
        .await
        .unwrap();
    count.n == 1
}

/// The prepared statements left on the bouncer's server connections: every one of them is
/// handed to one of [`POOL_SIZE`](actix_outbox_test_support::pgbouncer::POOL_SIZE) transactions
/// held open at once through the bouncer, each of which lists its session's statements. A
/// statement left there makes the next client that prepares one of the same name fail.
async fn leftover_statements(url: &str) -> Vec<String> {
    #[derive(diesel::QueryableByName)]
    struct Name {
        #[diesel(sql_type = Text)]
        name: String,
    }
    let mut sessions = Vec::new();
    for _ in 0..actix_outbox_test_support::pgbouncer::POOL_SIZE {
        let mut conn = diesel_async::AsyncPgConnection::establish(url).await.unwrap();
        conn.set_prepared_statement_cache_size(diesel::connection::CacheSize::Disabled);
        conn.batch_execute("BEGIN").await.unwrap();
        sessions.push(conn);
    }
    let mut names = Vec::new();
    for conn in &mut sessions {
        // The listing is a prepared statement too: itself aside.
        let listed: Vec<Name> = diesel::sql_query(
            "SELECT name FROM pg_prepared_statements WHERE statement NOT LIKE '%pg_prepared_statements%'",
        )
        .load(conn)
        .await
        .unwrap();
        names.extend(listed.into_iter().map(|n| n.name));
        conn.batch_execute("COMMIT").await.unwrap();
    }
    names
}

/// `migrate` through the bouncer applies every migration, then finds none pending;
/// `migrate --fifo` cannot build the gate's index through it and says to give `--direct-url`
/// (the migrations applied, exit 2), and with one builds it on the server itself, once.
#[tokio::test]
async fn migrate_through_a_transaction_pooler_and_fifo_only_with_a_direct_url() {
    let db = ScratchDb::new();
    let mut admin =
        diesel_async::AsyncPgConnection::establish(&actix_outbox_test_support::database_url("postgres")).await.unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {}", db.name)).await.unwrap();
    let bouncer = PgBouncer::start(&database_addr()).await;
    let url = bouncer.route(&db.url);

    use diesel::migration::{Migration, MigrationSource};
    let embedded = MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::admin::MIGRATIONS).unwrap();
    let applied: String = embedded.iter().map(|m| format!("applied migration {}\n", m.name().version())).collect();
    assert_eq!(pooled_ok(&url, &["migrate"]).await, applied, "the database exists: only the migrations");
    let up_to_date = format!("database {} is up to date: no pending migrations\n", db.name);
    assert_eq!(pooled_ok(&url, &["migrate"]).await, up_to_date);
    assert!(actix_outbox::admin::pending_migrations(&db.url).await.unwrap().is_empty(), "applied on the server");
    assert_eq!(leftover_statements(&url).await, Vec::<String>::new(), "no statement left on a server connection");

    let ran = pooled(&url, &["migrate", "--fifo"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert_eq!(ran.stdout, up_to_date);
    assert_eq!(
        ran.error_line(),
        "error: --fifo behind a transaction pooler needs --direct-url: the index build holds a session of its own \
         (a session lock, CREATE INDEX CONCURRENTLY); the migrations were applied"
    );
    assert!(!has_fifo_index(&db.url).await, "no index built through the pooler");

    let with_direct = ["migrate", "--fifo", "--direct-url", db.url.as_str()];
    assert_eq!(
        pooled_ok(&url, &with_direct).await,
        format!("{up_to_date}built the FIFO gate's index outbox_fifo_gate\n")
    );
    assert!(has_fifo_index(&db.url).await);
    assert_eq!(pooled_ok(&url, &with_direct).await, format!("{up_to_date}the FIFO gate's index is there\n"));

    // The environment says the same as the flags.
    let mut cmd = command(&url);
    cmd.args(["migrate", "--fifo"]).env("DATABASE_POOLER", "transaction").env("DATABASE_DIRECT_URL", &db.url);
    let out = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{up_to_date}the FIFO gate's index is there\n"));
}

/// `enqueue` through the bouncer inserts and prints each id, and `stats` through it counts
/// exactly what is there, as JSON and as a table.
#[tokio::test]
async fn enqueue_and_stats_through_a_transaction_pooler() {
    let b = behind().await;
    let mut ids = Vec::new();
    for i in 0..7 {
        let payload = format!(r#"{{"n": {i}}}"#);
        let args = ["enqueue", "--aggregate-type", "order", "--aggregate-id", "42", "--event-type", "order.created"];
        let out = pooled_ok(&b.url, &[&args[..], &["--payload", payload.as_str()]].concat()).await;
        ids.push(out.trim().parse::<i64>().unwrap_or_else(|e| panic!("{out:?}: {e}")));
    }
    assert_eq!(ids, (1..=7).collect::<Vec<_>>());
    let row = b.db.row(7).await;
    assert_eq!((row.aggregate_id.as_str(), row.status, row.payload), ("42", Status::Pending, json!({"n": 6})));

    execute(
        &b.db,
        "UPDATE outbox SET status = 'done', attempts = 1, lease_version = 1, done_at = now() WHERE id IN (1, 2);
         UPDATE outbox SET status = 'processing', attempts = 1, lease_version = 1, lease_owner = 'h:1:worker-0',
             lease_until = now() - interval '5 seconds' WHERE id = 3;
         UPDATE outbox SET status = 'dead', attempts = 12, lease_version = 12, last_error = 'permanent: unroutable'
             WHERE id = 4;",
    )
    .await;
    let mut stats: Value = serde_json::from_str(&pooled_ok(&b.url, &["stats", "--json"]).await).unwrap();
    let age = stats.as_object_mut().unwrap().remove("oldest_unfinished_age_s").unwrap();
    assert!(age.as_f64().is_some_and(|s| s >= 0.0), "{age}");
    assert_eq!(
        stats,
        json!({
            "by_status": {"pending": 3, "processing": 1, "done": 2, "dead": 1},
            "scheduled": 0,
            "expired_leases": 1,
            "attempts": {"0": 3, "1": 1},
            "source": b.db.source().await,
        })
    );
    let table = pooled_ok(&b.url, &["stats"]).await;
    let lines: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
    for expected in [vec!["pending", "3"], vec!["processing", "1"], vec!["done", "2"], vec!["dead", "1"]] {
        assert!(lines.contains(&expected), "no line {expected:?} in\n{table}");
    }
    assert!(b.bouncer.transactions(&b.db.name).await >= 9, "the commands went through the bouncer");
}

/// `dead list`, `dead retry` and `dead skip` through the bouncer: the dead rows, oldest first;
/// a retry and a skip change exactly the rows named; an id that is not dead refuses the whole
/// batch (exit 2) as it does on a direct connection.
#[tokio::test]
async fn dead_list_retry_and_skip_through_a_transaction_pooler() {
    let b = behind().await;
    b.db.seed(6, "agg").await;
    make_dead(&b.db, &[5, 2, 3, 6]).await;

    let rows: Value = serde_json::from_str(&pooled_ok(&b.url, &["dead", "list", "--json"]).await).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["id"].as_i64().unwrap()).collect::<Vec<_>>(), [2, 3, 5, 6]);
    assert_eq!((&rows[0]["attempts"], &rows[0]["last_error"]), (&json!(12), &json!("retryable: nack 2")));
    let table = pooled_ok(&b.url, &["dead", "list", "--limit", "3"]).await;
    assert_eq!(table.lines().count(), 5, "header, 3 rows, a note that there are more:\n{table}");

    assert_eq!(
        pooled_ok(&b.url, &["dead", "retry", "5", "2"]).await,
        "retried 2 dead rows (now pending, attempts reset): 2, 5\n"
    );
    for id in [2, 5] {
        let row = b.db.row(id).await;
        assert_eq!((row.status, row.attempts, row.lease_version), (Status::Pending, 0, 12), "row {id}");
    }
    let ran = pooled(&b.url, &["dead", "retry", "3", "4"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert_eq!(
        ran.error_line(),
        "error: not a dead row: 4 (no row changed; `actix-outbox dead list` shows the dead ones)"
    );
    assert_eq!(b.db.row(3).await.status, Status::Dead, "the batch refused whole");

    assert_eq!(
        pooled_ok(&b.url, &["dead", "skip", "3", "--reason", "cancelled by hand"]).await,
        "skipped 1 dead row (now done): 3\n"
    );
    let row = b.db.row(3).await;
    assert_eq!(row.status, Status::Done);
    assert_eq!(
        row.last_error.as_deref(),
        Some(format!("{SKIPPED_PREFIX}cancelled by hand (was: retryable: nack 3)").as_str())
    );
    assert_eq!(
        pooled_ok(&b.url, &["dead", "retry", "--all"]).await,
        "retried 1 dead row (now pending, attempts reset)\n"
    );
    assert_eq!(pooled_ok(&b.url, &["dead", "list"]).await, "no dead rows\n");
    assert_eq!(
        (b.db.count_status("pending").await, b.db.count_status("done").await, b.db.count_status("dead").await),
        (5, 1, 0)
    );
}

/// `dead blocked --fifo` and `stats --fifo` through the bouncer: the aggregate a dead head
/// holds back, with the rows waiting behind it, exactly as a direct connection reads it.
#[tokio::test]
async fn dead_blocked_and_stats_fifo_through_a_transaction_pooler() {
    let b = behind().await;
    b.db.seed(3, "a").await;
    b.db.seed(2, "b").await;
    make_dead(&b.db, &[1]).await;

    let through: Value =
        serde_json::from_str(&pooled_ok(&b.url, &["dead", "blocked", "--fifo", "--json"]).await).unwrap();
    let direct: Value = serde_json::from_str(&ok(&b.db.url, &["dead", "blocked", "--fifo", "--json"]).await).unwrap();
    assert_eq!(through, direct);
    let blocked = through.as_array().unwrap();
    assert_eq!(blocked.len(), 1, "{through}");
    assert_eq!(
        (&blocked[0]["aggregate_id"], &blocked[0]["dead_id"], &blocked[0]["waiting"]),
        (&json!("a"), &json!(1), &json!(2))
    );

    let mut stats: Value = serde_json::from_str(&pooled_ok(&b.url, &["stats", "--json", "--fifo"]).await).unwrap();
    stats.as_object_mut().unwrap().remove("oldest_unfinished_age_s");
    assert_eq!(stats["by_status"], json!({"pending": 4, "processing": 0, "done": 0, "dead": 1}));
    assert_eq!((&stats["blocked_aggregates_total"], &stats["blocked_aggregates"]), (&json!(1), &through));
}

/// `purge` through the bouncer, in small batches (each its own transaction): exactly the done
/// rows older than the age given.
#[tokio::test]
async fn purge_through_a_transaction_pooler_deletes_exactly_the_old_done_rows() {
    let b = behind().await;
    b.db.seed(9, "agg").await;
    execute(
        &b.db,
        "UPDATE outbox SET status = 'done', done_at = now() - interval '8 days' WHERE id IN (1, 2, 3, 7, 8);
         UPDATE outbox SET status = 'done', done_at = now() - interval '6 days' WHERE id = 4;
         UPDATE outbox SET status = 'dead', created_at = now() - interval '30 days' WHERE id = 5;",
    )
    .await;
    assert_eq!(
        pooled_ok(&b.url, &["purge", "--older-than", "7d", "--batch", "2"]).await,
        "purged 5 done rows older than 7days\n"
    );
    assert_eq!(b.db.rows().await.iter().map(|r| r.id).collect::<Vec<_>>(), [4, 5, 6, 9]);
    assert_eq!(pooled_ok(&b.url, &["purge", "--older-than", "7d"]).await, "purged 0 done rows older than 7days\n");
}

/// The flags of a `run` through the bouncer that publishes to `exchange` and declares and binds
/// `queue` to every routing key.
fn run_flags(exchange: &str, binding: &str, amqp: &str, poll: &str) -> Vec<String> {
    [
        "--pooler",
        "transaction",
        "--exchange",
        exchange,
        "--bind-queue",
        binding,
        "--amqp-url",
        amqp,
        "--workers",
        "3",
        "--batch",
        "20",
        "--poll-interval",
        poll,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Enqueues `n` rows through the bouncer with the command line, returning their ids.
async fn enqueue_through(url: &str, n: usize, tag: &str) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        let aggregate = format!("{tag}-{i}");
        let args = ["enqueue", "--aggregate-type", "test", "--aggregate-id", aggregate.as_str()];
        let out = pooled_ok(url, &[&args[..], &["--event-type", "test.happened", "--payload", "{}"]].concat()).await;
        ids.push(out.trim().parse().unwrap());
    }
    ids
}

/// What every `run` through the bouncer must show once stopped: exit 0 on SIGTERM, every row
/// done and none dead, exactly one message per row in the queue (counted by the broker, then
/// read), and no word of a prepared statement in its log.
async fn stop_and_check(mut run: Dispatcher, b: &Behind, broker: &TestBroker, queue: &str, ids: &[i64]) -> Vec<String> {
    run.signal("TERM");
    let status = run.exit(Duration::from_secs(20)).await;
    let log = run.log();
    assert_eq!(status.code(), Some(0), "log:\n{}", log.join("\n"));
    assert_eq!(b.db.count_status("done").await, ids.len() as i64);
    assert_eq!(b.db.count_status("dead").await, 0);
    eventually(WITHIN, "the broker counts every message", || async {
        saw(broker.depth(queue).await as usize, |v| *v >= ids.len())
    })
    .await;
    assert_eq!(broker.depth(queue).await as usize, ids.len(), "one message per row");
    let got: BTreeSet<i64> = broker
        .take(queue, ids.len())
        .await
        .iter()
        .map(|d| d.properties.message_id().as_ref().unwrap().as_str().parse().unwrap())
        .collect();
    assert_eq!(got, ids.iter().copied().collect::<BTreeSet<_>>());
    assert!(!log.join("\n").contains("prepared statement"), "log:\n{}", log.join("\n"));
    assert!(b.bouncer.transactions(&b.db.name).await >= 2 * (ids.len() as i64 / 20), "through the bouncer");
    log
}

/// `run --pooler transaction --direct-url` through the bouncer relays every row, those there at
/// start and those enqueued through the bouncer later; with a 60 s poll, the later ones arrive
/// at once only because the insert listener, on its direct session, wakes the workers.
#[tokio::test]
async fn run_through_a_transaction_pooler_with_a_direct_url_relays_every_row_and_listens() {
    let b = behind().await;
    let mut ids = b.db.seed(200, "agg").await;
    let mut broker = TestBroker::new("cli-pooler").await;
    let queue = actix_outbox_test_support::unique("cli-pooler-q");
    broker.remove_queue_at_end(queue.clone());
    let mut flags = run_flags(&broker.exchange, &format!("{queue}:#"), &amqp_url(), "1h");
    flags.extend(["--direct-url".to_owned(), b.db.url.clone()]);
    let run = Dispatcher::start(&b.url, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    eventually(WITHIN, "the rows there at start done", || async {
        saw(b.db.count_status("done").await, |v| *v == 200)
    })
    .await;

    let later = enqueue_through(&b.url, 5, "later").await;
    eventually(WITHIN, "rows enqueued later done without a poll", || async {
        saw(b.db.count_status("done").await, |v| *v == 205)
    })
    .await;
    ids.extend(later);
    let log = stop_and_check(run, &b, &broker, &queue, &ids).await;
    assert!(!log.iter().any(|l| l.contains("insert listener is off")), "log:\n{}", log.join("\n"));
    assert!(log.iter().any(|l| l.contains("pooler=transaction")), "log:\n{}", log.join("\n"));
}

/// `run --pooler transaction` through the bouncer with no direct URL says once that it polls,
/// and relays every row, those there at start and those enqueued while it runs.
#[tokio::test]
async fn run_through_a_transaction_pooler_without_a_direct_url_polls_and_relays_every_row() {
    let b = behind().await;
    let mut ids = b.db.seed(200, "agg").await;
    let mut broker = TestBroker::new("cli-pooler").await;
    let queue = actix_outbox_test_support::unique("cli-pooler-q");
    broker.remove_queue_at_end(queue.clone());
    let flags = run_flags(&broker.exchange, &format!("{queue}:#"), &amqp_url(), "100ms");
    let run = Dispatcher::start(&b.url, &flags.iter().map(String::as_str).collect::<Vec<_>>());
    ids.extend(enqueue_through(&b.url, 5, "during").await);
    eventually(WITHIN, "every row done", || async { saw(b.db.count_status("done").await, |v| *v == 205) }).await;
    assert_eq!(
        run.logged(
            "behind a transaction pooler with no direct URL, the insert listener is off: workers find new rows by \
             polling"
        ),
        1,
        "log:\n{}",
        run.log().join("\n")
    );
    stop_and_check(run, &b, &broker, &queue, &ids).await;
}

/// `run` through the bouncer with the default `--pooler none` (and a direct URL, as the issue
/// ran it): its statements are prepared for a direct connection, and the bouncer hands the next
/// transaction another server connection. The first lost prepared statement switches the pool
/// to the pooler's path by itself: every row is relayed and done, none dead, and exactly one line
/// (a WARN) names the flag to set; no line speaks of a prepared statement without it. SIGTERM
/// ends it with exit 0. The same 5,000 waiting rows through another bouncer with the flag set, for
/// the time each run took (printed, not asserted).
#[tokio::test]
async fn run_with_the_default_pooler_through_a_transaction_pooler_switches_and_says_to_set_it() {
    const ROWS: usize = 5_000;
    let mut took = Vec::new();
    for pooler in [None, Some("transaction")] {
        let b = behind().await;
        let ids = b.db.seed(ROWS, "agg").await;
        let mut broker = TestBroker::new("cli-pooler").await;
        let queue = actix_outbox_test_support::unique("cli-pooler-q");
        broker.remove_queue_at_end(queue.clone());
        let mut flags = run_flags(&broker.exchange, &format!("{queue}:#"), &amqp_url(), "100ms");
        flags.drain(..2); // the default pooler
        flags.extend(["--direct-url".to_owned(), b.db.url.clone()]);
        if let Some(pooler) = pooler {
            flags.extend(["--pooler".to_owned(), pooler.to_owned()]);
        }
        let started = std::time::Instant::now();
        let mut run = Dispatcher::start(&b.url, &flags.iter().map(String::as_str).collect::<Vec<_>>());
        eventually(WITHIN, "every row done", || async { b.db.count_status("done").await == ROWS as i64 }).await;
        took.push((pooler, started.elapsed()));
        run.signal("TERM");
        let status = run.exit(Duration::from_secs(30)).await;
        let log = run.log();
        assert_eq!(status.code(), Some(0), "log:\n{}", log.join("\n"));
        let named: Vec<&String> = log.iter().filter(|l| l.contains("`--pooler transaction`")).collect();
        let warns = log.iter().filter(|l| l.contains(" WARN ")).count();
        let rows = b.db.rows().await;
        let done_at = |pick: fn(_, _) -> _| rows.iter().filter_map(|r| r.done_at).reduce(pick).unwrap();
        let drained = (done_at(std::cmp::max) - done_at(std::cmp::min)).to_std().unwrap();
        eprintln!(
            "grey (cli): {ROWS} rows through PgBouncer, --pooler {}: done {:.1}s after start, first to last done \
             {:.2}s ({:.0} rows/s), {} line(s) naming the flag, {warns} WARN lines",
            pooler.unwrap_or("none (default)"),
            took.last().unwrap().1.as_secs_f64(),
            drained.as_secs_f64(),
            ROWS as f64 / drained.as_secs_f64(),
            named.len()
        );
        if pooler.is_none() {
            assert!(log.iter().any(|l| l.contains("starting the dispatcher") && l.contains("pooler=none")), "{log:#?}");
            assert_eq!(named.len(), 1, "one line names the flag: {named:#?}");
            assert!(named[0].contains(" WARN "), "{}", named[0]);
        } else {
            assert!(named.is_empty(), "{named:#?}");
        }
        let bare: Vec<&String> =
            log.iter().filter(|l| l.contains("prepared statement") && !l.contains("`--pooler transaction`")).collect();
        assert!(bare.is_empty(), "lines without the fix: {bare:#?}");
        assert_eq!(b.db.count_status("dead").await, 0);
        assert_eq!(b.db.rows().await.iter().map(|r| r.attempts).max(), Some(1), "no attempt spent on the pooler");
        let got: BTreeSet<i64> = broker.message_ids(&queue, ids.len()).await.into_iter().collect();
        assert_eq!(got, ids.iter().copied().collect::<BTreeSet<_>>(), "every row relayed");
    }
}
