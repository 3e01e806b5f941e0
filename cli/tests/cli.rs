//! The `actix-outbox` binary, run as an operator runs it: the real executable, a fresh database
//! per test, the real RabbitMQ (a uniquely named exchange and queue per test, deleted at the
//! end). Every test checks the exit code, what was printed, and the rows afterwards.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_outbox::admin::SKIPPED_PREFIX;
use actix_outbox::{OutboxRow, Status};
use diesel::sql_types::Text;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use serde_json::{Value, json};

use actix_outbox_test_support::proxy;
use actix_outbox_test_support::{ScratchDb, TestBroker, TestDb, amqp_addr, amqp_url, eventually};

const BIN: &str = env!("CARGO_BIN_EXE_actix-outbox");
const WITHIN: Duration = Duration::from_secs(60);

/// What one finished command printed and returned.
#[derive(Debug)]
struct Ran {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// The one line an error must fit in.
    fn error_line(&self) -> &str {
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "expected exactly one line on stderr, got {:?}", self.stderr);
        lines[0]
    }
}

/// The binary with a clean environment: only what the test passes reaches it.
fn command(database_url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("AMQP_URL").env_remove("RUST_LOG").env("DATABASE_URL", database_url);
    cmd
}

/// Runs `actix-outbox <args>` against `database_url` to completion.
async fn cli(database_url: &str, args: &[&str]) -> Ran {
    let mut cmd = command(database_url);
    cmd.args(args);
    let output = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().expect("run the binary");
    Ran {
        code: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(output.stdout).unwrap(),
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

/// Runs it and insists on success.
async fn ok(database_url: &str, args: &[&str]) -> String {
    let ran = cli(database_url, args).await;
    assert_eq!(ran.code, 0, "actix-outbox {args:?} failed: {ran:?}");
    ran.stdout
}

async fn execute(db: &TestDb, sql: &str) {
    db.conn().await.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Makes `ids` dead as the dispatcher would leave them.
async fn make_dead(db: &TestDb, ids: &[i64]) {
    for id in ids {
        execute(
            db,
            &format!(
                "UPDATE outbox SET status = 'dead', attempts = 12, lease_version = 12, lease_owner = 'host:1:worker-0',
                 last_error = 'retryable: nack {id}' WHERE id = {id}"
            ),
        )
        .await;
    }
}

// ---------------------------------------------------------------------------------------------
// migrate

#[tokio::test]
async fn migrate_creates_the_database_applies_migrations_and_is_idempotent() {
    let db = ScratchDb::new();
    let first = ok(&db.url, &["migrate"]).await;
    assert!(first.contains(&format!("created database {}", db.name)), "{first}");
    let applied: Vec<&str> = first.lines().filter(|l| l.starts_with("applied migration ")).collect();
    let embedded = diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::MIGRATIONS).unwrap();
    assert_eq!(applied.len(), embedded.len(), "{first}");

    let second = ok(&db.url, &["migrate"]).await;
    assert_eq!(second.trim(), format!("database {} is up to date: no pending migrations", db.name));

    // The table is there and usable.
    let id: i64 = ok(
        &db.url,
        &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    )
    .await
    .trim()
    .parse()
    .unwrap();
    assert_eq!(id, 1);
}

/// What a first `migrate` of database `name` prints: the database, then every migration.
fn first_migrate_output(name: &str) -> String {
    use diesel::migration::{Migration, MigrationSource};
    let embedded = MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::MIGRATIONS).unwrap();
    let mut out = format!("created database {name}\n");
    for migration in embedded {
        out += &format!("applied migration {}\n", migration.name().version());
    }
    out
}

/// `migrate` reaches the server's `postgres` database with every option of the string: here
/// the host and port are only in the pairs, or in the URL's query (a URL cut down to
/// `postgres://root@/postgres` reaches nothing).
#[tokio::test]
async fn migrate_creates_the_database_of_a_key_value_string_or_of_a_url_with_its_host_in_the_query() {
    // The server of the default TEST_DATABASE_URL, spelled out (root, trust auth).
    for form in ["pairs", "url"] {
        let db = ScratchDb::new();
        let url = match form {
            "pairs" => format!("host=127.0.0.1 port=5432 user=root dbname={} application_name='outbox it'", db.name),
            _ => format!("postgres://root@/{}?host=127.0.0.1&port=5432&application_name=outbox-it", db.name),
        };
        assert_eq!(ok(&url, &["migrate"]).await, first_migrate_output(&db.name), "{form}");
        assert_eq!(
            ok(&url, &["migrate"]).await,
            format!("database {} is up to date: no pending migrations\n", db.name),
            "{form}"
        );
        let id = ok(
            &url,
            &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
        )
        .await;
        assert_eq!(id, "1\n", "{form}");
    }
}

/// The public tables of the database at `url`, by name.
async fn tables(url: &str) -> BTreeSet<String> {
    use diesel_async::AsyncConnection;
    #[derive(diesel::QueryableByName)]
    struct Table {
        #[diesel(sql_type = Text)]
        name: String,
    }
    let mut conn = diesel_async::AsyncPgConnection::establish(url).await.unwrap();
    let sql = "SELECT table_name::text AS name FROM information_schema.tables \
               WHERE table_schema = 'public' AND table_name <> '__diesel_schema_migrations'";
    let rows: Vec<Table> = diesel::sql_query(sql).load(&mut conn).await.unwrap();
    rows.into_iter().map(|t| t.name).collect()
}

/// `migrate --inbox` creates the database if needed and installs only the inbox; a plain
/// `migrate` afterwards installs the outbox beside it; neither run disturbs the other's
/// migrations, and `--help` documents the flag.
#[tokio::test]
async fn migrate_inbox_installs_only_the_inbox_and_leaves_the_outbox_to_plain_migrate() {
    let db = ScratchDb::new();
    let first = ok(&db.url, &["migrate", "--inbox"]).await;
    assert!(first.contains(&format!("created database {}", db.name)), "{first}");
    let applied: Vec<&str> = first.lines().filter(|l| l.starts_with("applied migration ")).collect();
    let inbox =
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::inbox::INBOX_MIGRATIONS)
            .unwrap();
    assert_eq!(applied.len(), inbox.len(), "{first}");
    assert_eq!(applied, ["applied migration 20261201900001", "applied migration 20261202900002"]);
    let inbox_tables = BTreeSet::from(["inbox".to_owned(), "inbox_aggregates".to_owned()]);
    assert_eq!(tables(&db.url).await, inbox_tables, "only the inbox");

    let again = ok(&db.url, &["migrate", "--inbox"]).await;
    assert_eq!(again.trim(), format!("database {} is up to date: no pending inbox migrations", db.name));

    let outbox = ok(&db.url, &["migrate"]).await;
    let embedded = diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::MIGRATIONS).unwrap();
    assert_eq!(outbox.lines().filter(|l| l.starts_with("applied migration ")).count(), embedded.len(), "{outbox}");
    let mut both = inbox_tables.clone();
    both.insert("outbox".to_owned());
    assert_eq!(tables(&db.url).await, both);
    assert_eq!(
        ok(&db.url, &["migrate"]).await.trim(),
        format!("database {} is up to date: no pending migrations", db.name)
    );
    assert_eq!(
        ok(&db.url, &["migrate", "--inbox"]).await.trim(),
        format!("database {} is up to date: no pending inbox migrations", db.name)
    );

    let help = ok(&db.url, &["migrate", "--help"]).await;
    assert!(help.contains("--inbox") && help.contains("inbox_aggregates"), "{help}");
}

// ---------------------------------------------------------------------------------------------
// enqueue

#[tokio::test]
async fn enqueue_inserts_one_event_and_prints_its_id() {
    let db = TestDb::new().await;
    db.seed(2, "other").await;
    let out = ok(
        &db.url,
        &[
            "enqueue",
            "--aggregate-type",
            "order",
            "--aggregate-id",
            "42",
            "--event-type",
            "order.created",
            "--payload",
            r#"{"total": 10, "lines": [1, 2]}"#,
        ],
    )
    .await;
    assert_eq!(out.lines().count(), 1, "only the id, for scripts: {out:?}");
    let id: i64 = out.trim().parse().unwrap();
    assert_eq!(id, 3);
    let row = db.row(id).await;
    assert_eq!(
        (row.aggregate_type.as_str(), row.aggregate_id.as_str(), row.event_type.as_str(), row.status),
        ("order", "42", "order.created", Status::Pending)
    );
    assert_eq!(row.payload, json!({"total": 10, "lines": [1, 2]}));
    assert_eq!((row.attempts, row.lease_version), (0, 0));
}

#[tokio::test]
async fn enqueue_refuses_a_payload_that_is_not_json_and_inserts_nothing() {
    let db = TestDb::new().await;
    db.seed(2, "agg").await;
    let before = db.rows().await;
    for payload in [r#"{"total": 10"#, "hello", ""] {
        let ran = cli(
            &db.url,
            &[
                "enqueue",
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "42",
                "--event-type",
                "order.created",
                "--payload",
                payload,
            ],
        )
        .await;
        assert_eq!(ran.code, 2, "{ran:?}");
        let line = ran.error_line();
        assert!(line.contains("--payload") && line.contains("not JSON"), "{line}");
        assert_eq!(ran.stdout, "");
    }
    let ran = cli(
        &db.url,
        &["enqueue", "--aggregate-type", " ", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    )
    .await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("--aggregate-type must not be empty"), "{ran:?}");
    assert_eq!(db.rows().await, before);
}

// ---------------------------------------------------------------------------------------------
// stats

/// Rows in every state: pending with 0 and 1 attempts, processing with a live and an expired
/// lease, done, dead.
async fn mixed_table(db: &TestDb) {
    db.seed(12, "agg").await;
    execute(
        db,
        "UPDATE outbox SET attempts = 1 WHERE id IN (1, 2);
         UPDATE outbox SET status = 'processing', attempts = 2, lease_version = 2, lease_owner = 'h:1:worker-0',
             lease_until = now() + interval '1 minute' WHERE id = 3;
         UPDATE outbox SET status = 'processing', attempts = 3, lease_version = 3, lease_owner = 'h:1:worker-1',
             lease_until = now() - interval '5 seconds' WHERE id IN (4, 5);
         UPDATE outbox SET status = 'done', attempts = 1, lease_version = 1, done_at = now() WHERE id IN (6, 7, 8);
         UPDATE outbox SET status = 'dead', attempts = 12, lease_version = 12, last_error = 'permanent: unroutable'
             WHERE id = 9;
         UPDATE outbox SET created_at = now() - interval '90 seconds' WHERE id = 10;",
    )
    .await;
}

#[derive(diesel::QueryableByName)]
struct Doc {
    #[diesel(sql_type = Text)]
    doc: String,
}

#[tokio::test]
async fn stats_json_matches_counts_computed_with_sql() {
    let db = TestDb::new().await;
    mixed_table(&db).await;

    let out = ok(&db.url, &["stats", "--json"]).await;
    assert_eq!(out.lines().count(), 1, "one object: {out}");
    let mut stats: Value = serde_json::from_str(&out).unwrap();
    let age = stats.as_object_mut().unwrap().remove("oldest_unfinished_age_s").unwrap();
    let source = stats.as_object_mut().unwrap().remove("source").unwrap();
    assert_eq!(source, json!(db.source().await), "the source a dispatcher derives for this table");

    // The same facts, computed independently of the store's queries.
    let expected: Doc = diesel::sql_query(
        "SELECT json_build_object(
            'by_status', (SELECT json_object_agg(s, (SELECT count(*) FROM outbox WHERE status = s))
                          FROM unnest(ARRAY['pending', 'processing', 'done', 'dead']) AS s),
            'expired_leases', (SELECT count(*) FROM outbox WHERE status = 'processing' AND lease_until < now()),
            'attempts', (SELECT json_object_agg(attempts::text, n) FROM
                          (SELECT attempts, count(*) AS n FROM outbox
                           WHERE status IN ('pending', 'processing') GROUP BY attempts) AS a),
            'age', (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox
                    WHERE status IN ('pending', 'processing'))
         )::text AS doc",
    )
    .get_result(&mut db.conn().await)
    .await
    .unwrap();
    let mut expected: Value = serde_json::from_str(&expected.doc).unwrap();
    let sql_age = expected.as_object_mut().unwrap().remove("age").unwrap().as_f64().unwrap();
    assert_eq!(stats, expected);
    assert_eq!(
        stats,
        json!({
            "by_status": {"pending": 5, "processing": 3, "done": 3, "dead": 1},
            "expired_leases": 2,
            "attempts": {"0": 3, "1": 2, "2": 1, "3": 2},
        })
    );
    let age = age.as_f64().expect("a number while rows are unfinished");
    assert!((90.0..sql_age + 1.0).contains(&age), "oldest unfinished age {age} s, SQL says {sql_age} s");

    // An empty table: every status present with 0, no age.
    let empty = TestDb::new().await;
    let stats: Value = serde_json::from_str(&ok(&empty.url, &["stats", "--json"]).await).unwrap();
    assert_eq!(
        stats,
        json!({
            "by_status": {"pending": 0, "processing": 0, "done": 0, "dead": 0},
            "oldest_unfinished_age_s": null,
            "expired_leases": 0,
            "attempts": {},
            "source": empty.source().await,
        })
    );
}

#[tokio::test]
async fn stats_prints_a_table_for_humans() {
    let db = TestDb::new().await;
    mixed_table(&db).await;
    let before = db.rows().await;
    let out = ok(&db.url, &["stats"]).await;
    let lines: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
    for expected in [
        vec!["pending", "5"],
        vec!["processing", "3"],
        vec!["done", "3"],
        vec!["dead", "1"],
        vec!["expired", "leases", "2"],
        vec!["3", "2"],
    ] {
        assert!(lines.contains(&expected), "no line {expected:?} in\n{out}");
    }
    assert!(out.contains("oldest unfinished row   1m 3"), "{out}");
    assert!(out.contains(&format!("\nsource                  {}\n", db.source().await)), "{out}");
    assert_eq!(db.rows().await, before, "stats only reads");
}

// ---------------------------------------------------------------------------------------------
// dead list / retry / skip

#[tokio::test]
async fn dead_list_shows_dead_rows_oldest_first() {
    let db = TestDb::new().await;
    db.seed(6, "agg").await;
    make_dead(&db, &[5, 2, 3]).await;

    let rows: Value = serde_json::from_str(&ok(&db.url, &["dead", "list", "--json"]).await).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["id"].as_i64().unwrap()).collect::<Vec<_>>(), [2, 3, 5]);
    let first = &rows[0];
    assert_eq!(
        (
            &first["aggregate_type"],
            &first["aggregate_id"],
            &first["event_type"],
            &first["attempts"],
            &first["last_error"]
        ),
        (&json!("test"), &json!("agg"), &json!("test.happened"), &json!(12), &json!("retryable: nack 2"))
    );
    assert_eq!(first["payload"], json!({"n": 1}));
    assert!(first["created_at"].as_str().unwrap().parse::<chrono::DateTime<chrono::Utc>>().is_ok());

    let limited: Value = serde_json::from_str(&ok(&db.url, &["dead", "list", "--json", "--limit", "2"]).await).unwrap();
    assert_eq!(limited.as_array().unwrap().len(), 2);

    let table = ok(&db.url, &["dead", "list", "--limit", "2"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "header, 2 rows, a note that there are more:\n{table}");
    assert!(lines[0].starts_with("ID") && lines[0].contains("LAST ERROR"), "{table}");
    assert!(lines[1].trim_start().starts_with("2 ") && lines[1].ends_with("retryable: nack 2"), "{table}");
    assert!(lines[1].contains("test/agg") && lines[1].contains("test.happened"), "{table}");
    assert!(lines[3].contains("raise --limit"), "{table}");

    let empty = TestDb::new().await;
    assert_eq!(ok(&empty.url, &["dead", "list"]).await, "no dead rows\n");
    assert_eq!(ok(&empty.url, &["dead", "list", "--json"]).await, "[]\n");
}

#[tokio::test]
async fn dead_retry_sends_dead_rows_back_to_pending_with_attempts_reset() {
    let db = TestDb::new().await;
    db.seed(5, "agg").await;
    make_dead(&db, &[1, 2, 4]).await;

    let out = ok(&db.url, &["dead", "retry", "4", "1", "4"]).await;
    assert_eq!(out.trim(), "retried 2 dead rows (now pending, attempts reset): 1, 4");
    for id in [1, 4] {
        let row = db.row(id).await;
        assert_eq!((row.status, row.attempts, row.lease_owner.as_deref()), (Status::Pending, 0, None));
        assert!(row.available_at <= chrono::Utc::now(), "claimable now");
        assert_eq!(row.lease_version, 12, "the fencing token only ever grows");
    }
    assert_eq!(db.row(2).await.status, Status::Dead);

    let out = ok(&db.url, &["dead", "retry", "--all"]).await;
    assert_eq!(out.trim(), "retried 1 dead row (now pending, attempts reset)");
    assert_eq!(db.count_status("pending").await, 5);
}

#[tokio::test]
async fn dead_retry_of_an_id_that_is_not_dead_exits_2_and_changes_nothing() {
    let db = TestDb::new().await;
    db.seed(4, "agg").await;
    make_dead(&db, &[1, 3]).await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() WHERE id = 4").await;
    let before = db.rows().await;

    // 2 is pending, 4 done, 999 does not exist: the dead ones (1, 3) must not be retried either.
    let ran = cli(&db.url, &["dead", "retry", "1", "2", "3", "4", "999"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert_eq!(
        ran.error_line(),
        "error: not a dead row: 2, 4, 999 (no row changed; `actix-outbox dead list` shows the dead ones)"
    );
    assert_eq!(ran.stdout, "");
    assert_eq!(db.rows().await, before);
}

#[tokio::test]
async fn dead_skip_marks_dead_rows_done_recording_the_reason() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    make_dead(&db, &[1, 2]).await;

    let out = ok(&db.url, &["dead", "skip", "2", "--reason", "order cancelled by hand, INC-7"]).await;
    assert_eq!(out.trim(), "skipped 1 dead row (now done): 2");
    let row = db.row(2).await;
    assert_eq!(row.status, Status::Done);
    assert!(row.done_at.is_some());
    assert_eq!(
        row.last_error.as_deref(),
        Some(format!("{SKIPPED_PREFIX}order cancelled by hand, INC-7 (was: retryable: nack 2)").as_str())
    );
    assert_eq!(db.row(1).await.status, Status::Dead);
    assert_eq!(db.row(3).await.status, Status::Pending);
}

#[tokio::test]
async fn dead_skip_of_an_id_that_is_not_dead_exits_2_and_changes_nothing() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    make_dead(&db, &[1, 2]).await;
    let before = db.rows().await;

    let ran = cli(&db.url, &["dead", "skip", "1", "2", "3", "--reason", "typo in the id list"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().starts_with("error: not a dead row: 3 (no row changed"), "{ran:?}");

    let ran = cli(&db.url, &["dead", "skip", "1", "--reason", "  "]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("--reason must not be empty"), "{ran:?}");

    let ran = cli(&db.url, &["dead", "skip", "1"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("--reason <TEXT>"), "{ran:?}");

    assert_eq!(db.rows().await, before);
}

// ---------------------------------------------------------------------------------------------
// the FIFO operator view: stats --fifo, dead blocked

/// Aggregate order/A is blocked by its dead head (1) with two rows behind it (2, 3); order/B
/// moves (4 done, 5 pending); order/C is not blocked, its head (6) being pending though a later
/// row (7) is dead; mail/M's only row (8) is dead, blocking nothing yet, and only under a gate
/// that covers `email.sent`. Every `created_at` is fixed, so the JSON can be compared whole.
async fn blocked_table(db: &TestDb) {
    let events: Vec<_> = [
        ("order", "A", "order.created"),
        ("order", "A", "order.paid"),
        ("order", "A", "order.paid"),
        ("order", "B", "order.created"),
        ("order", "B", "order.paid"),
        ("order", "C", "order.created"),
        ("order", "C", "order.paid"),
        ("mail", "M", "email.sent"),
    ]
    .into_iter()
    .enumerate()
    .map(|(n, (t, a, e))| actix_outbox::NewEvent::new(t, a, e, json!({"n": n})))
    .collect();
    let ids = actix_outbox::enqueue_many(&mut db.conn().await, &events).await.unwrap();
    assert_eq!(ids, (1..=8).collect::<Vec<_>>());
    make_dead(db, &[1, 7, 8]).await;
    execute(
        db,
        "UPDATE outbox SET status = 'done', attempts = 1, lease_version = 1, done_at = now() WHERE id = 4;
         UPDATE outbox SET last_error = 'permanent: unroutable: exchange \"demo\" has no binding for routing key \"email.sent\"'
             WHERE id = 8;
         UPDATE outbox SET created_at = timestamptz '2026-01-02 03:04:00Z' + id * interval '1 second';",
    )
    .await;
}

/// The `dead blocked --json` object of order/A's head.
fn blocked_a() -> Value {
    json!({
        "aggregate_type": "order", "aggregate_id": "A", "dead_id": 1, "event_type": "order.created",
        "last_error": "retryable: nack 1", "attempts": 12, "created_at": "2026-01-02T03:04:01Z", "waiting": 2,
    })
}

/// The `dead blocked --json` object of mail/M's head.
fn blocked_m() -> Value {
    json!({
        "aggregate_type": "mail", "aggregate_id": "M", "dead_id": 8, "event_type": "email.sent",
        "last_error": "permanent: unroutable: exchange \"demo\" has no binding for routing key \"email.sent\"",
        "attempts": 12, "created_at": "2026-01-02T03:04:08Z", "waiting": 0,
    })
}

/// `stats --json` as an object, without the age (it moves with the clock).
async fn stats_json(db: &TestDb, flags: &[&str]) -> Value {
    let out = ok(&db.url, &[&["stats", "--json"][..], flags].concat()).await;
    assert_eq!(out.lines().count(), 1, "one object: {out}");
    let mut stats: Value = serde_json::from_str(&out).unwrap();
    assert!(stats.as_object_mut().unwrap().remove("oldest_unfinished_age_s").is_some(), "{out}");
    assert_eq!(stats.as_object_mut().unwrap().remove("source"), Some(json!(db.source().await)), "{out}");
    stats
}

#[tokio::test]
async fn stats_with_fifo_adds_the_blocked_aggregates_and_without_it_leaves_them_out() {
    let db = TestDb::new().await;
    blocked_table(&db).await;
    let before = db.rows().await;
    let counts = json!({
        "by_status": {"pending": 4, "processing": 0, "done": 1, "dead": 3},
        "expired_leases": 0,
        "attempts": {"0": 4},
    });
    let with = |blocked: Vec<Value>, total: i64| {
        let mut expected = counts.clone();
        expected["blocked_aggregates"] = Value::Array(blocked);
        expected["blocked_aggregates_total"] = json!(total);
        expected
    };

    // Without --fifo the gate is unknown: no blocked keys at all.
    assert_eq!(stats_json(&db, &[]).await, counts);
    // Every event type gated: A (two waiting) and M (nothing waiting yet); C's head is pending.
    assert_eq!(stats_json(&db, &["--fifo"]).await, with(vec![blocked_a(), blocked_m()], 2));
    // Gated types only: M's email.sent blocks nothing.
    assert_eq!(stats_json(&db, &["--fifo", "order.created,order.paid"]).await, with(vec![blocked_a()], 1));
    assert_eq!(stats_json(&db, &["--fifo", "invoice.created"]).await, with(vec![], 0));

    // The table: a section with the heads, the long error cut short, and the way out.
    let out = ok(&db.url, &["stats", "--fifo"]).await;
    let section: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("blocked aggregates")).collect();
    assert_eq!(section[0], "blocked aggregates      2 (FIFO on all event types)", "{out}");
    assert_eq!(
        section[1].split_whitespace().collect::<Vec<_>>(),
        ["AGGREGATE", "DEAD", "ID", "EVENT", "TYPE", "WAITING", "LAST", "ERROR"]
    );
    assert_eq!(
        section[2].split_whitespace().collect::<Vec<_>>(),
        ["order/A", "1", "order.created", "2", "retryable:", "nack", "1"]
    );
    assert_eq!(section[3].split_whitespace().take(4).collect::<Vec<_>>(), ["mail/M", "8", "email.sent", "0"]);
    assert!(
        section[3].ends_with(" 0  permanent: unroutable: exchange \"demo\" has no binding for r…"),
        "the error is cut to 60 characters: {out}"
    );
    assert!(section[4].contains("dead retry DEAD_ID") && section[4].contains("dead skip DEAD_ID --reason"), "{out}");
    assert_eq!(section.len(), 5, "{out}");
    let out = ok(&db.url, &["stats", "--fifo", "invoice.created"]).await;
    assert!(out.ends_with("blocked aggregates      0 (FIFO on event types invoice.created)\n"), "{out}");
    assert!(!ok(&db.url, &["stats"]).await.contains("blocked"), "no section without --fifo");

    assert_eq!(db.rows().await, before, "stats only reads");
}

#[tokio::test]
async fn dead_blocked_lists_the_aggregates_a_dead_head_holds_back() {
    let db = TestDb::new().await;
    blocked_table(&db).await;
    let before = db.rows().await;
    let json_of = async |flags: &[&str]| -> Value {
        serde_json::from_str(&ok(&db.url, &[&["dead", "blocked", "--json"][..], flags].concat()).await).unwrap()
    };

    assert_eq!(json_of(&["--fifo"]).await, json!([blocked_a(), blocked_m()]));
    assert_eq!(json_of(&["--fifo", "--limit", "1"]).await, json!([blocked_a()]));
    assert_eq!(json_of(&["--fifo", "order.created,order.paid"]).await, json!([blocked_a()]));
    assert_eq!(json_of(&["--fifo", "email.sent"]).await, json!([blocked_m()]));
    assert_eq!(json_of(&["--fifo", "invoice.created"]).await, json!([]));

    let table = ok(&db.url, &["dead", "blocked", "--fifo"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[0], "2 aggregates blocked by a dead head (FIFO on all event types), oldest first:", "{table}");
    assert!(lines[1].starts_with("AGGREGATE  DEAD ID  EVENT TYPE") && lines[1].ends_with("LAST ERROR"), "{table}");
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["order/A", "1", "order.created", "2", "12", "2026-01-02", "03:04:01.000Z", "retryable:", "nack", "1"],
        "{table}"
    );
    assert_eq!(
        lines[3].split_whitespace().take(7).collect::<Vec<_>>(),
        ["mail/M", "8", "email.sent", "0", "12", "2026-01-02", "03:04:08.000Z"],
        "{table}"
    );
    assert!(
        lines[3].ends_with("  permanent: unroutable: exchange \"demo\" has no binding for routing key \"email.sent\"")
    );
    assert_eq!(
        lines[4],
        "unblock an aggregate with `actix-outbox dead retry DEAD_ID` (publish its head again) or \
         `actix-outbox dead skip DEAD_ID --reason TEXT` (give the head up); the rows waiting behind it then follow in order"
    );
    assert_eq!(lines.len(), 5, "{table}");

    let limited = ok(&db.url, &["dead", "blocked", "--fifo", "--limit", "1"]).await;
    let lines: Vec<&str> = limited.lines().collect();
    assert!(lines[0].starts_with("2 aggregates blocked") && lines[2].starts_with("order/A "), "{limited}");
    assert_eq!(lines[3], "(first 1 shown; raise --limit for the rest)", "{limited}");
    assert_eq!(lines.len(), 5, "{limited}");

    let one = ok(&db.url, &["dead", "blocked", "--fifo", "email.sent"]).await;
    assert!(
        one.starts_with("1 aggregate blocked by a dead head (FIFO on event types email.sent), oldest first:\n"),
        "{one}"
    );
    assert_eq!(
        ok(&db.url, &["dead", "blocked", "--fifo", "invoice.created,invoice.paid"]).await,
        "no blocked aggregates (FIFO on event types invoice.created, invoice.paid)\n"
    );
    assert_eq!(db.rows().await, before, "dead blocked only reads");

    // Once the head is retried, A is no longer blocked.
    ok(&db.url, &["dead", "retry", "1"]).await;
    assert_eq!(json_of(&["--fifo"]).await, json!([blocked_m()]));

    let empty = TestDb::new().await;
    assert_eq!(
        ok(&empty.url, &["dead", "blocked", "--fifo"]).await,
        "no blocked aggregates (FIFO on all event types)\n"
    );
    assert_eq!(ok(&empty.url, &["dead", "blocked", "--fifo", "--json"]).await, "[]\n");
}

// ---------------------------------------------------------------------------------------------
// purge

#[tokio::test]
async fn purge_deletes_only_done_rows_older_than_the_age_given() {
    let db = TestDb::new().await;
    db.seed(7, "agg").await;
    execute(
        &db,
        "UPDATE outbox SET status = 'done', done_at = now() - interval '8 days' WHERE id IN (1, 2, 3);
         UPDATE outbox SET status = 'done', done_at = now() - interval '6 days' WHERE id = 4;
         UPDATE outbox SET status = 'dead', created_at = now() - interval '30 days' WHERE id = 5;
         UPDATE outbox SET created_at = now() - interval '30 days' WHERE id = 6;",
    )
    .await;
    let out = ok(&db.url, &["purge", "--older-than", "7d", "--batch", "2"]).await;
    assert_eq!(out.trim(), "purged 3 done rows older than 7days");
    assert_eq!(db.rows().await.iter().map(|r| r.id).collect::<Vec<_>>(), [4, 5, 6, 7]);

    let out = ok(&db.url, &["purge", "--older-than", "7d"]).await;
    assert_eq!(out.trim(), "purged 0 done rows older than 7days");
}

// ---------------------------------------------------------------------------------------------
// exit code 2: usage errors and bad input

#[tokio::test]
async fn malformed_durations_exit_2_and_change_nothing() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() - interval '30 days'").await;
    let before = db.rows().await;
    for args in [
        &["purge", "--older-than", "7x"][..],
        &["purge", "--older-than=-5m"],
        &["purge", "--older-than", ""],
        &["run", "--lease", "soon"],
        &["run", "--publish-timeout", "10"],
        &["run", "--poll-interval", "5 parsecs"],
    ] {
        let ran = cli(&db.url, args).await;
        assert_eq!(ran.code, 2, "{args:?}: {ran:?}");
        assert!(ran.error_line().starts_with("error: invalid value"), "{args:?}: {ran:?}");
    }
    // Well-formed durations that cannot work together are bad input too.
    let ran = cli(&db.url, &["run", "--lease", "5s", "--publish-timeout", "10s"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("publish timeout"), "{ran:?}");
    assert_eq!(db.rows().await, before);
}

#[tokio::test]
async fn malformed_urls_exit_2_with_the_password_masked_and_change_nothing() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    let before = db.rows().await;
    for (url, command) in [
        ("not a url", &["stats"][..]),
        ("mysql://root@127.0.0.1/app", &["dead", "retry", "--all"]),
        ("postgres://admin:s3cret@127.0.0.1:port/app", &["purge", "--older-than", "0s"]),
        // A key=value string is a connection string too: this one is malformed (port=x).
        ("host=127.0.0.1 port=x password=s3cret", &["run"]),
    ] {
        let ran = cli(url, command).await;
        assert_eq!(ran.code, 2, "{url}: {ran:?}");
        let line = ran.error_line();
        assert!(line.starts_with("error: malformed database URL") || line.starts_with("error: database URL"), "{line}");
        assert!(!line.contains("s3cret"), "password leaked: {line}");
    }
    let ran = cli(&db.url, &["run", "--amqp-url", "amqp://guest:s3cret@127.0.0.1:port/%2f"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    let line = ran.error_line();
    assert!(line.contains("malformed AMQP URL") && line.contains("guest:***@"), "{line}");
    assert!(!line.contains("s3cret"), "password leaked: {line}");
    assert_eq!(db.rows().await, before, "run with a bad broker URL must not claim anything");
}

/// The input is shown as typed, password masked (`not a url` used to be all `***`), and a URL of
/// another scheme is named as such (it used to be the driver's "unexpected EOF").
#[tokio::test]
async fn refused_database_urls_show_what_was_typed_and_name_a_wrong_scheme() {
    for (url, line) in [
        (
            "not a url",
            "error: malformed database URL \"not a url\": invalid connection string: unexpected character at byte 4: \
             expected `=` (expected postgres://user:password@host:port/database or key=value pairs: host=... user=... \
             password=... dbname=...)",
        ),
        (
            "mysql://u:secret@h/db",
            "error: database URL \"mysql://u:***@h/db\" has scheme \"mysql\"; expected postgres:// or postgresql:// \
             (or key=value pairs: host=... user=... dbname=...)",
        ),
    ] {
        let ran = cli("postgres://root@127.0.0.1:1/unused", &["stats", "--database-url", url]).await;
        assert_eq!((ran.code, ran.error_line(), ran.stdout.as_str()), (2, line, ""), "{url}");
    }
}

/// Each password form in a malformed string (the port is not a number): exit 2, exactly this
/// line, nothing on stdout.
#[tokio::test]
async fn malformed_connection_strings_exit_2_with_the_password_masked_in_every_form() {
    let hint = " (expected postgres://user:password@host:port/database or key=value pairs: host=... user=... \
                password=... dbname=...)";
    for (url, masked) in [
        ("postgres://admin:s3cret@127.0.0.1:port/app", "postgres://admin:***@127.0.0.1:port/app"),
        ("postgres://admin@127.0.0.1:port/app?password=s3cret", "postgres://admin@127.0.0.1:port/app?password=***"),
        (
            "host=127.0.0.1 port=x user=admin password=s3cret dbname=app",
            "host=127.0.0.1 port=x user=admin password=*** dbname=app",
        ),
        (
            "host=127.0.0.1 port=x user=admin password='s3cret word' dbname=app",
            "host=127.0.0.1 port=x user=admin password=*** dbname=app",
        ),
    ] {
        for command in [&["migrate"][..], &["run"], &["stats"]] {
            let ran = cli(url, command).await;
            assert_eq!(ran.code, 2, "{url} {command:?}: {ran:?}");
            assert_eq!(
                ran.error_line(),
                format!(
                    "error: malformed database URL \"{masked}\": invalid connection string: invalid value for option `port`{hint}"
                ),
                "{command:?}"
            );
            assert_eq!(ran.stdout, "", "{command:?}");
        }
    }
    for (amqp, masked) in [
        ("amqp://guest:s3cret@127.0.0.1:port/%2f", "amqp://guest:***@127.0.0.1:port/%2f"),
        ("amqp://guest@127.0.0.1:port/%2f?password=s3cret", "amqp://guest@127.0.0.1:port/%2f?password=***"),
    ] {
        let ran = cli("postgres://root@127.0.0.1:1/unused", &["run", "--amqp-url", amqp]).await;
        assert_eq!(ran.code, 2, "{ran:?}");
        assert_eq!(
            ran.error_line(),
            format!("error: invalid RabbitMQ sink configuration: malformed AMQP URL \"{masked}\": invalid port number")
        );
        assert_eq!(ran.stdout, "");
    }
}

#[tokio::test]
async fn usage_errors_exit_2_on_one_line() {
    let db = TestDb::new().await;
    for (args, says) in [
        (&["stats", "--jsno"][..], "unexpected argument '--jsno'"),
        (&["vacuum"], "unrecognized subcommand 'vacuum'"),
        (&["dead", "retry"], "required arguments were not provided"),
        (&["dead", "retry", "1", "--all"], "cannot be used with"),
        (&["dead", "retry", "one"], "invalid value 'one'"),
        (&["dead", "list", "--limit", "0"], "invalid value '0'"),
        (&["run", "--workers", "0"], "workers must be at least 1"),
        (&["run", "--fifo", "order.created,,order.paid"], "--fifo: empty event type"),
        (&["stats", "--fifo", "order.created,"], "--fifo: empty event type"),
        (&["dead", "blocked", "--fifo", ","], "--fifo: empty event type"),
        (&["dead", "blocked", "--fifo", "--limit", "0"], "invalid value '0'"),
        (&["dead", "blocked"], "required arguments were not provided: --fifo"),
    ] {
        let ran = cli(&db.url, args).await;
        assert_eq!(ran.code, 2, "{args:?}: {ran:?}");
        assert!(ran.error_line().contains(says), "{args:?}: {ran:?}");
    }
    let ran = cli(&db.url, &["stats"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let mut no_url = Command::new(BIN);
    no_url.env_remove("DATABASE_URL").arg("stats");
    let output = tokio::task::spawn_blocking(move || no_url.output()).await.unwrap().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--database-url <URL>"));
}

#[tokio::test]
async fn every_command_explains_itself_with_an_example() {
    for command in [
        &["migrate"][..],
        &["run"],
        &["stats"],
        &["dead", "list"],
        &["dead", "retry"],
        &["dead", "skip"],
        &["dead", "blocked"],
        &["purge"],
        &["enqueue"],
    ] {
        let mut args = command.to_vec();
        args.push("--help");
        let ran = cli("postgres://unused@127.0.0.1:1/unused", &args).await;
        assert_eq!(ran.code, 0, "{args:?}: {ran:?}");
        let example = format!("actix-outbox {}", command.join(" "));
        assert!(
            ran.stdout.contains("Example") && ran.stdout.contains(&example),
            "{args:?} has no example:\n{}",
            ran.stdout
        );
        assert!(ran.stdout.contains("DATABASE_URL"), "{args:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// exit code 1: an unreachable database

#[tokio::test]
async fn an_unreachable_database_exits_1_with_one_line_that_masks_the_password() {
    let url = "postgres://admin:s3cret@127.0.0.1:1/outbox";
    for args in [
        &["migrate"][..],
        &["run"],
        &["stats"],
        &["dead", "list"],
        &["dead", "retry", "--all"],
        &["dead", "skip", "1", "--reason", "r"],
        &["dead", "blocked", "--fifo"],
        &["stats", "--fifo"],
        &["purge", "--older-than", "7d"],
        &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    ] {
        let ran = cli(url, args).await;
        assert_eq!(ran.code, 1, "{args:?}: {ran:?}");
        let line = ran.error_line();
        assert!(
            line.starts_with("error: cannot connect to PostgreSQL at postgres://admin:***@127.0.0.1:1/outbox: ")
                && line.contains("refused"),
            "{args:?}: {line}"
        );
        assert!(!line.contains("s3cret"), "password leaked: {line}");
    }
}

/// Each password form of a database that refuses connections, for the commands that connect
/// each way (`migrate` through `ensure_database`, `run` before its pool, the one-shot commands):
/// exit 1, exactly this line.
#[tokio::test]
async fn an_unreachable_database_exits_1_with_the_password_masked_in_every_form() {
    for (url, masked) in [
        ("postgres://admin:s3cret@127.0.0.1:1/outbox", "postgres://admin:***@127.0.0.1:1/outbox"),
        ("postgres://admin@127.0.0.1:1/outbox?password=s3cret", "postgres://admin@127.0.0.1:1/outbox?password=***"),
        (
            "host=127.0.0.1 port=1 user=admin password=s3cret dbname=outbox",
            "host=127.0.0.1 port=1 user=admin password=*** dbname=outbox",
        ),
        (
            "host=127.0.0.1 port=1 user=admin password='s3cret word' dbname=outbox",
            "host=127.0.0.1 port=1 user=admin password=*** dbname=outbox",
        ),
    ] {
        for command in [&["migrate"][..], &["run"], &["stats"], &["dead", "retry", "--all"]] {
            let ran = cli(url, command).await;
            assert_eq!(ran.code, 1, "{url} {command:?}: {ran:?}");
            assert_eq!(
                ran.error_line(),
                format!(
                    "error: cannot connect to PostgreSQL at {masked}: error connecting to server: Connection refused (os error 111)"
                ),
                "{command:?}"
            );
            assert_eq!(ran.stdout, "", "{command:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// run, against the real RabbitMQ

/// A running `actix-outbox run`, its stderr collected line by line.
struct Dispatcher {
    child: Option<Child>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Dispatcher {
    fn start(database_url: &str, args: &[&str]) -> Self {
        let mut cmd = command(database_url);
        cmd.arg("run").args(args).env("RUST_LOG", "info").stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start the dispatcher");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = stderr.clone();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Dispatcher { child: Some(child), stderr }
    }

    fn signal(&self, name: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        let status = Command::new("kill").args([&format!("-{name}"), &pid]).status().unwrap();
        assert!(status.success(), "kill -{name} {pid}");
    }

    fn log(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    fn logged(&self, needle: &str) -> usize {
        self.stderr.lock().unwrap().iter().filter(|l| l.contains(needle)).count()
    }

    fn is_running(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_none()
    }

    /// Waits for the process to exit, at most `within`.
    async fn exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {within:?}; log:\n{}", self.log().join("\n"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

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
    eventually(WITHIN, "the first run publishes some rows", || async { db.count_status("done").await >= 200 }).await;
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
    let batches = first.logged("claimed batch");
    assert!(batches >= 1 && log.len() < 1000, "one line a batch, not one per message: {} lines", log.len());
    assert!(first.logged("SIGTERM") >= 1, "the signal is logged");

    // The rerun declares the (existing) exchange itself and finishes everything.
    let mut second = Dispatcher::start(&db.url, &[&flags[..], &[amqp.as_str(), "--owner", "second"]].concat());
    eventually(WITHIN, "the rerun publishes every row", || async { db.count_status("done").await == ROWS as i64 })
        .await;
    second.signal("INT");
    assert_eq!(second.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", second.log().join("\n"));

    let rows: Vec<OutboxRow> = db.rows().await;
    assert!(rows.iter().all(|r| r.status == Status::Done && r.done_at.is_some()));
    assert!(second.logged("claimed batch") >= 1, "the rerun claimed what the first run left");

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
        run.logged("RabbitMQ unreachable; retrying") >= 2
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
            run.logged("RabbitMQ unreachable; retrying") >= 1
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
    eventually(WITHIN, "the first rows published", || async { db.count_status("done").await == 100 }).await;

    // Confirms stop coming back, then the broker blocks the connection (as under a memory
    // alarm): the publishes in flight wait for it, however long, so a graceful drain waits too.
    proxy.stall_downstream();
    db.seed(1_000, "agg").await;
    eventually(WITHIN, "a full window (2 x batch) of rows stuck waiting for confirms", || async {
        db.count_status("processing").await >= 100
    })
    .await;
    proxy.amqp_block();
    eventually(WITHIN, "the dispatcher sees the block", || async { run.logged("claiming paused") >= 1 }).await;
    run.signal("TERM");
    eventually(WITHIN, "the drain starts", || async { run.logged("stopping: claiming stopped") == 1 }).await;
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
    execute(&db, "DROP TABLE outbox; DROP FUNCTION outbox_notify_insert(); DELETE FROM __diesel_schema_migrations")
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
    let ran = cli(&db.url, &["run", "--amqp-url", &url]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    let errors: Vec<&str> = ran.stderr.lines().filter(|l| l.contains("ERROR") || l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line: {errors:?}");
    assert!(errors[0].starts_with("error: RabbitMQ at ") && errors[0].contains("ACCESS_REFUSED"), "{errors:?}");
    assert!(!errors[0].contains("wrong"), "the password is masked: {errors:?}");
}

/// Every command that reads the outbox, on a database without one, names the database and the
/// `migrate` command, in one line, exit 1 (not `relation "outbox" does not exist`).
#[tokio::test]
async fn every_command_on_an_unmigrated_database_says_to_migrate() {
    let db = TestDb::new().await;
    execute(&db, "DROP TABLE outbox; DROP FUNCTION outbox_notify_insert(); DELETE FROM __diesel_schema_migrations")
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

// ---------------------------------------------------------------------------------------------
// run --metrics-addr, --log-format, and logging that cannot stop the work

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

/// Polls `check` until it returns something, failing the test after [`WITHIN`].
async fn until<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out after {WITHIN:?} waiting for: {what}");
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
        addr = run
            .log()
            .iter()
            .find(|l| l.contains("serving /metrics"))
            .and_then(|l| l.split("addr=").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap().to_owned());
        std::future::ready(addr.is_some())
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
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == ROWS as i64 }).await;

    // The table gauges are sampled every 5 s: wait for a sample taken after the last row.
    let page = until("the sampled gauge says every row is done", async || {
        let page = http_get(&addr, "/metrics").await.1;
        (sample(&page, "outbox_rows{status=\"done\"}") == Some(ROWS as f64)).then_some(page)
    })
    .await;
    let done = db.count_status("done").await as f64;
    assert_eq!(sample(&page, "outbox_published_total"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_finalized_total{outcome=\"done\"}"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_claimed_total"), Some(done), "{page}");
    assert_eq!(sample(&page, "outbox_rows{status=\"pending\"}"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "outbox_in_flight"), Some(0.0), "{page}");
    assert_eq!(sample(&page, "outbox_sink_up"), Some(1.0), "{page}");
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
        (status == 503).then_some(body)
    })
    .await;
    assert!(reason.starts_with("the sink is down"), "{reason}");
    assert_eq!(reason.lines().count(), 1, "{reason}");
    assert_eq!(http_get(&addr, "/health/live").await.0, 200, "live while the broker is away");
    proxy.refuse(false);
    eventually(WITHIN, "ready again once the broker is back", || {
        let addr = addr.clone();
        async move { http_get(&addr, "/health/ready").await.0 == 200 }
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
        addr = run
            .log()
            .iter()
            .find(|l| l.contains("serving the web console; changes need the operator token"))
            .and_then(|l| l.split("addr=").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap().to_owned());
        std::future::ready(addr.is_some())
    })
    .await;
    let addr = addr.unwrap();
    assert!(addr.starts_with("127.0.0.1:"), "a port alone listens on the loopback interface: {addr}");
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == 3 }).await;

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
        ],
    );
    eventually(WITHIN, "every row done", || async { db.count_status("done").await == 3 }).await;
    run.signal("TERM");
    assert_eq!(run.exit(Duration::from_secs(20)).await.code(), Some(0), "log:\n{}", run.log().join("\n"));
    let log = run.log();
    let lines: Vec<Value> =
        log.iter().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))).collect();
    assert!(lines.iter().all(|l| l["level"].is_string() && l["timestamp"].is_string()), "{log:?}");
    let messages: Vec<&str> = lines.iter().filter_map(|l| l["fields"]["message"].as_str()).collect();
    assert!(messages.contains(&"claimed batch"), "{messages:?}");
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
    eventually(WITHIN, "every row deleted", || async { db.rows().await.is_empty() }).await;
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

// ---------------------------------------------------------------------------------------------
// docs

/// docs/operations.md shows the help of every command as the binary prints it: each
/// ```` ```text ```` block that starts with `$ actix-outbox ... --help` must equal what that
/// command prints now. `UPDATE_DOCS=1 cargo test -p actix-outbox-cli --test cli help` rewrites
/// the blocks from the binary instead.
#[tokio::test]
async fn the_help_pasted_in_operations_md_is_the_binarys() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let mut out = String::with_capacity(doc.len());
    let (mut rest, mut checked, mut stale) = (doc.as_str(), 0, Vec::new());
    while let Some(start) = rest.find("```text\n$ actix-outbox ") {
        let body_start = start + "```text\n".len();
        let end = body_start + rest[body_start..].find("\n```").expect("a closed block");
        let block = &rest[body_start..end];
        let (command, shown) = block.split_once('\n').unwrap_or((block, ""));
        let args: Vec<&str> = command.trim_start_matches("$ actix-outbox ").split_whitespace().collect();
        let ran = cli("postgres://root@127.0.0.1:5432/unused", &args).await;
        assert_eq!(ran.code, 0, "{command}: {ran:?}");
        // Clap pads blank lines of long help with spaces; the doc keeps them blank.
        let printed: String = ran.stdout.trim_end().lines().map(str::trim_end).collect::<Vec<_>>().join("\n");
        if printed != shown {
            stale.push(command.to_owned());
        }
        out.push_str(&rest[..body_start]);
        out.push_str(command);
        out.push('\n');
        out.push_str(&printed);
        rest = &rest[end..];
        checked += 1;
    }
    out.push_str(rest);
    assert_eq!(checked, 11, "every command's help is shown, each once");
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(path, out).unwrap();
    } else {
        assert!(stale.is_empty(), "stale help in docs/operations.md (UPDATE_DOCS=1 rewrites it): {stale:?}");
    }
}
