//! The examples of docs/testing.md, run as the suite's tests: every ```` ```rust ```` block of
//! the page is a part of this file, word for word ([`the_testing_guide_quotes_this_file`]), so
//! what the page shows compiles and passes. A service's code first (an actix-web handler that
//! writes an order and its event), then its tests, as a service keeps them.

// ANCHOR: service
use actix_outbox::{NewEvent, PgPool, StoreError};
use actix_web::{HttpResponse, web};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, RunQueryDsl};

/// The service's table, as its own migrations create it.
pub const SCHEMA: &str = "CREATE TABLE orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    total_cents bigint NOT NULL
)";

#[derive(serde::Deserialize)]
struct Order {
    customer: String,
    total_cents: i64,
}

#[derive(diesel::QueryableByName)]
struct Inserted {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// `POST /orders`: the order and its `order.placed` event, in one transaction.
async fn place_order(pool: web::Data<PgPool>, order: web::Json<Order>) -> actix_web::Result<HttpResponse> {
    let mut conn = pool.get().await.map_err(actix_web::error::ErrorServiceUnavailable)?;
    let (order_id, event_id) = conn
        .transaction::<_, StoreError, _>(async |tx| {
            let row: Inserted =
                diesel::sql_query("INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id")
                    .bind::<Text, _>(&order.customer)
                    .bind::<BigInt, _>(order.total_cents)
                    .get_result(tx)
                    .await?;
            let payload =
                serde_json::json!({"order_id": row.id, "customer": order.customer, "total_cents": order.total_cents});
            let event = NewEvent::new("order", row.id.to_string(), "order.placed", payload);
            Ok((row.id, actix_outbox::enqueue(tx, &event).await?))
        })
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created().json(serde_json::json!({"order_id": order_id, "event_id": event_id})))
}

/// The service's routes.
pub fn routes(config: &mut web::ServiceConfig) {
    config.route("/orders", web::post().to(place_order));
}
// ANCHOR_END: service

// ANCHOR: order_tests
#[cfg(test)]
mod order_tests {
    use super::*;
    use actix_outbox::testkit::{MemorySink, TestDatabase, drain_until_idle};
    use actix_web::{App, test};
    use diesel_async::SimpleAsyncConnection;

    #[actix_web::test]
    async fn placing_an_order_publishes_order_placed() {
        // A database of this test's own on the server of TEST_DATABASE_URL (default
        // postgres://root@127.0.0.1:5432/postgres): the outbox's tables, then the service's.
        let db = TestDatabase::options().create_with(async |conn| conn.batch_execute(SCHEMA).await).await.unwrap();
        let app = App::new().app_data(web::Data::new(db.pool().clone())).configure(routes);
        let service = test::init_service(app).await;

        let order = serde_json::json!({"customer": "ada", "total_cents": 1200});
        let request = test::TestRequest::post().uri("/orders").set_json(&order).to_request();
        let response = test::call_service(&service, request).await;
        assert_eq!(response.status(), 201);
        let created: serde_json::Value = test::read_body_json(response).await;

        let sink = MemorySink::new();
        drain_until_idle(db.pool(), sink.clone()).await.unwrap().assert_no_dead();
        sink.assert_published("order.placed", 1);
        let event = &sink.published_of("order.placed")[0];
        assert_eq!(serde_json::json!(event.id), created["event_id"]);
        assert_eq!(event.aggregate_id, created["order_id"].to_string());
        assert_eq!(
            event.payload_value().unwrap(),
            serde_json::json!({"order_id": created["order_id"], "customer": "ada", "total_cents": 1200})
        );
    }
}
// ANCHOR_END: order_tests

// ANCHOR: failure_tests
#[cfg(test)]
mod failure_tests {
    use std::time::Duration;

    use actix_outbox::testkit::{MemorySink, TestDatabase, drain_until_idle};
    use actix_outbox::{NewEvent, PublishError};

    #[actix_web::test]
    async fn a_payment_is_retried_a_refused_event_is_dead_and_a_deferral_waits() {
        let db = TestDatabase::from_env().await.unwrap();
        let mut conn = db.pool().get().await.unwrap();
        let events = [
            NewEvent::new("payment", "7", "payment.charged", serde_json::json!({"cents": 1200})),
            NewEvent::new("legacy", "1", "legacy.event", serde_json::json!({})),
            NewEvent::new("invoice", "3", "invoice.due", serde_json::json!({})),
        ];
        actix_outbox::enqueue_many(&mut conn, &events).await.unwrap();
        drop(conn);

        let sink = MemorySink::new();
        sink.answer_times("payment.charged", 2, Err(PublishError::Retryable("gateway timeout".into())));
        sink.answer("legacy.event", Err(PublishError::Permanent("no route".into())));
        let later = PublishError::Defer { delay: Duration::from_secs(600), reason: "not before the 1st".into() };
        sink.answer("invoice.due", Err(later));
        let drained = drain_until_idle(db.pool(), sink.clone()).await.unwrap();

        assert_eq!((drained.done, drained.dead, drained.pending), (1, 1, 1));
        assert_eq!(drained.dead_rows[0].last_error.as_deref(), Some("permanent: no route"));
        sink.assert_published("payment.charged", 1);
        let payment_attempts: Vec<i32> = sink
            .calls()
            .iter()
            .filter(|call| call.message.event_type == "payment.charged")
            .map(|call| call.message.attempts)
            .collect();
        assert_eq!(payment_attempts, [1, 2, 3], "two retryable failures, then published");
    }
}
// ANCHOR_END: failure_tests

// ANCHOR: scheduled_tests
#[cfg(test)]
mod scheduled_tests {
    use actix_outbox::NewEvent;
    use actix_outbox::testkit::{MemorySink, TestDatabase, drain_until_idle};

    #[actix_web::test]
    async fn a_payment_reminder_waits_for_its_time() {
        let db = TestDatabase::from_env().await.unwrap();
        let mut conn = db.pool().get().await.unwrap();
        let in_an_hour = chrono::Utc::now() + chrono::Duration::hours(1);
        let reminder =
            NewEvent::new("order", "7", "order.payment_reminder", serde_json::json!({})).not_before(in_an_hour);
        let id = actix_outbox::enqueue(&mut conn, &reminder).await.unwrap();
        let stats = actix_outbox::admin::stats(&mut conn).await.unwrap();
        assert_eq!((stats.scheduled, stats.backlog()), (1, 0), "scheduled, not backlog");
        drop(conn);

        let sink = MemorySink::new();
        let drained = drain_until_idle(db.pool(), sink.clone()).await.unwrap();
        assert_eq!((drained.done, drained.pending), (0, 1));
        sink.assert_nothing_published();
        assert!(sink.calls().iter().all(|call| call.message.id != id), "never claimed");
    }
}
// ANCHOR_END: scheduled_tests

// ANCHOR: consumer_tests
#[cfg(test)]
mod consumer_tests {
    use actix_outbox::NewEvent;
    use actix_outbox::inbox::{BoxFuture, HandlerError, InboxHandler, InboxMessage};
    use actix_outbox::testkit::{Delivered, MemorySink, TestDatabase, deliver, drain_until_idle, inbox_message};
    use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

    /// The consumer's handler: counts each order once, in the inbox's transaction.
    struct CountOrders;

    impl InboxHandler for CountOrders {
        fn handle<'a>(
            &'a self,
            conn: &'a mut AsyncPgConnection,
            _message: &'a InboxMessage,
        ) -> BoxFuture<'a, Result<(), HandlerError>> {
            Box::pin(async move {
                diesel::sql_query("UPDATE order_count SET n = n + 1").execute(conn).await?;
                Ok(())
            })
        }
    }

    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }

    #[actix_web::test]
    async fn billing_counts_each_order_once() {
        // With the `inbox` feature, the inbox's tables come with the outbox's.
        let db = TestDatabase::options()
            .create_with(async |conn| {
                conn.batch_execute("CREATE TABLE order_count (n bigint NOT NULL); INSERT INTO order_count VALUES (0)")
                    .await
            })
            .await
            .unwrap();
        let mut conn = db.pool().get().await.unwrap();
        let placed = NewEvent::new("order", "7", "order.placed", serde_json::json!({"total_cents": 1200}));
        actix_outbox::enqueue(&mut conn, &placed).await.unwrap();
        let sink = MemorySink::new();
        drain_until_idle(db.pool(), sink.clone()).await.unwrap().assert_no_dead();

        // What the consumer receives, delivered twice, as at-least-once delivery may.
        let message = inbox_message(&sink.published()[0]);
        assert_eq!(deliver(db.pool(), "billing", &CountOrders, &message).await.unwrap(), Delivered::Applied);
        assert_eq!(deliver(db.pool(), "billing", &CountOrders, &message).await.unwrap(), Delivered::Duplicate);
        let count: Count = diesel::sql_query("SELECT n FROM order_count").get_result(&mut conn).await.unwrap();
        assert_eq!(count.n, 1);
    }
}
// ANCHOR_END: consumer_tests

/// Every Rust block of docs/testing.md is one of this file's marked parts (`ANCHOR: name` to
/// `ANCHOR_END: name`), word for word, and every marked part is on the page: the page shows
/// the code this suite compiles and runs.
#[test]
fn the_testing_guide_quotes_this_file() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/testing.md")).unwrap();
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/guide.rs")).unwrap();
    let blocks: Vec<&str> =
        page.split("```rust\n").skip(1).map(|rest| rest.split_once("```").expect("a closed block").0).collect();
    let mut parts = Vec::new();
    // The marked parts come before this test, whose own text names the markers.
    let mut rest = source.split_once("/// Every Rust block of docs/testing.md").unwrap().0;
    while let Some(start) = rest.find("// ANCHOR: ") {
        let body = &rest[start..];
        let (name, body) = body["// ANCHOR: ".len()..].split_once('\n').unwrap();
        let end = format!("// ANCHOR_END: {name}");
        let (part, after) = body.split_once(&end).unwrap_or_else(|| panic!("{end}"));
        parts.push((name.to_owned(), part.to_owned()));
        rest = after;
    }
    assert_eq!(parts.len(), 5, "the service and four test modules");
    let names: Vec<&str> = parts.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(blocks.len(), parts.len(), "one block per part, in order: {names:?}");
    for ((name, part), block) in parts.iter().zip(&blocks) {
        assert_eq!(block, part, "docs/testing.md's block for `{name}` differs from tests/it/guide.rs");
    }
}
