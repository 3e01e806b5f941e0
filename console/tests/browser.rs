//! The console in a real browser: headless Chromium driven over WebDriver (chromedriver) with
//! fantoccini, against a real `HttpServer` and the real PostgreSQL.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`/usr/bin/chromium`, `/usr/bin/chromedriver`;
//! `CHROMIUM` and `CHROMEDRIVER` point elsewhere); `.ci/run` installs them. Without chromedriver
//! the test says so loudly and passes, except under `CI=true`, where it fails.
//!
//! It also takes the screenshot that `docs/console.md` shows (`docs/console.png`, rewritten
//! with `UPDATE_DOCS=1`).

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use actix_outbox::Fifo;
use actix_outbox_console::Console;
use actix_web::{App, HttpServer};
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use support::{HOSTILE, TestDb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "browser-test-operator-token-5f1c2a";

fn program(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| PathBuf::from(default))
}

/// chromedriver, or `None` (after a loud message) when it is absent outside CI.
fn chromedriver() -> Option<PathBuf> {
    let path = program("CHROMEDRIVER", "/usr/bin/chromedriver");
    if path.exists() {
        return Some(path);
    }
    let message = format!(
        "{} not found: the console's browser test cannot run (apt-get install -y chromium chromium-driver)",
        path.display()
    );
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{message}; CI must run it");
    }
    eprintln!("\n!!!!!!!!!! SKIPPED: {message} !!!!!!!!!!\n");
    None
}

/// The chromedriver process, killed when the test ends however it ends.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts chromedriver on a free loopback port and waits until it accepts connections.
async fn start_driver(path: &Path) -> (Driver, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(path)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", path.display()));
    let driver = Driver(child);
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return (driver, format!("http://127.0.0.1:{port}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("chromedriver did not listen on port {port}");
}

async fn browser(driver: &str) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".to_owned(),
        serde_json::json!({
            "binary": program("CHROMIUM", "/usr/bin/chromium"),
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1100", "--force-device-scale-factor=1"],
        }),
    );
    ClientBuilder::new(HttpConnector::new()).capabilities(caps).connect(driver).await.expect("a Chromium session")
}

/// The status code of a POST made with no credentials at all, over a plain TCP connection.
async fn anonymous_post(addr: SocketAddr, path: &str, form: &str) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or_else(|| panic!("no status: {answer}"))
}

async fn text(client: &Client, css: &str) -> String {
    client.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("{css}: {e}")).text().await.unwrap()
}

#[actix_web::test]
async fn an_operator_reads_the_table_and_retries_a_dead_row_in_chromium() {
    let Some(chromedriver) = chromedriver() else { return };
    let db = TestDb::new().await;
    for i in 0..4 {
        db.insert("pending", &format!("{}", 100 + i), "order.created", None).await;
    }
    db.insert("processing", "200", "order.created", None).await;
    let hostile = db.insert("dead", HOSTILE, "order.paid", Some("<img src=x onerror=alert(1)> rejected")).await;
    let dead = db.insert("dead", "300", "order.created", Some("broker said: NOT_FOUND - no exchange 'billing'")).await;
    let untouched = db.insert("dead", "301", "invoice.created", Some("timeout after 10s")).await;
    for i in 0..3 {
        db.insert("done", &format!("{}", 400 + i), "order.created", None).await;
    }

    let console = Console::new(db.pool.clone()).token(TOKEN).fifo(Fifo::All).source("billing-eu".to_owned());
    let server = HttpServer::new(move || App::new().service(console.scope("/outbox")))
        .workers(1)
        .disable_signals()
        .bind("127.0.0.1:0")
        .unwrap();
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    actix_rt::spawn(server);
    let base = format!("http://{addr}/outbox");

    let (_driver, driver_url) = start_driver(&chromedriver).await;
    let client = browser(&driver_url).await;

    // The overview's counts are the table's.
    client.goto(&format!("{base}/")).await.unwrap();
    for (status, css) in [("pending", "#count-pending"), ("processing", "#count-processing"), ("dead", "#count-dead")] {
        assert_eq!(text(&client, css).await, db.count_status(status).await.to_string(), "{status}");
    }
    assert_eq!(text(&client, "#count-pending").await, "4");
    assert_eq!(text(&client, "#count-dead").await, "3");
    assert_eq!(text(&client, "#count-blocked").await, "3");
    assert_eq!(text(&client, "#source").await, "billing-eu");

    // A hostile aggregate id is text: no element of its markup exists, no script of it ran.
    client.goto(&format!("{base}/dead")).await.unwrap();
    assert_eq!(text(&client, &format!("#row-{hostile} .agg-id")).await, HOSTILE);
    assert!(client.find_all(Locator::Css("#pwned")).await.unwrap().is_empty());
    assert!(client.find_all(Locator::Css("main img")).await.unwrap().is_empty());
    assert_eq!(client.title().await.unwrap(), "Dead rows · outbox console · billing-eu");
    client.goto(&format!("{base}/rows/{hostile}")).await.unwrap();
    assert_eq!(text(&client, "#col-aggregate-id").await, HOSTILE);
    assert!(client.find_all(Locator::Css("#pwned")).await.unwrap().is_empty());
    // Before logging in there is nothing to press.
    client.goto(&format!("{base}/dead")).await.unwrap();
    assert!(client.find_all(Locator::Css("button.retry")).await.unwrap().is_empty());

    // A POST without credentials changes nothing.
    assert_eq!(anonymous_post(addr, &format!("/outbox/dead/{dead}/retry"), "").await, 401);
    assert_eq!(anonymous_post(addr, "/outbox/dead/skip", &format!("id={dead}&reason=x")).await, 401);
    assert_eq!(db.state(dead).await.0, "dead");

    // Log in with the token, and press "Retry" on one dead row.
    client.goto(&format!("{base}/login")).await.unwrap();
    client.find(Locator::Id("token")).await.unwrap().send_keys(TOKEN).await.unwrap();
    client.find(Locator::Id("login-submit")).await.unwrap().click().await.unwrap();
    client.wait().for_element(Locator::Id("logout")).await.unwrap();
    assert_eq!(client.current_url().await.unwrap().as_str(), format!("{base}/"));

    // Saved under the target directory on every run; `UPDATE_DOCS=1` also replaces the one that
    // docs/console.md shows, so that a test run leaves the tree as it was.
    let png = client.screenshot().await.unwrap();
    std::fs::write(Path::new(env!("CARGO_TARGET_TMPDIR")).join("console.png"), &png).unwrap();
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/console.png"), &png).unwrap();
    }

    client.goto(&format!("{base}/dead")).await.unwrap();
    client.find(Locator::Css(&format!("#row-{dead} button.retry"))).await.unwrap().click().await.unwrap();
    let outcome = client.wait().for_element(Locator::Id("outcome")).await.unwrap().text().await.unwrap();
    assert_eq!(outcome, format!("retried 1 dead row (now pending, attempts reset): {dead}"));
    assert_eq!(
        db.state(dead).await,
        ("pending".to_owned(), 0, Some("broker said: NOT_FOUND - no exchange 'billing'".to_owned()))
    );
    assert_eq!(db.state(untouched).await.0, "dead");
    assert_eq!(db.state(hostile).await.0, "dead");

    // Back on the overview, the counts follow.
    client.goto(&format!("{base}/")).await.unwrap();
    assert_eq!(text(&client, "#count-pending").await, "5");
    assert_eq!(text(&client, "#count-dead").await, "2");

    client.close().await.unwrap();
    handle.stop(true).await;
}
