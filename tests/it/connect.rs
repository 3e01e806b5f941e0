//! Connecting: connection strings in both forms against the real PostgreSQL, every option kept
//! (also on the way to the maintenance database), failures that keep their cause, and no
//! password in any message, PostgreSQL's or RabbitMQ's.

use std::error::Error as _;

use actix_outbox::StoreError;
use actix_outbox::sink::{RabbitConfig, RabbitError, RabbitSink};
use diesel::QueryableByName;
use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::roles::Role;
use actix_outbox_test_support::proxy::Proxy;
use actix_outbox_test_support::{ScratchDb, TestDb, database_addr, database_exists};

/// The server of the default `TEST_DATABASE_URL`, spelled out in each form (root, trust auth).
const HOST: &str = "127.0.0.1";
const PORT: u16 = 5432;
const USER: &str = "root";

#[derive(QueryableByName)]
struct Session {
    #[diesel(sql_type = Text)]
    database: String,
    #[diesel(sql_type = Text)]
    application_name: String,
}

async fn session(conn: &mut AsyncPgConnection) -> (String, String) {
    let s: Session = diesel::sql_query(
        "SELECT current_database()::text AS database, current_setting('application_name') AS application_name",
    )
    .get_result(conn)
    .await
    .unwrap();
    (s.database, s.application_name)
}

/// diesel-async's own `establish` hands the string to tokio-postgres, so a `key=value` string
/// works there as it does in the crate's connections; each keeps the string's
/// `application_name`, and the crate names its connections when the string does not.
#[tokio::test]
async fn key_value_strings_connect_everywhere_and_keep_their_application_name() {
    let db = TestDb::new().await;
    let pairs = format!("host={HOST} port={PORT} user={USER} dbname={} application_name='outbox it'", db.name);

    let mut direct = AsyncPgConnection::establish(&pairs).await.expect("diesel-async establishes a key=value string");
    assert_eq!(session(&mut direct).await, (db.name.clone(), "outbox it".to_owned()));

    let mut own = actix_outbox::admin::connect(&pairs).await.unwrap();
    assert_eq!(session(&mut own).await, (db.name.clone(), "outbox it".to_owned()));
    let unnamed = format!("host={HOST} port={PORT} user={USER} dbname={}", db.name);
    let mut own = actix_outbox::admin::connect(&unnamed).await.unwrap();
    assert_eq!(session(&mut own).await, (db.name.clone(), "actix-outbox".to_owned()));

    let pool = actix_outbox::connect_pool(&pairs, 2).await.unwrap();
    actix_outbox::admin::check_connection(&pool).await.unwrap();
    assert_eq!(session(&mut pool.get().await.unwrap()).await, (db.name.clone(), "outbox it".to_owned()));
    let pool = actix_outbox::connect_pool(&unnamed, 2).await.unwrap();
    assert_eq!(session(&mut pool.get().await.unwrap()).await, (db.name.clone(), "actix-outbox".to_owned()));

    assert_eq!(actix_outbox::admin::pending_migrations(&pairs).await.unwrap(), Vec::<String>::new());
    assert_eq!(actix_outbox::migrate(&pairs).await.unwrap(), Vec::<String>::new());
}

/// `ensure_database` reaches the maintenance database with every option of the string but the
/// database name: here the host and port are only in the query or in the pairs, so a string
/// cut down to `postgres://user@/postgres`, or refused for not being a URL, fails.
#[tokio::test]
async fn ensure_database_keeps_every_option_of_the_string() {
    for form in ["url", "pairs"] {
        let db = ScratchDb::new();
        let url = match form {
            "url" => format!("postgres://{USER}@/{}?host={HOST}&port={PORT}&application_name=outbox-it", db.name),
            _ => format!("user={USER} dbname={} host={HOST} port={PORT} application_name='outbox it'", db.name),
        };
        assert!(!database_exists(&db.name).await);
        assert!(actix_outbox::admin::ensure_database(&url).await.unwrap(), "{form}: created");
        assert!(database_exists(&db.name).await, "{form}");
        assert!(!actix_outbox::admin::ensure_database(&url).await.unwrap(), "{form}: already there");
        let applied = actix_outbox::migrate(&url).await.unwrap();
        let embedded =
            diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::admin::MIGRATIONS).unwrap();
        assert_eq!(applied.len(), embedded.len(), "{form}");
        assert_eq!(actix_outbox::admin::pending_migrations(&url).await.unwrap(), Vec::<String>::new(), "{form}");
    }
}

/// A refused connection is `StoreError::Connect` whose source is the driver's error, itself
/// caused by the I/O error; a missing database keeps the server's SQLSTATE. No password shows.
#[tokio::test]
async fn connection_failures_keep_their_cause_and_no_password() {
    for url in [
        "postgres://admin:s3cret@127.0.0.1:1/outbox",
        "postgres://admin@127.0.0.1:1/outbox?password=s3cret",
        "host=127.0.0.1 port=1 user=admin password=s3cret dbname=outbox",
        "host=127.0.0.1 port=1 user=admin password='s3cret word' dbname=outbox",
    ] {
        let e = actix_outbox::admin::connect(url).await.map(|_| ()).unwrap_err();
        assert!(matches!(e, StoreError::Connect(_)) && e.is_transient(), "{e:?}");
        assert_eq!(
            e.to_string(),
            "database connection failed: error connecting to server: Connection refused (os error 111)"
        );
        let driver = e.source().unwrap().downcast_ref::<tokio_postgres::Error>().expect("the driver's error");
        let io = driver.source().unwrap().downcast_ref::<std::io::Error>().expect("its I/O cause");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");

        let e = actix_outbox::admin::ensure_database(url).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "database connection failed: error connecting to server: Connection refused (os error 111)"
        );
        let e = actix_outbox::migrate(url).await.unwrap_err();
        assert!(matches!(e, StoreError::Connect(_)), "{e:?}");
    }

    let missing = ScratchDb::new();
    let e = actix_outbox::admin::connect(&missing.url).await.map(|_| ()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("database connection failed: db error: FATAL: database \"{}\" does not exist", missing.name)
    );
    let driver = e.source().unwrap().downcast_ref::<tokio_postgres::Error>().unwrap();
    assert_eq!(driver.code(), Some(&tokio_postgres::error::SqlState::INVALID_CATALOG_NAME));

    let e = actix_outbox::connect_pool("postgres://admin:s3cret@127.0.0.1:port/outbox", 1).await.unwrap_err();
    assert!(matches!(e, StoreError::BadUrl(_)) && !e.is_transient(), "{e:?}");
    assert_eq!(
        e.to_string(),
        "malformed database URL \"postgres://admin:***@127.0.0.1:port/outbox\": invalid connection string: invalid value \
         for option `port` (expected postgres://user:password@host:port/database or key=value pairs: host=... \
         user=... password=... dbname=...)"
    );
    assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");
}

/// `migrate` on a database that does not exist names it and the function that creates it,
/// rather than handing over the server's refusal; it creates nothing itself.
#[tokio::test]
async fn migrating_a_missing_database_names_it_and_ensure_database() {
    let missing = ScratchDb::new();
    let e = actix_outbox::migrate(&missing.url).await.unwrap_err();
    assert!(matches!(&e, StoreError::NoDatabase { database } if *database == missing.name), "{e:?}");
    assert!(!e.is_transient());
    assert_eq!(
        e.to_string(),
        format!(
            "database {:?} does not exist: create it first with `actix_outbox::admin::ensure_database(url)` \
             (`actix-outbox migrate` creates it and migrates)",
            missing.name
        )
    );
    assert!(!database_exists(&missing.name).await);
}

/// The sink's configuration and errors mask the AMQP password in each place it can be.
#[tokio::test]
async fn rabbitmq_configs_and_errors_never_show_the_password() {
    for (url, masked) in [
        ("amqp://guest:s3cret@127.0.0.1:1/%2f", "amqp://guest:***@127.0.0.1:1/%2f"),
        ("amqps://guest:s3cret@127.0.0.1:1/%2f", "amqps://guest:***@127.0.0.1:1/%2f"),
        ("amqp://guest@127.0.0.1:1/%2f?password=s3cret", "amqp://guest@127.0.0.1:1/%2f?password=***"),
    ] {
        let config = RabbitConfig::new(url);
        assert_eq!(
            format!("{config:?}"),
            format!(
                "RabbitConfig {{ urls: [{masked:?}], exchange: \"outbox\", exchange_kind: Topic, declare_exchange: true, bindings: [], \
                 app_id: \"actix-outbox\", connect_timeout: 10s, reconnect_min: 100ms, reconnect_max: 10s, \
                 connection_name: None, unresponsive_after: 5s, outbox_headers: true, deduplication_header: false, \
                 cloudevents: Off, routing_key: \"event_type\" }}"
            )
        );
        let e = RabbitSink::connect(config).await.unwrap_err();
        assert!(matches!(e, RabbitError::Unreachable { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!("RabbitMQ is unreachable at {masked}: IO error: Connection refused (os error 111)")
        );
        assert_eq!(format!("{e:?}"), e.to_string(), "a readable line after `Error: ` too");
        assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");
    }

    let e = RabbitConfig::new("amqp:guest:s3cret@rabbit").validate().unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid RabbitMQ sink configuration: malformed AMQP URL \"amqp:guest:***@rabbit\": \
         Invalid URL: 'amqp:guest:***@rabbit'"
    );
}

/// `connect_pool` opens its first connection at once: a role, a database or a server that
/// refuses, or one that does not answer, fails it there in the server's or the driver's words
/// (the SQLSTATE kept in its source), rather than every checkout after it with a pool timeout.
/// `{:?}` prints the same line, which is what a `main` returning `Box<dyn Error>` shows.
#[tokio::test]
async fn connect_pool_fails_at_once_in_the_servers_words() {
    let db = TestDb::new().await;
    let addr = database_addr();
    let unknown_role = format!("postgres://nobody_{}@{addr}/{}", std::process::id(), db.name);
    let e = actix_outbox::connect_pool(&unknown_role, 4).await.unwrap_err();
    let expected =
        format!("database connection failed: db error: FATAL: role \"nobody_{}\" does not exist", std::process::id());
    assert_eq!(e.to_string(), expected);
    assert_eq!(format!("{e:?}"), expected);
    assert_eq!(format!("Error: {:?}", Box::<dyn std::error::Error>::from(e)), format!("Error: {expected}"));
    let e = actix_outbox::connect_pool(&unknown_role, 4).await.unwrap_err();
    let driver = e.source().unwrap().downcast_ref::<tokio_postgres::Error>().expect("the driver's error");
    assert_eq!(driver.code(), Some(&tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION));
    assert!(format!("{e:#?}").starts_with("StoreError {\n    message: "), "{e:#?}");

    let missing = ScratchDb::new();
    let e = actix_outbox::connect_pool(&missing.url, 4).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("database connection failed: db error: FATAL: database \"{}\" does not exist", missing.name)
    );

    let e = actix_outbox::connect_pool("postgres://root@127.0.0.1:1/outbox", 4).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "database connection failed: error connecting to server: Connection refused (os error 111)"
    );

    // A server that accepts the connection and never answers: the string's connect timeout.
    let silent = Proxy::start(addr.clone()).await;
    silent.blackhole();
    let url = format!("{}?connect_timeout=1", silent.route(&db.url));
    let e = actix_outbox::connect_pool(&url, 4).await.unwrap_err();
    assert_eq!(e.to_string(), "database connection failed: no answer within 1s");
    assert!(e.is_transient());

    // And one that works is open, its first connection in it.
    let pool = actix_outbox::connect_pool(&db.url, 4).await.unwrap();
    assert_eq!(pool.state().connections, 1);
}

/// The test kit's database reports a refused server with the driver's cause, as `migrate` does.
#[tokio::test]
async fn a_test_database_on_a_wrong_port_says_connection_refused() {
    let e = actix_outbox::testkit::TestDatabase::create("postgres://root@127.0.0.1:1/postgres").await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "database connection failed: error connecting to server: Connection refused (os error 111)"
    );
    assert!(matches!(e, StoreError::Connect(_)), "{e:#?}");
}

/// A URL that names no database (PostgreSQL would use the one named after the user) is refused
/// by `ensure_database`, `migrate` and `pending_migrations`, naming the fix, before anything is
/// created or migrated; `key=value` pairs without `dbname` keep libpq's default on purpose.
#[tokio::test]
async fn a_url_that_names_no_database_is_refused_with_the_fix() {
    let addr = database_addr();
    // A user of the test's own (removed with the database named after it, whatever happens).
    let role = Role::new(10).await;
    let user = role.name.clone();
    for url in [format!("postgres://{user}@{addr}/"), format!("postgres://{user}@{addr}")] {
        let expected = format!(
            "database URL {url:?} names no database (PostgreSQL would use the one named after the user, \"{user}\"): \
             name it in the path, postgres://{user}@{addr}/DATABASE (or with ?dbname=DATABASE)"
        );
        let e = actix_outbox::admin::ensure_database(&url).await.unwrap_err();
        assert!(matches!(e, StoreError::BadUrl(_)) && !e.is_transient(), "{e:#?}");
        assert_eq!(e.to_string(), expected);
        assert_eq!(actix_outbox::migrate(&url).await.unwrap_err().to_string(), expected);
        assert_eq!(actix_outbox::admin::pending_migrations(&url).await.unwrap_err().to_string(), expected);
        assert!(!database_exists(&user).await, "nothing created for {url}");
    }
    let (host, port) = addr.split_once(':').unwrap();
    let pairs = format!("host={host} port={port} user={user}");
    assert!(actix_outbox::admin::ensure_database(&pairs).await.unwrap(), "the user's database, on purpose");
    assert!(database_exists(&user).await);
    assert!(!actix_outbox::migrate(&pairs).await.unwrap().is_empty(), "migrated");
    assert_eq!(role.databases().await, std::slice::from_ref(&user));
}
