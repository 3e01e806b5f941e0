//! The user's test kit (`actix_outbox::testkit`), used as a service's tests would use it, on the
//! real PostgreSQL: every answer of the memory sink through a real dispatcher, the drain's idle
//! rule, the throwaway database's lifetime (its options, its drop on a crowded server, the
//! removal of those left behind), and inbox delivery without a broker.

use std::time::Duration;

use actix_outbox::inbox::{HandlerError, InboxConfig, InboxMessage, LateEvents, handler_fn};
use actix_outbox::testkit::{
    Delivered, Drain, DrainError, MemorySink, TestConsumer, TestDatabase, deliver, drain_until_idle,
    drop_stale_databases, inbox_message,
};
use actix_outbox::{NewEvent, PublishError, StoreError};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};

use crate::alone::{role, run_alone, stderr};
use crate::roles::Role;
use actix_outbox_test_support::{ScratchDb, database_exists, database_url, unique};

async fn database() -> TestDatabase {
    TestDatabase::create(&database_url("postgres")).await.expect("a test database")
}

async fn enqueue(db: &TestDatabase, events: &[(&str, &str)]) -> Vec<i64> {
    let events: Vec<NewEvent> = events
        .iter()
        .map(|(event_type, id)| NewEvent::new("order", *id, *event_type, serde_json::json!({"order": id})))
        .collect();
    let mut conn = db.pool().get().await.unwrap();
    actix_outbox::enqueue_many(&mut conn, &events).await.unwrap()
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Three types, three answers: `order.placed` published at once, `payment.charged` on its third
/// attempt after two retryable failures, `legacy.event` dead at once. The drain reports 3 done
/// and 1 dead with its error, and every call is recorded with its attempt.
#[actix_rt::test]
async fn the_drain_runs_every_answer_of_the_sink_to_its_end() {
    let db = database().await;
    let ids =
        enqueue(&db, &[("order.placed", "1"), ("order.placed", "2"), ("payment.charged", "1"), ("legacy.event", "3")])
            .await;
    let sink = MemorySink::new();
    sink.answer_times("payment.charged", 2, Err(PublishError::Retryable("gateway timeout".into())));
    sink.answer("legacy.event", Err(PublishError::Permanent("no route".into())));

    let drained = drain_until_idle(db.pool(), sink.clone()).await.expect("idle");
    assert_eq!((drained.done, drained.dead, drained.pending), (3, 1, 0));
    assert_eq!(drained.dead_rows.iter().map(|r| r.id).collect::<Vec<_>>(), [ids[3]]);
    assert_eq!(drained.dead_rows[0].last_error.as_deref(), Some("permanent: no route"));
    sink.assert_published("order.placed", 2);
    sink.assert_published("payment.charged", 1);
    sink.assert_published("legacy.event", 0);
    let mut published = sink.published_ids();
    published.sort_unstable();
    assert_eq!(published, ids[..3]);

    let payment: Vec<(i32, bool)> = sink
        .calls()
        .iter()
        .filter(|c| c.message.id == ids[2])
        .map(|c| (c.message.attempts, c.answer.is_ok()))
        .collect();
    assert_eq!(payment, [(1, false), (2, false), (3, true)], "two retryable failures, then published");
    assert_eq!(sink.published_of("payment.charged")[0].aggregate_id, "1");

    let no_dead = std::panic::catch_unwind(|| drained.assert_no_dead()).expect_err("a dead row fails the assertion");
    let message = no_dead.downcast_ref::<String>().unwrap();
    assert_eq!(message, &format!("expected no dead rows, found 1: #{} legacy.event (permanent: no route)", ids[3]));
    let wrong_count = std::panic::catch_unwind(|| sink.assert_published("order.placed", 1)).expect_err("2 is not 1");
    assert_eq!(
        wrong_count.downcast_ref::<String>().unwrap(),
        r#"expected 1 `order.placed` message(s) published, found 2; published by type: {"order.placed": 2, "payment.charged": 1}"#
    );
}

/// A deferral beyond the horizon leaves its row pending (attempt refunded) and the drain idle; a
/// sink that stays unavailable ends the drain with `NotIdle` once its timeout runs out, the
/// dispatcher stopped and the row back to pending with no attempt spent.
#[actix_rt::test]
async fn a_deferred_row_is_left_pending_and_an_unavailable_sink_is_not_idle() {
    let db = database().await;
    let ids = enqueue(&db, &[("order.placed", "1"), ("invoice.due", "2")]).await;
    let sink = MemorySink::new();
    sink.answer("invoice.due", Err(PublishError::Defer { delay: Duration::from_secs(600), reason: "not yet".into() }));
    let drained = drain_until_idle(db.pool(), sink.clone()).await.expect("idle");
    assert_eq!((drained.done, drained.dead, drained.pending), (1, 0, 1));
    assert_eq!(sink.published_ids(), [ids[0]]);
    assert_eq!(sink.calls().iter().filter(|c| c.message.id == ids[1]).count(), 1, "deferred once, not retried");

    let db = database().await;
    let ids = enqueue(&db, &[("order.placed", "1")]).await;
    let sink = MemorySink::new();
    sink.answer("order.placed", Err(PublishError::Unavailable("broker down".into())));
    let error = Drain::new().timeout(Duration::from_millis(500)).run(db.pool(), sink.clone()).await.unwrap_err();
    assert!(
        matches!(
            error,
            DrainError::NotIdle { processing: 0, due: 1, .. } | DrainError::NotIdle { processing: 1, due: 0, .. }
        ),
        "{error:?}"
    );
    sink.assert_nothing_published();
    assert!(sink.calls().len() >= 2, "probed again while unavailable: {} call(s)", sink.calls().len());
    let mut conn = db.pool().get().await.unwrap();
    let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
    assert_eq!(stats.by_status["pending"], 1, "back to pending after the stop");
    let row: Count = diesel::sql_query("SELECT attempts::int8 AS n FROM outbox WHERE id = $1")
        .bind::<BigInt, _>(ids[0])
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(row.n, 0, "an unavailable sink spends no attempt");
}

/// An empty outbox is idle at once; the database exists, migrated, while its value lives and is
/// gone once it drops.
#[actix_rt::test]
async fn a_test_database_is_migrated_and_dropped() {
    let db = database().await;
    let name = db.name().to_owned();
    assert!(name.starts_with("outbox_test_"), "{name}");
    assert_eq!(db.url().database(), Some(name.as_str()));
    let drained = drain_until_idle(db.pool(), MemorySink::new()).await.unwrap();
    assert_eq!((drained.done, drained.dead, drained.pending), (0, 0, 0));
    assert!(actix_outbox::admin::pending_migrations(db.url().expose()).await.unwrap().is_empty(), "migrated");
    assert!(database_exists(&name).await);
    drop(db);
    assert!(!database_exists(&name).await, "dropped with its value");
}

/// A drained message, turned into what a consumer receives, goes through an inbox handler once:
/// applied (its write committed with the inbox row), then a duplicate; a failing handler rolls
/// back and is retried, then dead-lettered on its last attempt.
#[actix_rt::test]
async fn a_published_message_is_applied_once_by_an_inbox_handler() {
    let db = database().await;
    db.connect().await.unwrap().batch_execute("CREATE TABLE seen (id bigint PRIMARY KEY, body text)").await.unwrap();
    let ids = enqueue(&db, &[("order.placed", "7")]).await;
    let sink = MemorySink::new();
    drain_until_idle(db.pool(), sink.clone()).await.unwrap().assert_no_dead();
    let message = inbox_message(&sink.published()[0]);
    assert_eq!((message.message_id, message.event_type.as_str()), (ids[0], "order.placed"));
    assert_eq!((message.aggregate_type.as_str(), message.aggregate_id.as_str()), ("order", "7"));
    assert_eq!(message.source, sink.published()[0].source.as_ref());
    assert!(!message.source.is_empty());
    assert_eq!(message.header_str("x-aggregate-id"), Some("7"));
    assert_eq!(message.header_int("x-attempt"), Some(1));
    assert_eq!(message.payload, Some(serde_json::json!({"order": "7"})));

    let handler = handler_fn(|conn, message: &InboxMessage| {
        let (id, body) = (message.message_id, String::from_utf8_lossy(&message.body).into_owned());
        Box::pin(async move {
            diesel::sql_query("INSERT INTO seen (id, body) VALUES ($1, $2)")
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(body)
                .execute(conn)
                .await?;
            Ok(())
        })
    });
    let config = InboxConfig::new("billing", "amqp://guest:guest@127.0.0.1:5672/%2f", "orders");
    assert_eq!(deliver(db.pool(), &config, &handler, &message).await.unwrap(), Delivered::Applied);
    assert_eq!(deliver(db.pool(), &config, &handler, &message).await.unwrap(), Delivered::Duplicate);
    let seen: Count =
        diesel::sql_query("SELECT count(*) AS n FROM seen").get_result(&mut db.connect().await.unwrap()).await.unwrap();
    assert_eq!(seen.n, 1, "one effect");

    let failing = handler_fn(|conn, _message: &InboxMessage| {
        Box::pin(async move {
            diesel::sql_query("INSERT INTO seen (id, body) VALUES (-1, 'rolled back')").execute(conn).await?;
            Err(HandlerError::retryable("downstream busy"))
        })
    });
    let other = InboxMessage::new(ids[0] + 1, "order.placed", serde_json::json!({}));
    let outcome = deliver(db.pool(), &config, &failing, &other).await.unwrap();
    assert_eq!(outcome, Delivered::Retried { reason: "retryable: downstream busy".into() });
    let mut last = other.clone();
    last.attempt = config.max_attempts;
    assert!(matches!(deliver(db.pool(), &config, &failing, &last).await.unwrap(), Delivered::DeadLettered { .. }));
    let seen: Count =
        diesel::sql_query("SELECT count(*) AS n FROM seen").get_result(&mut db.connect().await.unwrap()).await.unwrap();
    assert_eq!(seen.n, 1, "the failed attempts rolled back");
    assert_eq!(
        deliver(db.pool(), &config, &handler, &other).await.unwrap(),
        Delivered::Applied,
        "not recorded by a failure"
    );
}

/// A consumer by name, or with settings of its own, without an `InboxConfig` and its unused URL:
/// an ordered consumer skips a message older than one it applied (or, flagging, applies it late).
#[actix_rt::test]
async fn deliver_takes_a_consumers_name_or_its_settings() {
    let db = database().await;
    let handler = handler_fn(|_conn, _message: &InboxMessage| Box::pin(async { Ok(()) }));
    let newer = InboxMessage::new(12, "order.paid", serde_json::json!({})).with_aggregate("order", "7");
    let older = InboxMessage::new(11, "order.placed", serde_json::json!({})).with_aggregate("order", "7");
    assert_eq!(deliver(db.pool(), "billing", &handler, &newer).await.unwrap(), Delivered::Applied);
    assert_eq!(deliver(db.pool(), "billing", &handler, &newer).await.unwrap(), Delivered::Duplicate);
    assert_eq!(deliver(db.pool(), "billing", &handler, &older).await.unwrap(), Delivered::Applied, "not ordered");

    let ordered = TestConsumer::new("shipping").ordered(true);
    assert_eq!(ordered.name(), "shipping");
    assert_eq!(deliver(db.pool(), &ordered, &handler, &newer).await.unwrap(), Delivered::Applied);
    assert_eq!(deliver(db.pool(), &ordered, &handler, &older).await.unwrap(), Delivered::SkippedLate);
    let flagging = TestConsumer::new("audit").ordered(true).late_events(LateEvents::Flag);
    assert_eq!(deliver(db.pool(), &flagging, &handler, &newer).await.unwrap(), Delivered::Applied);
    assert_eq!(deliver(db.pool(), &flagging, &handler, &older).await.unwrap(), Delivered::AppliedLate);

    let failing = handler_fn(|_conn, _message: &InboxMessage| Box::pin(async { Err(HandlerError::retryable("busy")) }));
    let once = TestConsumer::new("once").max_attempts(1);
    assert_eq!(
        deliver(db.pool(), &once, &failing, &newer).await.unwrap(),
        Delivered::DeadLettered { reason: "retryable: busy".into() },
        "its first attempt was its last"
    );
}

/// The application's own tables, as `embed_migrations!()` gives them (tests/it/app_migrations).
const APP_MIGRATIONS: EmbeddedMigrations = embed_migrations!("tests/it/app_migrations");

/// The options make the database the application's tests need: its pool of the size asked, the
/// application's migrations after the outbox's, then its setup hook. `from_env` reaches the
/// server `TEST_DATABASE_URL` names (or the documented default). A setup hook that fails fails
/// the creation, naming the database, which is gone.
#[actix_rt::test]
async fn options_give_the_pool_size_the_applications_migrations_and_setup() {
    let db = TestDatabase::options()
        .server_url(database_url("postgres"))
        .pool_size(3)
        .migrations(APP_MIGRATIONS)
        .create_with(async |conn| conn.batch_execute("INSERT INTO orders (customer) VALUES ('ada'), ('grace')").await)
        .await
        .unwrap();
    assert_eq!(db.pool().config().max_size, 3);
    let mut conn = db.pool().get().await.unwrap();
    let n: Count = diesel::sql_query("SELECT count(*) AS n FROM orders").get_result(&mut conn).await.unwrap();
    assert_eq!(n.n, 2, "the migration's table, the hook's rows");
    drop(conn);
    assert!(actix_outbox::admin::pending_migrations(db.url().expose()).await.unwrap().is_empty(), "the outbox's too");

    let from_env = TestDatabase::from_env().await.expect("the server of TEST_DATABASE_URL or the default");
    assert!(from_env.name().starts_with("outbox_test_"), "{}", from_env.name());
    assert_eq!(from_env.pool().config().max_size, 8, "the default pool");

    let e = TestDatabase::options()
        .server_url(database_url("postgres"))
        .create_with(async |conn| conn.batch_execute("INSERT INTO nowhere VALUES (1)").await)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Migration(_)), "{e:#?}");
    let message = e.to_string();
    let name = message
        .strip_prefix("migration failed: the setup of test database ")
        .and_then(|rest| rest.strip_suffix(" failed: relation \"nowhere\" does not exist"))
        .unwrap_or_else(|| panic!("names the database and the cause: {message}"));
    assert!(name.starts_with("outbox_test_"), "{message}");
    assert!(!database_exists(name).await, "dropped after its setup failed");
}

/// A server with no free connection for the role: creating a database fails at once, in the
/// server's words.
#[actix_rt::test]
async fn a_full_server_refuses_a_test_database_in_its_own_words() {
    let role = Role::new(2).await;
    let _full = role.hold(2).await;
    let e = TestDatabase::create(&role.server_url()).await.unwrap_err();
    assert!(matches!(e, StoreError::Connect(_)) && e.is_transient(), "{e:#?}");
    assert_eq!(
        e.to_string(),
        format!("database connection failed: db error: FATAL: too many connections for role \"{}\"", role.name)
    );
    assert_eq!(format!("{e:?}"), e.to_string(), "what a failed unwrap prints");
    assert_eq!(role.databases().await, Vec::<String>::new());
}

/// The drop of a test database waits for a free connection: while the role is at its limit (a
/// clone of the pool keeps the database's own connection open), the database stays; once one
/// session ends, the drop gets through.
#[actix_rt::test]
async fn the_drop_waits_for_a_free_connection_of_a_crowded_server() {
    let role = Role::new(4).await;
    let db = TestDatabase::options().server_url(role.server_url()).pool_size(1).create().await.unwrap();
    let name = db.name().to_owned();
    let pool = db.pool().clone();
    let conn = pool.get().await.unwrap();
    let mut crowd = role.hold(3).await;
    assert!(actix_outbox::admin::connect(&role.server_url()).await.is_err(), "the role is at its limit");

    let dropping = std::thread::spawn(move || drop(db));
    // Long enough for several attempts (50 ms, then 100, 200, 400), each refused.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!dropping.is_finished(), "the drop is still trying");
    assert!(database_exists(&name).await, "and the database is still there");

    drop(crowd.pop());
    let joined = tokio::task::spawn_blocking(move || dropping.join()).await.unwrap();
    assert!(joined.is_ok(), "the drop ended without a panic");
    assert!(!database_exists(&name).await, "dropped once a connection was free");
    drop(conn);
    assert_eq!(role.databases().await, Vec::<String>::new());
}

/// What the child of [`a_drop_that_gives_up_says_so_on_stderr`] reads.
const CROWDED_SERVER: &str = "TESTKIT_CROWDED_SERVER";

/// A drop that cannot get a connection within its timeout gives up and says so on stderr (where
/// a test run shows it, with no log subscriber installed), naming the database and how to remove
/// it; the database is left for the sweep or a person.
#[test]
fn a_drop_that_gives_up_says_so_on_stderr() {
    const NAME: &str = "testkit::a_drop_that_gives_up_says_so_on_stderr";
    if role().as_deref() == Some(NAME) {
        actix_rt::System::new().block_on(async {
            let server = std::env::var(CROWDED_SERVER).unwrap();
            let db = TestDatabase::options()
                .server_url(&server)
                .pool_size(1)
                .drop_timeout(Duration::from_millis(500))
                .create()
                .await
                .unwrap();
            let pool = db.pool().clone();
            let _conn = pool.get().await.unwrap();
            let mut full = Vec::new();
            for _ in 0..3 {
                full.push(actix_outbox::admin::connect(&server).await.unwrap());
            }
            drop(db);
        });
        return;
    }
    actix_rt::System::new().block_on(async {
        let role = Role::new(4).await;
        let output = run_alone(NAME, NAME, &[(CROWDED_SERVER, role.server_url().as_str())]);
        let stderr = stderr(&output);
        assert!(output.status.success(), "{stderr}");
        let databases = role.databases().await;
        let [name] = databases.as_slice() else { panic!("one database left behind: {databases:?}") };
        let start =
            format!("actix-outbox testkit: could not drop the test database {name:?} on {}: ", role.server_url());
        let line = stderr.lines().find(|l| l.starts_with(&start)).unwrap_or_else(|| panic!("{start}... in {stderr}"));
        let end = format!(
            ", the last one: database connection failed: db error: FATAL: too many connections for role \"{}\". Drop \
             it by hand (DROP DATABASE \"{name}\" WITH (FORCE)), or leave it to a later run: the first test database \
             a process creates on this server removes those left behind once they are 1h old",
            role.name
        );
        assert!(line.ends_with(&end), "{line}");
    });
}

/// The server's clock, in seconds, as test databases' names carry it.
async fn server_seconds(conn: &mut AsyncPgConnection) -> i64 {
    let now: Count = diesel::sql_query("SELECT extract(epoch FROM now())::int8 AS n").get_result(conn).await.unwrap();
    now.n
}

/// Only the kit's own databases left behind are removed: named as the kit names them, owned by
/// the role that sweeps, older than the age, with nobody connected. Another role's database, one
/// in use, a fresh one, and names of another shape (an earlier version's included) stay. The
/// first database a process creates on a server sweeps it.
#[actix_rt::test]
async fn stale_test_databases_of_this_kind_are_removed_and_no_other() {
    let server = database_url("postgres");
    let mut admin = actix_outbox::admin::connect(&server).await.unwrap();
    let (now, pid) = (server_seconds(&mut admin).await, std::process::id());
    let old = now - 2 * 3600;
    let n = unique("n").rsplit('.').nth(1).unwrap().parse::<u64>().unwrap() * 1000 + 900_000;
    let stale = [format!("outbox_test_{old}_{pid}_{n}"), format!("outbox_test_{old}_{pid}_{}", n + 1)];
    let another_users = format!("outbox_test_{old}_{pid}_{}", n + 2);
    let in_use = format!("outbox_test_{old}_{pid}_{}", n + 3);
    let fresh = format!("outbox_test_{}_{pid}_{}", now - 60, n + 4);
    let other_shapes = [
        format!("outbox_test_{old}_{pid}_{}x", n + 5),
        format!("outbox_test_{pid}_{}_{old}", n + 6),
        format!("outbox_test_{old}"),
    ];
    let other = Role::new(5).await;
    // Each dropped at the end whatever happens (the other role's, with the role).
    let _cleanup: Vec<ScratchDb> = stale
        .iter()
        .chain([&in_use, &fresh])
        .chain(&other_shapes)
        .map(|name| ScratchDb { url: database_url(name), name: name.clone() })
        .collect();
    for name in stale.iter().chain([&in_use, &fresh]).chain(&other_shapes) {
        admin.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await.unwrap();
    }
    admin.batch_execute(&format!("CREATE DATABASE \"{another_users}\" OWNER {}", other.name)).await.unwrap();
    let holder = actix_outbox::admin::connect(&database_url(&in_use)).await.unwrap();

    let dropped = drop_stale_databases(&server, Duration::from_secs(3600)).await.unwrap();
    for name in &stale {
        assert!(!database_exists(name).await, "{name} is stale");
    }
    let kept: Vec<&String> = [&another_users, &in_use, &fresh].into_iter().chain(&other_shapes).collect();
    for name in &kept {
        assert!(database_exists(name).await, "{name} is kept");
        assert!(!dropped.contains(name), "{name} not reported dropped: {dropped:?}");
    }

    // The first database a process creates on a server sweeps it (a server string this process
    // has not created a database on yet).
    let later = format!("outbox_test_{old}_{pid}_{}", n + 7);
    let _later = ScratchDb { url: database_url(&later), name: later.clone() };
    admin.batch_execute(&format!("CREATE DATABASE \"{later}\"")).await.unwrap();
    let separator = if server.contains("://") { if server.contains('?') { "&" } else { "?" } } else { " " };
    let sweeping = format!("{server}{separator}application_name=outbox_sweep_{n}");
    let db = TestDatabase::options().server_url(sweeping).create().await.unwrap();
    assert!(!database_exists(&later).await, "swept by the first creation");
    assert!(database_exists(db.name()).await);
    for name in &kept {
        assert!(database_exists(name).await, "{name} is still kept");
    }

    drop(holder);
}

/// Ten tests' databases on a crowded server (a role with six slots, two of them held), each
/// test on a thread and runtime of its own as the test harness runs them: a creation may be
/// refused (in the server's words, nothing else), every database created is used and dropped,
/// and none is left once the crowd is gone.
#[test]
fn a_crowded_server_leaves_no_test_database_behind() {
    let (role, crowd) = actix_rt::System::new().block_on(async {
        let role = Role::new(6).await;
        let crowd = role.hold(2).await;
        (role, crowd)
    });
    let server = role.server_url();
    let tests: Vec<_> = (0..10)
        .map(|i| {
            let server = server.clone();
            std::thread::spawn(move || {
                actix_rt::System::new().block_on(async move {
                    let db = TestDatabase::options().server_url(&server).pool_size(1).create().await?;
                    let event = NewEvent::new("order", i.to_string(), "order.placed", serde_json::json!({}));
                    let mut conn = db.pool().get().await?;
                    actix_outbox::enqueue(&mut conn, &event).await?;
                    Ok::<String, StoreError>(db.name().to_owned())
                })
            })
        })
        .collect();
    let results: Vec<Result<String, StoreError>> = tests.into_iter().map(|t| t.join().unwrap()).collect();
    let refused =
        format!("database connection failed: db error: FATAL: too many connections for role \"{}\"", role.name);
    for result in &results {
        if let Err(e) = result {
            assert_eq!(e.to_string(), refused, "refused in the server's words only");
        }
    }
    let created = results.iter().filter(|r| r.is_ok()).count();
    assert!(created >= 1, "some test got a database: {results:?}");
    actix_rt::System::new().block_on(async {
        assert_eq!(role.databases().await, Vec::<String>::new(), "{created} created, none left");
        drop(crowd);
    });
}
