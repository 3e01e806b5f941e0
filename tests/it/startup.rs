//! A `main` that returns early, or panics, after it started the dispatcher: the process ends
//! with the user's own error or panic and the user's exit code, and nothing of the crate's (an
//! actor started while the system goes away does nothing). Each scenario is the README's
//! registration as a user writes it, run in a process of its own (see [`crate::alone`]).

use std::error::Error;
use std::net::TcpListener;

use actix_outbox::sink::{ChannelSink, RabbitConfig, RabbitSink};
use actix_outbox::{DispatcherConfig, OutboxSupervisor};
use actix_outbox_test_support::{TestBroker, TestDb, amqp_url};
use actix_web::{App, HttpServer};

use crate::alone::{role, run_alone, stderr};

/// What the child reads from its parent.
const DATABASE_URL: &str = "STARTUP_DATABASE_URL";
const EXCHANGE: &str = "STARTUP_EXCHANGE";
const TAKEN_PORT: &str = "STARTUP_TAKEN_PORT";

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent"))
}

/// `#[actix_web::main] async fn main() -> Result<(), Box<dyn Error>>` as the compiler writes it:
/// the body on a fresh system, then the `Termination` of a `Result` (`Error: {:?}`, exit 1).
fn as_main(body: impl std::future::Future<Output = Result<(), Box<dyn Error>>>) -> ! {
    let result = actix_web::rt::System::new().block_on(body);
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("Error: {e:?}");
            std::process::exit(1)
        }
    }
}

/// The README's registration, with the RabbitMQ sink and the console, then the user's server
/// on `port`, which is taken.
async fn readme_with_a_taken_port() -> Result<(), Box<dyn Error>> {
    let db = var(DATABASE_URL);
    actix_outbox::migrate(&db).await?;
    let outbox_pool = actix_outbox::connect_pool(&db, 6).await?;
    let sink = RabbitSink::connect(RabbitConfig::new(amqp_url()).exchange(var(EXCHANGE))).await?;
    let outbox = OutboxSupervisor::start(DispatcherConfig::default(), outbox_pool.clone(), sink.clone())?;
    let console = actix_outbox_console::Console::new(outbox_pool).supervisor(outbox.clone());
    let port: u16 = var(TAKEN_PORT).parse()?;
    HttpServer::new(move || App::new().service(console.scope("/outbox"))).bind(("127.0.0.1", port))?.run().await?;
    outbox.send(actix_outbox::dispatcher::Shutdown).await?;
    sink.close().await;
    Ok(())
}

/// The dispatcher publishes the row waiting in the outbox, then the user's code fails.
async fn error_after_the_first_claim() -> Result<(), Box<dyn Error>> {
    let pool = actix_outbox::connect_pool(&var(DATABASE_URL), 4).await?;
    let (sink, mut published) = ChannelSink::new();
    let _outbox = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink)?;
    let first = published.recv().await.ok_or("the sink's channel closed")?;
    Err(format!("the user's own error, after message {} went out", first.id).into())
}

/// The user's code panics right after the start.
async fn panic_after_start() -> Result<(), Box<dyn Error>> {
    let pool = actix_outbox::connect_pool(&var(DATABASE_URL), 4).await?;
    let (sink, _published) = ChannelSink::new();
    let _outbox = OutboxSupervisor::start(DispatcherConfig::default(), pool, sink)?;
    panic!("the user's own panic");
}

/// Nothing of the crate's is in the child's stderr: no panic but the user's, no runtime error.
fn assert_only_the_users(stderr: &str, users: &str) {
    assert!(stderr.contains(users), "the user's message is printed: {stderr}");
    let panics = stderr.matches("panicked at").count();
    let expected = usize::from(users.contains("panic"));
    assert_eq!(panics, expected, "no panic of ours: {stderr}");
    for ours in ["reactor", "Tokio 1.x", "actix_outbox", "outbox dispatcher"] {
        assert!(!stderr.contains(ours), "nothing of ours ({ours}): {stderr}");
    }
}

/// The README's snippet, and the server's `bind` fails because the port is taken: the process
/// prints the user's `Error: ... AddrInUse ...` and exits 1.
#[test]
fn a_taken_port_after_start_ends_with_the_users_error() {
    const NAME: &str = "startup::a_taken_port_after_start_ends_with_the_users_error";
    if role().as_deref() == Some(NAME) {
        as_main(readme_with_a_taken_port());
    }
    actix_rt::System::new().block_on(async {
        let db = TestDb::new().await;
        let broker = TestBroker::new("startup").await;
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port().to_string();
        let env = [(DATABASE_URL, db.url.as_str()), (EXCHANGE, broker.exchange.as_str()), (TAKEN_PORT, port.as_str())];
        let output = run_alone(NAME, NAME, &env);
        let stderr = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert_only_the_users(&stderr, "Error: Os { code: 98, kind: AddrInUse");
        drop(taken);
    })
}

/// An error returned once the dispatcher has claimed and published: the user's error, exit 1,
/// and the row the dispatcher published is done or still leased, never dead.
#[test]
fn an_error_after_the_first_claim_ends_with_the_users_error() {
    const NAME: &str = "startup::an_error_after_the_first_claim_ends_with_the_users_error";
    if role().as_deref() == Some(NAME) {
        as_main(error_after_the_first_claim());
    }
    actix_rt::System::new().block_on(async {
        let db = TestDb::new().await;
        let ids = db.seed(1, "startup").await;
        let output = run_alone(NAME, NAME, &[(DATABASE_URL, db.url.as_str())]);
        let stderr = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert_only_the_users(&stderr, &format!("Error: \"the user's own error, after message {} went out\"", ids[0]));
        assert_eq!(db.count_status("dead").await, 0);
    })
}

/// A panic in `main` after the start: the user's panic message, exit 101 (as a panicking `main`
/// or test), no second panic (which would abort the process).
#[test]
fn a_panic_after_start_ends_with_the_users_panic() {
    const NAME: &str = "startup::a_panic_after_start_ends_with_the_users_panic";
    if role().as_deref() == Some(NAME) {
        as_main(panic_after_start());
    }
    actix_rt::System::new().block_on(async {
        let db = TestDb::new().await;
        let output = run_alone(NAME, NAME, &[(DATABASE_URL, db.url.as_str())]);
        let stderr = stderr(&output);
        assert_eq!(output.status.code(), Some(101), "a panic's exit code, not an abort: {stderr}");
        assert_only_the_users(&stderr, "the user's own panic");
    })
}
