//! The actix-web example (`examples/actix_web.rs`, included here) driven over real HTTP against
//! the real PostgreSQL and RabbitMQ: orders in, events out at a real queue.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use actix_outbox_test_support::{PATIENCE, TestBroker, TestDb, amqp_url, eventually, saw};

#[path = "../../examples/actix_web.rs"]
mod app;

/// The example counts orders in the process-wide Prometheus recorder: the tests that post
/// orders take turns, so that each reads its own increments.
static ORDERS_COUNTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `orders_created_total` in a Prometheus text page (0 before the first order).
fn orders_created(metrics: &str) -> u64 {
    metrics.lines().find_map(|l| l.strip_prefix("orders_created_total ")).map_or(0, |n| n.parse().expect("a count"))
}

/// One HTTP/1.1 request on a fresh connection: the status and the body.
async fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect to the app");
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut response))
        .await
        .expect("response within 30s")
        .unwrap();
    let response = String::from_utf8(response).expect("UTF-8 response");
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    let status = head.split(' ').nth(1).expect("status code").parse().expect("numeric status");
    assert!(!head.to_ascii_lowercase().contains("transfer-encoding: chunked"), "{head}");
    (status, body.to_owned())
}

/// 20 orders and 3 bad bodies over real HTTP: 20 × 201 with increasing ids, 3 × 400 writing
/// nothing; 20 order rows, 20 outbox rows done, the 20 events at a real queue with their
/// outbox ids and bodies; ready is 200, /metrics renders the example's counter; stopping the
/// server drains the dispatcher and closes the sink. Then, as the README runs it, the demo queue.
#[actix_rt::test]
async fn orders_over_http_reach_a_real_queue() {
    let _counter = ORDERS_COUNTER.lock().await;
    let db = TestDb::new().await;
    let (broker, queue) = TestBroker::with_queue("web").await;
    let settings = app::Settings {
        database_url: db.url.clone(),
        amqp_url: amqp_url(),
        exchange: broker.exchange.clone(),
        bind: "127.0.0.1:0".into(),
        http_workers: 2,
        demo_queue: None,
    };
    let running = app::start(&settings, false).await.expect("the app starts");
    let addr = running.addrs[0];
    let handle = running.handle.clone();
    let served = actix_rt::spawn(running.run());

    let (status, body) = http(addr, "GET", "/health/ready", None).await;
    assert_eq!((status, body.as_str()), (200, "ready"));
    let (_, metrics) = http(addr, "GET", "/metrics", None).await;
    let before = orders_created(&metrics);

    let mut created = Vec::new();
    for i in 0..20_i64 {
        let order = serde_json::json!({"customer": format!("customer-{i}"), "total_cents": 100 * i});
        let (status, body) = http(addr, "POST", "/orders", Some(&order.to_string())).await;
        assert_eq!(status, 201, "order {i}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        let keys: Vec<&str> = answer.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["event_id", "order_id"], "{body}");
        created.push((answer["order_id"].as_i64().unwrap(), answer["event_id"].as_i64().unwrap(), i));
    }
    assert!(created.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1), "increasing ids: {created:?}");

    for bad in [
        r#"{"customer": "eve", "total_cents": "#,
        r#"{"customer": "eve"}"#,
        r#"{"customer": "eve", "total_cents": -1}"#,
    ] {
        let (status, body) = http(addr, "POST", "/orders", Some(bad)).await;
        assert_eq!(status, 400, "{bad}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).expect("a JSON error");
        assert!(answer["error"].as_str().is_some_and(|e| !e.is_empty()), "{body}");
    }
    let (_, body) = http(addr, "POST", "/orders", Some(r#"{"customer": "eve", "total_cents": -1}"#)).await;
    assert_eq!(body, r#"{"error":"total_cents must not be negative"}"#);

    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let orders: Count =
        diesel::sql_query("SELECT count(*) AS n FROM orders").get_result(&mut db.conn().await).await.unwrap();
    assert_eq!(orders.n, 20, "bad bodies wrote no order");
    eventually(PATIENCE, "20 outbox rows done", || async { saw(db.count_status("done").await, |v| *v == 20) }).await;
    assert_eq!(db.rows().await.len(), 20, "bad bodies wrote no event");

    let delivered = broker.take(&queue, 20).await;
    let bodies: BTreeMap<i64, serde_json::Value> = delivered
        .iter()
        .map(|d| {
            let id = d.properties.message_id().as_ref().expect("message_id").as_str().parse().unwrap();
            (id, serde_json::from_slice(&d.data).unwrap())
        })
        .collect();
    let expected: BTreeMap<i64, serde_json::Value> = created
        .iter()
        .map(|&(order_id, event_id, i)| {
            let body =
                serde_json::json!({"order_id": order_id, "customer": format!("customer-{i}"), "total_cents": 100 * i});
            (event_id, body)
        })
        .collect();
    assert_eq!(bodies, expected, "each event, once, under its outbox id");
    assert!(delivered.iter().all(|d| d.routing_key.as_str() == "order.created"));

    let (status, body) = http(addr, "GET", "/health/ready", None).await;
    assert_eq!((status, body.as_str()), (200, "ready"));
    let (status, metrics) = http(addr, "GET", "/metrics", None).await;
    assert_eq!(status, 200);
    assert_eq!(orders_created(&metrics), before + 20, "{metrics}");

    handle.stop(true).await;
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the app stops within 30s")
        .unwrap()
        .expect("the server ended cleanly");
    assert!(TcpStream::connect(addr).await.is_err(), "nothing listens after the stop");

    // After the first app, not beside it: both count orders in the process-wide recorder.
    the_first_order_reaches_the_demo_queue_instead_of_going_dead().await;
}

/// As the README runs it: nothing else bound to the exchange. The example's demo queue catches
/// the first order's event, so its row ends `done`, not `dead` as unroutable.
async fn the_first_order_reaches_the_demo_queue_instead_of_going_dead() {
    let db = TestDb::new().await;
    let mut broker = TestBroker::new("web-demo").await;
    let demo = actix_outbox_test_support::unique("demo");
    broker.remove_at_end(demo.clone(), broker.exchange.clone());
    let settings = app::Settings {
        database_url: db.url.clone(),
        amqp_url: amqp_url(),
        exchange: broker.exchange.clone(),
        bind: "127.0.0.1:0".into(),
        http_workers: 1,
        demo_queue: Some(demo.clone()),
    };
    let running = app::start(&settings, false).await.expect("the app starts");
    let (addr, handle) = (running.addrs[0], running.handle.clone());
    let served = actix_rt::spawn(running.run());

    let (status, body) = http(addr, "POST", "/orders", Some(r#"{"customer": "ada", "total_cents": 1200}"#)).await;
    assert_eq!(status, 201, "{body}");
    eventually(PATIENCE, "the event's row done", || async { saw(db.count_status("done").await, |v| *v == 1) }).await;
    assert_eq!(db.count_status("dead").await, 0);
    let delivered = broker.take(&demo, 1).await;
    assert_eq!(delivered[0].routing_key.as_str(), "order.created");

    handle.stop(true).await;
    tokio::time::timeout(Duration::from_secs(30), served).await.expect("stops").unwrap().expect("cleanly");
}

// The example's route with the test kit, as a service would test it (docs/testing.md shows the
// same with a handler of its own).
use actix_outbox::testkit::{MemorySink, TestDatabase, drain_until_idle};
use actix_web::{App, test, web};

/// The example's `POST /orders` handler, mounted alone, tested end to end with the test kit: the
/// order's row and its event commit together, and a dispatcher publishes `order.created` once.
#[actix_web::test]
async fn posting_an_order_publishes_order_created() {
    let _counter = ORDERS_COUNTER.lock().await;
    let db = TestDatabase::from_env().await.unwrap();
    app::create_orders_table(db.pool()).await.unwrap();
    let orders = web::Data::new(app::Orders { pool: db.pool().clone() });
    let service = test::init_service(App::new().app_data(orders).configure(app::order_routes)).await;

    let order = serde_json::json!({"customer": "ada", "total_cents": 1200});
    let request = test::TestRequest::post().uri("/orders").set_json(&order).to_request();
    let response = test::call_service(&service, request).await;
    assert_eq!(response.status(), 201);
    let created: serde_json::Value = test::read_body_json(response).await;

    let sink = MemorySink::new();
    drain_until_idle(db.pool(), sink.clone()).await.unwrap().assert_no_dead();
    sink.assert_published("order.created", 1);
    let event = &sink.published_of("order.created")[0];
    assert_eq!(serde_json::json!(event.id), created["event_id"]);
    assert_eq!(event.aggregate_id, created["order_id"].to_string());
    let payload: serde_json::Value = serde_json::from_str(event.payload.get()).unwrap();
    assert_eq!(payload, serde_json::json!({"order_id": created["order_id"], "customer": "ada", "total_cents": 1200}));
}
