//! # actix-outbox-console
//!
//! An operator console for [actix-outbox](actix_outbox) in the browser: the outbox's state at a
//! glance, its dead rows and the aggregates they block, one row with every column, and the
//! repairs of the command line (`dead retry`, `dead skip`) behind an operator token.
//!
//! It is an actix-web [scope](Console::scope) that an application mounts in its own
//! `HttpServer`; `actix-outbox run --console-addr HOST:PORT` serves the same pages. Everything is
//! rendered on the server: no JavaScript, and nothing loaded from outside the process (the
//! stylesheet is served by the console itself), so it works air-gapped.
//!
//! ```no_run
//! use actix_outbox_console::Console;
//! use actix_web::{App, HttpServer};
//! # #[actix_web::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = actix_outbox::connect_pool("postgres://root@127.0.0.1:5432/app", 4).await?;
//! // Built once, outside the server's factory: every worker shares its sessions and its chart.
//! let console = Console::new(pool).token(std::env::var("ACTIX_OUTBOX_CONSOLE_TOKEN")?);
//! HttpServer::new(move || App::new().service(console.scope("/outbox")))
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## Pages
//!
//! | path (under the scope) | what |
//! | --- | --- |
//! | `GET /` | overview: unfinished and dead rows, oldest unfinished age, expired leases, blocked aggregates, sink and database health, a chart of the last hour; refreshes itself |
//! | `GET /dead` | dead rows, filtered by event type, aggregate and error text, paged |
//! | `GET /rows/{id}` | one row, every column, payload and headers pretty-printed |
//! | `GET /blocked` | aggregates a dead head holds back under the FIFO gate |
//! | `GET /api/stats` | the JSON of `actix-outbox stats --json` ([`report::StatsReport`]) |
//! | `POST /dead/{id}/retry`, `POST /dead/{id}/skip` | repair one dead row (`skip` takes a form field `reason`) |
//! | `POST /dead/retry`, `POST /dead/skip` | repair a selection (`id` repeated), all or nothing |
//! | `GET`/`POST /login`, `POST /logout` | the operator's session |
//!
//! ## Security
//!
//! Reading needs no credentials; every change needs the operator token ([`Console::token`]),
//! either as `Authorization: Bearer <token>` (scripts) or through the login form, which sets an
//! `HttpOnly`, `SameSite=Strict` session cookie; a form sent with that cookie must also carry
//! the session's anti-CSRF token. Without a token the console is read-only and says so. Every
//! response carries a `Content-Security-Policy` that allows no script and nothing from another
//! origin, and every value from the table is HTML-escaped by the templates. Mount the scope
//! where only operators can reach it: the pages show payloads.
//!
//! The full description, with where each figure comes from: `docs/console.md`.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations, rust_2018_idioms)]

mod auth;
mod chart;
mod consoles;
mod handlers;
mod pages;
mod query;
pub mod repair;
pub mod report;

use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use actix::Addr;
use actix_outbox::{Fifo, OutboxSupervisor, PgPool};
use actix_web::dev::HttpServiceFactory;
use actix_web::middleware::DefaultHeaders;
use actix_web::web;

pub use consoles::Consoles;

/// The `Content-Security-Policy` of every response: no script at all, styles only from the
/// console's own stylesheet, forms only to the console's origin, and no framing (clickjacking
/// a repair button).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// How often the overview reloads itself.
const REFRESH: Duration = Duration::from_secs(15);
/// Dead rows a page of `/dead` shows.
const PAGE_SIZE: i64 = 50;

/// The console: built once, then mounted with [`Console::scope`] in every worker of an
/// `HttpServer`. Clones share the operator sessions and the chart's samples.
///
/// ```no_run
/// # async fn f(pool: actix_outbox::PgPool, dispatcher: actix::Addr<actix_outbox::OutboxSupervisor>) {
/// use actix_outbox::Fifo;
/// use actix_outbox_console::Console;
///
/// let console = Console::new(pool)
///     .token("a long random secret")     // without it: read-only
///     .supervisor(dispatcher)            // sink health and the per-minute chart
///     .fifo(Fifo::All)                   // the gate the dispatchers run with: /blocked
///     .source("billing".to_owned());     // which outbox this is, on the overview
/// # let _ = console;
/// # }
/// ```
#[derive(Clone)]
pub struct Console {
    config: Config,
    shared: Arc<Shared>,
}

/// What the builder sets.
#[derive(Clone)]
struct Config {
    pool: PgPool,
    token: Option<auth::Token>,
    supervisor: Option<Addr<OutboxSupervisor>>,
    fifo: Fifo,
    source: Option<String>,
}

/// What every worker's copy of the console shares.
struct Shared {
    sessions: Mutex<auth::Sessions>,
    chart: Mutex<chart::Samples>,
    sampler: Once,
}

impl std::fmt::Debug for Console {
    // The token (even its digest) and the pool's connection settings stay out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("read_only", &self.is_read_only())
            .field("supervisor", &self.config.supervisor.is_some())
            .field("fifo", &self.config.fifo)
            .field("source", &self.config.source)
            .finish_non_exhaustive()
    }
}

impl Console {
    /// A read-only console over the outbox table that `pool` reaches. Give it a pool of its
    /// own (two connections are plenty), so that a busy page never takes the dispatcher's.
    pub fn new(pool: PgPool) -> Self {
        Console {
            config: Config { pool, token: None, supervisor: None, fifo: Fifo::Off, source: None },
            shared: Arc::new(Shared {
                sessions: Mutex::new(auth::Sessions::default()),
                chart: Mutex::new(chart::Samples::default()),
                sampler: Once::new(),
            }),
        }
    }

    /// The operator token that every change requires (as `Authorization: Bearer <token>`, or
    /// typed into the login form). Surrounding whitespace is ignored; an empty token leaves
    /// the console read-only. Only its SHA-256 digest is kept, and it is compared in constant
    /// time. Use a long random one: it is the only key to the repairs.
    pub fn token(mut self, token: impl AsRef<str>) -> Self {
        self.config.token = auth::Token::new(token.as_ref());
        self
    }

    /// The dispatcher of this process: the overview then shows its `GetHealth` (sink, claiming,
    /// database as the dispatcher sees them), and the chart its published and failed counts per
    /// minute. Without it the overview says health is unknown and the chart shows the backlog
    /// and dead rows only.
    pub fn supervisor(mut self, supervisor: Addr<OutboxSupervisor>) -> Self {
        self.config.supervisor = Some(supervisor);
        self
    }

    /// The FIFO gate the dispatchers run with ([`DispatcherConfig::fifo`]); `/blocked` and the
    /// overview's blocked count need it, since a dead row blocks its aggregate only under a
    /// gate. Default [`Fifo::Off`]: nothing is shown as blocked.
    ///
    /// [`DispatcherConfig::fifo`]: actix_outbox::DispatcherConfig::fifo
    pub fn fifo(mut self, fifo: Fifo) -> Self {
        self.config.fifo = fifo;
        self
    }

    /// The outbox's source name (what its dispatchers put in `x-outbox-source`; see
    /// [`actix_outbox::admin::outbox_source`]), shown on every page when set: an operator with
    /// several consoles open knows which one a repair goes to.
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.config.source = Some(source.into());
        self
    }

    /// Whether changes are refused because no token was given.
    pub fn is_read_only(&self) -> bool {
        self.config.token.is_none()
    }

    /// The console's pages and forms under `path` (`"/outbox"`, or `""` for the root), for
    /// `App::service`. Call it in the `HttpServer` factory on a clone of one console.
    ///
    /// The first call inside a Tokio runtime (the factory runs in one) starts the chart's
    /// sampler, which reads the table once a minute for as long as a clone of the console lives.
    pub fn scope(&self, path: &str) -> impl HttpServiceFactory + 'static {
        self.start_sampler();
        routes(
            web::scope(path)
                .app_data(web::Data::new(consoles::Mount::One(Box::new(self.clone()))))
                .wrap(security_headers()),
        )
    }

    /// Starts the chart's sampler once, on the current Tokio runtime; without one (a console
    /// mounted by a test harness outside a runtime) the chart stays empty.
    pub(crate) fn start_sampler(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.shared.sampler.call_once(|| {
            tokio::spawn(chart::sample(self.config.clone(), Arc::downgrade(&self.shared)));
        });
    }
}

/// The headers of every response (see [`CONTENT_SECURITY_POLICY`]).
fn security_headers() -> DefaultHeaders {
    DefaultHeaders::new()
        .add(("Content-Security-Policy", CONTENT_SECURITY_POLICY))
        .add(("X-Content-Type-Options", "nosniff"))
        .add(("X-Frame-Options", "DENY"))
        .add(("Referrer-Policy", "no-referrer"))
        // Pages show payloads: no copy of them belongs in a shared cache.
        .add(("Cache-Control", "no-store"))
}

/// The list of outboxes of [`Consoles::scope`] and each one's console under `/{outbox}`, added to
/// `scope` (whose app data holds the [`Consoles`]).
fn list_routes<T>(scope: actix_web::Scope<T>) -> actix_web::Scope<T>
where
    T: actix_web::dev::ServiceFactory<
            actix_web::dev::ServiceRequest,
            Config = (),
            Response = actix_web::dev::ServiceResponse,
            Error = actix_web::Error,
            InitError = (),
        >,
{
    scope
        .route("", web::get().to(handlers::outboxes))
        .route("/", web::get().to(handlers::outboxes))
        .route("/console.css", web::get().to(handlers::stylesheet))
        .service(routes(web::scope("/{outbox}")))
}

/// The pages and forms of one outbox's console, added to `scope` (whose app data says which
/// console they serve: [`consoles::Mount`]).
fn routes<T>(scope: actix_web::Scope<T>) -> actix_web::Scope<T>
where
    T: actix_web::dev::ServiceFactory<
            actix_web::dev::ServiceRequest,
            Config = (),
            Response = actix_web::dev::ServiceResponse,
            Error = actix_web::Error,
            InitError = (),
        >,
{
    scope
        .route("", web::get().to(handlers::overview))
        .route("/", web::get().to(handlers::overview))
        .route("/console.css", web::get().to(handlers::stylesheet))
        .route("/api/stats", web::get().to(handlers::api_stats))
        .route("/dead", web::get().to(handlers::dead))
        .route("/dead/retry", web::post().to(handlers::retry_selected))
        .route("/dead/skip", web::post().to(handlers::skip_selected))
        .route("/dead/{id}/retry", web::post().to(handlers::retry_one))
        .route("/dead/{id}/skip", web::post().to(handlers::skip_one))
        .route("/rows/{id}", web::get().to(handlers::row))
        .route("/blocked", web::get().to(handlers::blocked))
        .route("/pace", web::post().to(handlers::set_pace))
        .route("/login", web::get().to(handlers::login_form))
        .route("/login", web::post().to(handlers::login))
        .route("/logout", web::post().to(handlers::logout))
}
