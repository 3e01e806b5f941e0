//! `run --metrics-addr HOST:PORT`: the dispatcher's HTTP face for scrapers and orchestrators.
//!
//! | path | answer |
//! | --- | --- |
//! | `GET /metrics` | every metric of the dispatcher, in the Prometheus text format |
//! | `GET /health/live` | 200 `ok` while the process runs |
//! | `GET /health/ready` | 200 `ready` when the database answers a `SELECT 1` through the dispatcher's pool within a second and the dispatcher sees the sink up with claiming running; else 503 with a one-line reason |
//!
//! The server starts before the dispatcher (readiness says 503 while `run` still waits for the
//! broker) and stops after it has drained (readiness says 503 from the first signal on). Its
//! workers run on threads of their own; the database probe runs on the dispatcher's arbiter, so
//! that the pool's connections all live on one runtime.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::{Addr, ArbiterHandle};
use actix_web::dev::ServerHandle;
use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, HttpServer, web};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing::info;

use crate::CliError;
use actix_outbox::dispatcher::GetHealth;
use actix_outbox::{OutboxSupervisor, PgPool};

/// How long the readiness probe waits for the database and for the dispatcher.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the recorder drains its histograms' buffers.
const UPKEEP_PERIOD: Duration = Duration::from_secs(5);

/// The dispatchers running, one an outbox; readiness is 503 until the first starts.
pub(crate) type SupervisorSlot = Arc<Mutex<Vec<Relayed>>>;

/// One outbox `run` relays: its name (when it relays several), its dispatcher and its pool.
#[derive(Clone)]
pub(crate) struct Relayed {
    pub(crate) name: Option<String>,
    pub(crate) supervisor: Addr<OutboxSupervisor>,
    pub(crate) pool: PgPool,
    /// Its source name.
    pub(crate) source: String,
}

/// Installs the Prometheus recorder as the process's `metrics` recorder.
pub(crate) fn install_recorder() -> Result<PrometheusHandle, CliError> {
    PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| CliError::Failed(format!("cannot install the metrics recorder: {e}")))
}

/// The running server.
pub(crate) struct Serving {
    server: ServerHandle,
    upkeep: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct State {
    metrics: PrometheusHandle,
    supervisor: SupervisorSlot,
    /// The dispatcher's arbiter, where the database probe runs.
    home: ArbiterHandle,
}

/// Binds `addr` and starts serving. Must run on the dispatcher's arbiter.
pub(crate) fn start(addr: &str, metrics: PrometheusHandle, supervisor: SupervisorSlot) -> Result<Serving, CliError> {
    let state = State { metrics: metrics.clone(), supervisor, home: actix::Arbiter::current() };
    let server = HttpServer::new(move || {
        App::new()
            .app_data(web::Data::new(state.clone()))
            .route("/metrics", web::get().to(render))
            .route("/health/live", web::get().to(|| async { HttpResponse::Ok().content_type("text/plain").body("ok") }))
            .route("/health/ready", web::get().to(ready))
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .bind(addr)
    .map_err(|e| CliError::Failed(format!("--metrics-addr {addr}: cannot listen: {e}")))?;
    let bound: Vec<SocketAddr> = server.addrs();
    let server = server.run();
    let handle = server.handle();
    actix::spawn(async move {
        let _ = server.await;
    });
    let upkeep = actix::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_PERIOD);
        loop {
            every.tick().await;
            metrics.run_upkeep();
        }
    });
    for addr in bound {
        info!(%addr, "serving /metrics, /health/live and /health/ready");
    }
    Ok(Serving { server: handle, upkeep })
}

impl Serving {
    /// Stops listening and waits for the answers under way.
    pub(crate) async fn stop(self) {
        self.upkeep.abort();
        self.server.stop(true).await;
    }
}

async fn render(state: web::Data<State>) -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(state.metrics.render())
}

async fn ready(state: web::Data<State>) -> HttpResponse {
    match not_ready(&state).await {
        None => HttpResponse::Ok().content_type("text/plain").body("ready"),
        Some(why) => HttpResponse::build(StatusCode::SERVICE_UNAVAILABLE).content_type("text/plain").body(why),
    }
}

/// Why the dispatcher is not ready; `None` when it is.
async fn not_ready(state: &State) -> Option<String> {
    let relayed = state.supervisor.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if relayed.is_empty() {
        return Some(
            "the dispatcher has not started yet (connecting to the broker, or no outbox found yet)".to_owned(),
        );
    }
    for outbox in relayed {
        if let Some(why) = outbox_not_ready(state, &outbox).await {
            return Some(match &outbox.name {
                Some(name) => format!("{name}: {why}"),
                None => why,
            });
        }
    }
    None
}

/// Why one outbox's dispatcher is not ready, if it is not.
async fn outbox_not_ready(state: &State, outbox: &Relayed) -> Option<String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let pool = outbox.pool.clone();
    // The check itself runs to its end, bounded by the pool's query timeout, which drops a
    // connection that misses it: cut short here, a silent connection would go back to the pool.
    state.home.spawn(async move {
        let _ = tx.send(actix_outbox::admin::check_connection(&pool).await);
    });
    match tokio::time::timeout(PROBE_TIMEOUT, rx).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Some(format!("the database does not answer: {}", crate::one_line(&e.to_string()))),
        Err(_) => return Some(format!("the database did not answer within {PROBE_TIMEOUT:?}")),
        Ok(Err(_)) => return Some("the dispatcher's arbiter is gone".to_owned()),
    }
    match tokio::time::timeout(PROBE_TIMEOUT, outbox.supervisor.send(GetHealth)).await {
        Ok(Ok(health)) => health.not_ready_reason(),
        Ok(Err(_)) => Some("the dispatcher has stopped".to_owned()),
        Err(_) => Some(format!("the dispatcher did not answer within {PROBE_TIMEOUT:?}")),
    }
}

/// The web console's server (`run --console-addr`).
pub(crate) struct ConsoleServing {
    server: ServerHandle,
    /// The list of outboxes it shows, when there are several.
    consoles: Option<actix_outbox_console::Consoles>,
}

/// What `--console-addr` serves: the console of the one outbox, or the list of several with
/// each one's console under it.
#[derive(Clone)]
pub(crate) enum ConsoleOf {
    One(Box<actix_outbox_console::Console>),
    /// `read_only`: no console of the list takes changes (no operator token).
    Many {
        consoles: actix_outbox_console::Consoles,
        read_only: bool,
    },
}

/// Binds `addr` and serves `console` at its root. Must run on the dispatcher's arbiter.
pub(crate) fn start_console(addr: &str, console: ConsoleOf) -> Result<ConsoleServing, CliError> {
    let read_only = match &console {
        ConsoleOf::One(console) => console.is_read_only(),
        ConsoleOf::Many { read_only, .. } => *read_only,
    };
    let consoles = match &console {
        ConsoleOf::Many { consoles, .. } => Some(consoles.clone()),
        ConsoleOf::One(_) => None,
    };
    let server = HttpServer::new(move || {
        App::new().configure(|app| match &console {
            ConsoleOf::One(console) => {
                app.service(console.scope(""));
            }
            ConsoleOf::Many { consoles, .. } => {
                app.service(consoles.scope(""));
            }
        })
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .bind(addr)
    .map_err(|e| CliError::Failed(format!("--console-addr {addr}: cannot listen: {e}")))?;
    let bound: Vec<SocketAddr> = server.addrs();
    let server = server.run();
    let handle = server.handle();
    actix::spawn(async move {
        let _ = server.await;
    });
    for addr in bound {
        if read_only {
            info!(%addr, "serving the web console, read-only (no --console-token-file or ACTIX_OUTBOX_CONSOLE_TOKEN)");
        } else {
            info!(%addr, "serving the web console; changes need the operator token");
        }
    }
    Ok(ConsoleServing { server: handle, consoles })
}

impl ConsoleServing {
    /// The list of outboxes it shows, when there are several: a dispatcher started or stopped
    /// later is added to it or removed.
    pub(crate) fn consoles(&self) -> Option<actix_outbox_console::Consoles> {
        self.consoles.clone()
    }

    /// Stops listening and waits for the answers under way.
    pub(crate) async fn stop(self) {
        self.server.stop(true).await;
    }
}
