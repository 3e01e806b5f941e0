//! An actix-web service that writes orders and their outbox events in one transaction, with
//! the dispatcher running inside the application.
//!
//! ```text
//! cargo run --example actix_web
//! curl -si -X POST localhost:8080/orders -H 'content-type: application/json' \
//!      -d '{"customer": "ada", "total_cents": 1250}'
//! curl -s localhost:8080/metrics
//! curl -si localhost:8080/health/ready
//! ```
//!
//! - `DATABASE_URL` (default `postgres://root@127.0.0.1:5432/outbox_demo`) is created if
//!   missing and migrated; the example adds an `orders` table of its own.
//! - `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`): the sink declares the
//!   `outbox` topic exchange (`EXCHANGE` overrides). Events are published `mandatory`: one that
//!   no queue is bound for is returned by the broker and its row goes `dead` as unroutable, so
//!   the sink declares a durable demo queue too (`RabbitConfig::bind_queue_with`), `DEMO_QUEUE`
//!   (default `actix-outbox.orders-demo`), bound for `order.#`, where the events wait. Read them with
//!   `cargo run --example inbox_consumer -- --queue actix-outbox.orders-demo --no-bind`, count
//!   them with `rabbitmqctl list_queues name messages`, remove the queue with
//!   `rabbitmqctl delete_queue actix-outbox.orders-demo`. `DEMO_QUEUE=` (empty) declares none.
//! - `BIND` (default `127.0.0.1:8080`): where the HTTP server listens.
//!
//! Routes:
//!
//! - `POST /orders` with `{"customer": "...", "total_cents": N}`: the order row and its
//!   `order.created` event commit together; `201 {"order_id": N, "event_id": N}`. A body that is
//!   not such an object, or a negative total, is `400 {"error": "..."}` and writes nothing.
//! - `GET /metrics`: whatever was recorded through the `metrics` facade, in Prometheus' text
//!   format.
//! - `GET /health/ready`: `200 ready` when the database answers `SELECT 1` and the sink is up,
//!   else `503` with the reason on one line.
//!
//! SIGTERM or SIGINT (Ctrl-C) stops the HTTP server (requests under way finish), then the
//! dispatcher drains its in-flight publishes, then the connection to RabbitMQ is closed.
//!
//! The integration tests include this file (`tests/it/web.rs`) and drive [`start`] over real
//! HTTP.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use actix::Addr;
use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::{QueueKind, RabbitConfig, RabbitSink, SinkState};
use actix_outbox::{DispatcherConfig, NewEvent, OutboxSupervisor, PgPool, Publisher, StoreError};
use actix_web::{App, HttpResponse, HttpServer, web};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;

type BoxError = Box<dyn std::error::Error>;

/// Where the service finds its services and listens.
#[derive(Debug, Clone)]
pub struct Settings {
    pub database_url: String,
    pub amqp_url: String,
    pub exchange: String,
    pub bind: String,
    pub http_workers: usize,
    /// A queue that the sink declares and binds for `order.#` each time it connects, so that
    /// the events have somewhere to go (see the module docs); `None` when something else
    /// consumes them.
    pub demo_queue: Option<String>,
}

impl Settings {
    /// From the environment (`DATABASE_URL`, `AMQP_URL`, `EXCHANGE`, `BIND`), with the defaults
    /// of the quick start's services.
    #[allow(dead_code)] // not used by the test that includes this file
    pub fn from_env() -> Self {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        Settings {
            database_url: var("DATABASE_URL", "postgres://root@127.0.0.1:5432/outbox_demo"),
            amqp_url: var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            exchange: var("EXCHANGE", "outbox"),
            bind: var("BIND", "127.0.0.1:8080"),
            http_workers: 2,
            demo_queue: Some(var("DEMO_QUEUE", "actix-outbox.orders-demo")).filter(|q| !q.is_empty()),
        }
    }
}

/// What the handlers share (besides the dispatcher's address).
struct AppState {
    /// The handlers' pool. The dispatcher has one of its own, so that a burst of requests cannot
    /// hold up its claims (sharing one works too: no connection is tied to the runtime of the
    /// HTTP worker that opened it).
    pool: PgPool,
    sink: RabbitSink,
    metrics: PrometheusHandle,
}

/// The service, bound and ready to run.
pub struct Running {
    /// The addresses the HTTP server listens on (the port chosen, for `:0`).
    pub addrs: Vec<SocketAddr>,
    /// Stops the HTTP server (what a signal does).
    pub handle: actix_web::dev::ServerHandle,
    server: actix_web::dev::Server,
    dispatcher: Addr<OutboxSupervisor>,
    sink: RabbitSink,
}

impl Running {
    /// Serves until the HTTP server stops (a signal, or [`Running::handle`]), then drains the
    /// dispatcher and closes the sink, in that order.
    pub async fn run(self) -> std::io::Result<()> {
        let served = self.server.await;
        // [outbox-registration] shutdown: after the HTTP server, the dispatcher drains, then the sink closes.
        let _ = self.dispatcher.send(Shutdown).await;
        self.sink.close().await;
        served
    }
}

/// The process-wide Prometheus recorder (installed on first use): every `metrics::counter!` and
/// friends, the library's `outbox_*` metrics included, land in it. If the process already has
/// another recorder, `/metrics` renders an empty one and says so in the log.
fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| match PrometheusBuilder::new().install_recorder() {
            Ok(handle) => handle,
            Err(e) => {
                tracing::warn!(error = %e, "cannot install the Prometheus recorder; /metrics stays empty");
                PrometheusBuilder::new().build_recorder().handle()
            }
        })
        .clone()
}

/// Creates and migrates the database, creates the `orders` table, connects the sink, starts the
/// dispatcher and binds the HTTP server. `signals`: whether SIGTERM/SIGINT stop the server.
pub async fn start(settings: &Settings, signals: bool) -> Result<Running, BoxError> {
    if actix_outbox::admin::ensure_database(&settings.database_url).await? {
        // A `ConnectionString` shows the URL with its password masked.
        let url = actix_outbox::ConnectionString::parse(&settings.database_url)?;
        tracing::info!(%url, "created the database");
    }
    actix_outbox::migrate(&settings.database_url).await?;
    let outbox_pool = actix_outbox::connect_pool(&settings.database_url, 4).await?;
    let pool = actix_outbox::connect_pool(&settings.database_url, 8).await?;
    create_orders_table(&pool).await?;

    // [outbox-registration] begin: the sink and the dispatcher, inside the application.
    let mut rabbit = RabbitConfig::new(&settings.amqp_url).exchange(&settings.exchange);
    if let Some(queue) = &settings.demo_queue {
        // Classic: the demo queue that earlier runs of this example left is one, and a queue's
        // type cannot change.
        rabbit = rabbit.bind_queue_with(queue, "order.#", QueueKind::Classic);
    }
    let sink = RabbitSink::connect(rabbit).await?;
    let dispatcher = OutboxSupervisor::start(DispatcherConfig::default(), outbox_pool, sink.clone())?;
    let outbox = web::Data::new(dispatcher.clone());
    // [outbox-registration] end
    if let Some(queue) = &settings.demo_queue {
        tracing::info!(queue = %queue, exchange = %settings.exchange,
            "order events wait in the demo queue (bound for order.#); read them with \
             `cargo run --example inbox_consumer -- --queue {queue} --no-bind`");
    }

    // The operator console at /outbox (docs/console.md): read-only unless ACTIX_OUTBOX_CONSOLE_TOKEN is set.
    let console = actix_outbox_console::Console::new(pool.clone())
        .supervisor(dispatcher.clone())
        .token(std::env::var("ACTIX_OUTBOX_CONSOLE_TOKEN").unwrap_or_default());
    let orders = web::Data::new(Orders { pool: pool.clone() });
    let state = web::Data::new(AppState { pool, sink: sink.clone(), metrics: prometheus() });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(outbox.clone()) // [outbox-registration]
            .app_data(state.clone())
            .app_data(orders.clone())
            .configure(order_routes)
            .route("/metrics", web::get().to(render_metrics))
            .route("/health/ready", web::get().to(ready))
            .service(console.scope("/outbox"))
    })
    .workers(settings.http_workers)
    .shutdown_timeout(10);
    let server = if signals { server } else { server.disable_signals() };
    let server = match server.bind(&settings.bind) {
        Ok(server) => server,
        Err(e) => {
            dispatcher.send(Shutdown).await?;
            sink.close().await;
            return Err(format!("cannot listen on {}: {e}", settings.bind).into());
        }
    };
    let addrs = server.addrs();
    let server = server.run();
    Ok(Running { addrs, handle: server.handle(), server, dispatcher, sink })
}

/// The business table the example writes beside its events.
pub async fn create_orders_table(pool: &PgPool) -> Result<(), BoxError> {
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS orders (
                 id          bigserial   PRIMARY KEY,
                 customer    text        NOT NULL,
                 total_cents bigint      NOT NULL,
                 created_at  timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await?;
    Ok(())
}

/// What the order routes need: the handlers' pool.
pub struct Orders {
    /// Where orders and their events are written.
    pub pool: PgPool,
}

/// `POST /orders`, on `web::Data<Orders>`: what a test mounts without the rest of the app
/// (`tests/it/web.rs`).
pub fn order_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/orders", web::post().to(create_order));
}

#[derive(Debug, Deserialize)]
struct CreateOrder {
    customer: String,
    total_cents: i64,
}

fn bad_request(why: impl std::fmt::Display) -> HttpResponse {
    HttpResponse::BadRequest().json(serde_json::json!({ "error": why.to_string() }))
}

fn unavailable(why: impl std::fmt::Display) -> HttpResponse {
    HttpResponse::ServiceUnavailable().content_type("text/plain; charset=utf-8").body(one_line(&why))
}

/// `POST /orders`: the order and its event, one transaction.
async fn create_order(orders: web::Data<Orders>, body: web::Bytes) -> HttpResponse {
    let order: CreateOrder = match serde_json::from_slice(&body) {
        Ok(order) => order,
        Err(e) => return bad_request(format!("expected {{\"customer\": string, \"total_cents\": integer}}: {e}")),
    };
    if order.total_cents < 0 {
        return bad_request("total_cents must not be negative");
    }
    let mut conn = match orders.pool.get().await {
        Ok(conn) => conn,
        Err(e) => return unavailable(format!("database unavailable: {e}")),
    };
    let written = conn
        .transaction(async |tx| {
            #[derive(diesel::QueryableByName)]
            struct Inserted {
                #[diesel(sql_type = BigInt)]
                id: i64,
            }
            let inserted: Inserted =
                diesel::sql_query("INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id")
                    .bind::<Text, _>(&order.customer)
                    .bind::<BigInt, _>(order.total_cents)
                    .get_result(tx)
                    .await?;
            let event = NewEvent::new(
                "order",
                inserted.id.to_string(),
                "order.created",
                serde_json::json!({
                    "order_id": inserted.id,
                    "customer": order.customer,
                    "total_cents": order.total_cents,
                }),
            );
            let event_id = actix_outbox::enqueue(tx, &event).await?;
            Ok::<_, StoreError>((inserted.id, event_id))
        })
        .await;
    match written {
        Ok((order_id, event_id)) => {
            metrics::counter!("orders_created_total").increment(1);
            HttpResponse::Created().json(serde_json::json!({ "order_id": order_id, "event_id": event_id }))
        }
        Err(e) => {
            tracing::error!(error = %e, "writing an order failed");
            HttpResponse::InternalServerError().json(serde_json::json!({ "error": one_line(&e) }))
        }
    }
}

/// `GET /metrics`.
async fn render_metrics(state: web::Data<AppState>) -> HttpResponse {
    state.metrics.run_upkeep();
    HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(state.metrics.render())
}

/// `GET /health/ready`: the database answers and the sink is up (and the dispatcher runs).
async fn ready(state: web::Data<AppState>, outbox: web::Data<Addr<OutboxSupervisor>>) -> HttpResponse {
    let check = async {
        let mut conn = state.pool.get().await.map_err(|e| format!("database unavailable: {e}"))?;
        conn.batch_execute("SELECT 1").await.map_err(|e| format!("database unavailable: {e}"))
    };
    match tokio::time::timeout(Duration::from_secs(2), check).await {
        Err(_) => return unavailable("database unavailable: no answer to SELECT 1 within 2s"),
        Ok(Err(why)) => return unavailable(why),
        Ok(Ok(())) => {}
    }
    if !outbox.connected() {
        return unavailable("the outbox dispatcher is not running");
    }
    match state.sink.state() {
        SinkState::Up => HttpResponse::Ok().content_type("text/plain; charset=utf-8").body("ready"),
        SinkState::Blocked(why) => unavailable(format!("sink blocked: {why}")),
        SinkState::Down(why) => unavailable(format!("sink down: {why}")),
        other => unavailable(format!("sink not ready: {other:?}")),
    }
}

/// `e` on one line.
fn one_line(e: &impl std::fmt::Display) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[allow(dead_code)] // the integration test includes this file and calls `start` itself
#[actix_web::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal, and not under NO_COLOR.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,actix_outbox=info,lapin=off".into()),
        )
        .init();
    let settings = Settings::from_env();
    let running = match start(&settings, true).await {
        Ok(running) => running,
        Err(e) => {
            eprintln!("actix_web example failed to start: {}", one_line(&e));
            return ExitCode::FAILURE;
        }
    };
    for addr in &running.addrs {
        eprintln!("listening on http://{addr} (Ctrl-C to stop)");
    }
    match running.run().await {
        Ok(()) => {
            eprintln!("stopped: HTTP server, then the dispatcher drained, then the sink closed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("HTTP server failed: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}
