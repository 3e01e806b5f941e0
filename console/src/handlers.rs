//! The routes of [`Console::scope`](crate::Console::scope).

use std::time::Duration;

use actix_outbox::dispatcher::{GetHealth, GetPace, SetMaxRate};
use actix_web::cookie::{Cookie, SameSite};
use actix_web::http::{StatusCode, header};
use actix_web::{HttpRequest, HttpResponse, web};
use chrono::Utc;
use maud::Markup;
use serde::Deserialize;

use crate::auth::{self, Denied, Via};
use crate::consoles::{Mount, Mounted};
use crate::pages::{self, View};
use crate::query::{self, DeadFilter};
use crate::repair::{self, Repair, RepairError};
use crate::report::{BlockedView, StatsReport};
use crate::{Console, PAGE_SIZE, REFRESH, chart};

/// The console a request is for (and the picker of the others, when it is one of several).
type Data = Mounted;

/// How long the overview waits for the dispatcher's health.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);
/// Blocked aggregates `/blocked` lists.
const BLOCKED_LISTED: i64 = 100;

/// Where the console is mounted: the request's path less the `depth` segments of the route
/// that matched inside the scope. Derived from the request rather than remembered from
/// [`Console::scope`], so that links stay right when the scope is nested in another one.
fn base(req: &HttpRequest, depth: usize) -> String {
    let mut path = req.path().trim_end_matches('/');
    for _ in 0..depth {
        path = path.rsplit_once('/').map_or("", |(head, _)| head);
    }
    path.to_owned()
}

fn html(status: StatusCode, page: Markup) -> HttpResponse {
    HttpResponse::build(status).content_type("text/html; charset=utf-8").body(page.into_string())
}

fn json(status: StatusCode, value: &impl serde::Serialize) -> HttpResponse {
    HttpResponse::build(status).content_type("application/json").body(serde_json::to_string(value).unwrap_or_default())
}

/// An error on one line (a page shows it in a sentence).
fn one_line(e: impl std::fmt::Display) -> String {
    e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The CSRF token of the request's operator session, if the console takes changes at all.
fn session(req: &HttpRequest, console: &Console) -> Option<String> {
    if console.is_read_only() {
        return None;
    }
    auth::session_csrf(req, &console.shared.sessions)
}

fn view<'a>(console: &'a Mounted, base: &'a str, csrf: Option<&'a str>) -> View<'a> {
    View {
        base,
        source: console.config.source.as_deref(),
        read_only: console.is_read_only(),
        csrf,
        picker: console.picker.as_ref(),
    }
}

pub(crate) async fn stylesheet() -> HttpResponse {
    HttpResponse::Ok().content_type("text/css; charset=utf-8").body(include_str!("console.css"))
}

pub(crate) async fn overview(req: HttpRequest, console: Data) -> HttpResponse {
    let base = base(&req, 0);
    let csrf = session(&req, &console);
    let fifo = console.config.fifo.clone();
    // Each read within the pool's query timeout: a database that does not answer shows as such
    // rather than holding the page.
    let pool = &console.config.pool;
    let table = pool.run(async |conn| query::overview(conn).await).await.map_err(one_line);
    let blocked = if fifo.is_on() {
        Some(
            pool.run(async |conn| actix_outbox::admin::blocked_aggregates_count(conn, &fifo).await)
                .await
                .map_err(one_line),
        )
    } else {
        None
    };
    let health = match &console.config.supervisor {
        None => None,
        Some(supervisor) => Some(match tokio::time::timeout(HEALTH_TIMEOUT, supervisor.send(GetHealth)).await {
            Ok(Ok(health)) => Ok(health),
            Ok(Err(_)) => Err("the dispatcher has stopped".to_owned()),
            Err(_) => Err(format!("no answer within {HEALTH_TIMEOUT:?}")),
        }),
    };
    let pace = match &console.config.supervisor {
        None => None,
        Some(supervisor) => Some(match tokio::time::timeout(HEALTH_TIMEOUT, supervisor.send(GetPace)).await {
            Ok(Ok(pace)) => Ok(pace),
            Ok(Err(_)) => Err("the dispatcher has stopped".to_owned()),
            Err(_) => Err(format!("no answer within {HEALTH_TIMEOUT:?}")),
        }),
    };
    let points = console.shared.chart.lock().unwrap_or_else(|e| e.into_inner()).points();
    let data = pages::OverviewData { table, blocked, fifo, health, pace, chart: chart::svg(&points, Utc::now()) };
    html(StatusCode::OK, pages::overview(&view(&console, &base, csrf.as_deref()), &data, REFRESH.as_secs()))
}

/// `GET /` of [`Consoles::scope`](crate::Consoles::scope): every outbox with its figures.
pub(crate) async fn outboxes(req: HttpRequest, mount: web::Data<Mount>) -> HttpResponse {
    let base = base(&req, 0);
    let Mount::Many(consoles) = mount.get_ref() else {
        return HttpResponse::NotFound().finish();
    };
    let mut lines = Vec::new();
    for (name, slug, console) in consoles.all() {
        let table = console.config.pool.run(async |conn| query::overview(conn).await).await.map_err(one_line);
        lines.push(pages::OutboxLine { name, slug, source: console.config.source.clone(), table });
    }
    let picker = consoles.picker();
    let v = View { base: &base, source: None, read_only: true, csrf: None, picker: Some(&picker) };
    html(StatusCode::OK, pages::outboxes(&v, &lines, REFRESH.as_secs()))
}

pub(crate) async fn api_stats(console: Data) -> HttpResponse {
    let fifo = &console.config.fifo;
    let report = console.config.pool.run(async |conn| StatsReport::read(conn, fifo).await);
    match report.await.map_err(one_line) {
        Ok(report) => json(StatusCode::OK, &report),
        Err(e) => json(StatusCode::SERVICE_UNAVAILABLE, &serde_json::json!({ "error": e })),
    }
}

/// The `{id}` of a route: by name, since a [`Consoles`](crate::Consoles) scope adds an
/// `{outbox}` before it.
#[derive(Debug, Deserialize)]
pub(crate) struct RowId {
    id: i64,
}

/// The query string of `/dead`.
#[derive(Debug, Deserialize)]
pub(crate) struct DeadQuery {
    #[serde(default)]
    event_type: String,
    #[serde(default)]
    aggregate: String,
    #[serde(default)]
    error: String,
    after: Option<i64>,
}

/// A page saying the database could not be read.
fn unavailable(v: &View<'_>, e: String) -> HttpResponse {
    html(StatusCode::SERVICE_UNAVAILABLE, pages::outcome(v, "Database unavailable", &e, false))
}

pub(crate) async fn dead(req: HttpRequest, console: Data, q: web::Query<DeadQuery>) -> HttpResponse {
    let base = base(&req, 1);
    let csrf = session(&req, &console);
    let v = view(&console, &base, csrf.as_deref());
    let q = q.into_inner();
    let filter = DeadFilter { event_type: q.event_type, aggregate: q.aggregate, error: q.error };
    let page = console.config.pool.run(async |conn| query::dead_page(conn, &filter, q.after, PAGE_SIZE).await);
    match page.await.map_err(one_line) {
        Ok(page) => html(StatusCode::OK, pages::dead(&v, &filter, q.after, &page, Utc::now())),
        Err(e) => unavailable(&v, e),
    }
}

pub(crate) async fn row(req: HttpRequest, console: Data, id: web::Path<RowId>) -> HttpResponse {
    let base = base(&req, 2);
    let csrf = session(&req, &console);
    let v = view(&console, &base, csrf.as_deref());
    let id = id.id;
    let row = console.config.pool.run(async |conn| query::row(conn, id).await);
    match row.await.map_err(one_line) {
        Ok(Some(row)) => html(StatusCode::OK, pages::row(&v, &row)),
        Ok(None) => {
            html(StatusCode::NOT_FOUND, pages::outcome(&v, "No such row", &format!("no row has id {id}"), false))
        }
        Err(e) => unavailable(&v, e),
    }
}

pub(crate) async fn blocked(req: HttpRequest, console: Data) -> HttpResponse {
    let base = base(&req, 1);
    let csrf = session(&req, &console);
    let v = view(&console, &base, csrf.as_deref());
    let fifo = &console.config.fifo;
    if !fifo.is_on() {
        return html(StatusCode::OK, pages::blocked(&v, fifo, None));
    }
    let blocked = console.config.pool.run(async |conn| BlockedView::read(conn, fifo, BLOCKED_LISTED).await);
    match blocked.await.map_err(one_line) {
        Ok(view) => html(StatusCode::OK, pages::blocked(&v, fifo, Some(&view))),
        Err(e) => unavailable(&v, e),
    }
}

/// A form body: `application/x-www-form-urlencoded` pairs, a name possibly repeated (`id`).
struct Form(Vec<(String, String)>);

impl Form {
    fn parse(body: &[u8]) -> Self {
        Form(form_urlencoded::parse(body).into_owned().collect())
    }

    fn field(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn all(&self, name: &str) -> impl Iterator<Item = &str> {
        self.0.iter().filter(move |(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// The answer to a refused change. Nothing was changed.
fn refuse(req: &HttpRequest, console: &Mounted, base: &str, denied: Denied) -> HttpResponse {
    let mut response = if auth::wants_json(req) {
        json(denied.status(), &serde_json::json!({ "error": denied.message() }))
    } else {
        html(denied.status(), pages::outcome(&view(console, base, None), "Not changed", denied.message(), false))
    };
    if denied == Denied::Unauthenticated {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer realm=\"outbox console\""));
    }
    response
}

/// Who is answered, once a change was allowed: JSON for a script, a page for the browser.
struct Reply<'a> {
    via: Via,
    console: &'a Mounted,
    base: &'a str,
    csrf: Option<&'a str>,
}

impl Reply<'_> {
    /// `{key: ids}` or a page saying `message` on success; `{"error": message}` or a page otherwise.
    fn send(&self, status: StatusCode, key: &str, message: &str, ids: &[i64]) -> HttpResponse {
        match self.via {
            Via::Bearer if status.is_success() => json(status, &serde_json::json!({ key: ids })),
            Via::Bearer => json(status, &serde_json::json!({ "error": message })),
            Via::Session => {
                let title = if status.is_success() { "Done" } else { "Not changed" };
                let v = view(self.console, self.base, self.csrf);
                html(status, pages::outcome(&v, title, message, status.is_success()))
            }
        }
    }
}

/// Which repair a route makes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Retry,
    Skip,
}

/// Checks the credentials, then the input, then repairs all of `ids` or none.
async fn repair(
    req: HttpRequest,
    console: Data,
    body: web::Bytes,
    ids: Option<i64>,
    kind: Kind,
    depth: usize,
) -> HttpResponse {
    let base = base(&req, depth);
    let form = Form::parse(&body);
    // Credentials before anything else: a refused request learns nothing about the rows.
    let via = match auth::authorize(&req, console.config.token.as_ref(), &console.shared.sessions, form.field("csrf")) {
        Ok(via) => via,
        Err(denied) => return refuse(&req, &console, &base, denied),
    };
    let csrf = session(&req, &console);
    let reply = Reply { via, console: &console, base: &base, csrf: csrf.as_deref() };
    let bad = |message: &str| reply.send(StatusCode::BAD_REQUEST, "", message, &[]);
    let ids: Vec<i64> = match ids {
        Some(id) => vec![id],
        None => match form.all("id").map(|s| s.trim().parse::<i64>()).collect::<Result<Vec<_>, _>>() {
            Ok(ids) if !ids.is_empty() => ids,
            Ok(_) => return bad("select at least one dead row"),
            Err(_) => return bad("an id is not a number"),
        },
    };
    let reason = form.field("reason").unwrap_or("").trim();
    let repair = match kind {
        Kind::Retry => Repair::Retry,
        Kind::Skip if reason.is_empty() => return bad("a skip needs a reason: say why the rows are given up"),
        Kind::Skip => Repair::Skip { reason },
    };
    let outcome = console.config.pool.run(async |conn| repair::all_or_nothing(conn, &ids, repair).await);
    let (key, done) = match kind {
        Kind::Retry => ("retried", "(now pending, attempts reset)"),
        Kind::Skip => ("skipped", "(now done, the reason recorded in last_error)"),
    };
    match outcome.await {
        Ok(changed) => {
            tracing::info!(ids = %repair::id_list(&changed), via = ?via, "console: {key} dead rows");
            let rows =
                if changed.len() == 1 { "1 dead row".to_owned() } else { format!("{} dead rows", changed.len()) };
            let message = format!("{key} {rows} {done}: {}", repair::id_list(&changed));
            reply.send(StatusCode::OK, key, &message, &changed)
        }
        Err(e @ RepairError::NotDead(_)) => reply.send(StatusCode::CONFLICT, key, &e.to_string(), &[]),
        Err(e) => reply.send(StatusCode::SERVICE_UNAVAILABLE, key, &one_line(e), &[]),
    }
}

pub(crate) async fn retry_one(req: HttpRequest, console: Data, id: web::Path<RowId>, body: web::Bytes) -> HttpResponse {
    repair(req, console, body, Some(id.id), Kind::Retry, 3).await
}

pub(crate) async fn skip_one(req: HttpRequest, console: Data, id: web::Path<RowId>, body: web::Bytes) -> HttpResponse {
    repair(req, console, body, Some(id.id), Kind::Skip, 3).await
}

pub(crate) async fn retry_selected(req: HttpRequest, console: Data, body: web::Bytes) -> HttpResponse {
    repair(req, console, body, None, Kind::Retry, 2).await
}

pub(crate) async fn skip_selected(req: HttpRequest, console: Data, body: web::Bytes) -> HttpResponse {
    repair(req, console, body, None, Kind::Skip, 2).await
}

/// `POST /pace`: sets the dispatcher's cap on messages a second (`max_rate`, a number above
/// zero; empty: not paced). A script gets `{"max_rate": n}` (`null`: not paced).
pub(crate) async fn set_pace(req: HttpRequest, console: Data, body: web::Bytes) -> HttpResponse {
    let base = base(&req, 1);
    let form = Form::parse(&body);
    let via = match auth::authorize(&req, console.config.token.as_ref(), &console.shared.sessions, form.field("csrf")) {
        Ok(via) => via,
        Err(denied) => return refuse(&req, &console, &base, denied),
    };
    let csrf = session(&req, &console);
    let v = view(&console, &base, csrf.as_deref());
    let answer = |status: StatusCode, result: Result<Option<f64>, String>| match (via, result) {
        (Via::Bearer, Ok(rate)) => json(status, &serde_json::json!({ "max_rate": rate })),
        (Via::Bearer, Err(e)) => json(status, &serde_json::json!({ "error": e })),
        (Via::Session, Ok(rate)) => {
            let message = match rate {
                Some(rate) => format!("the dispatcher publishes at most {rate} messages a second"),
                None => "the dispatcher is not paced".to_owned(),
            };
            html(status, pages::outcome(&v, "Done", &message, true))
        }
        (Via::Session, Err(e)) => html(status, pages::outcome(&v, "Not changed", &e, false)),
    };
    let Some(supervisor) = &console.config.supervisor else {
        return answer(StatusCode::CONFLICT, Err("no dispatcher is attached to this console".into()));
    };
    let rate = match form.field("max_rate").map(str::trim).unwrap_or("") {
        "" => None,
        text => match text.parse::<f64>() {
            Ok(rate) => Some(rate),
            Err(_) => return answer(StatusCode::BAD_REQUEST, Err(format!("max_rate {text:?} is not a number"))),
        },
    };
    match tokio::time::timeout(HEALTH_TIMEOUT, supervisor.send(SetMaxRate(rate))).await {
        Ok(Ok(Ok(()))) => {
            tracing::info!(max_rate = ?rate, via = ?via, "console: max rate set");
            answer(StatusCode::OK, Ok(rate))
        }
        Ok(Ok(Err(e))) => answer(StatusCode::BAD_REQUEST, Err(e.to_string())),
        Ok(Err(_)) => answer(StatusCode::SERVICE_UNAVAILABLE, Err("the dispatcher has stopped".into())),
        Err(_) => answer(StatusCode::SERVICE_UNAVAILABLE, Err(format!("no answer within {HEALTH_TIMEOUT:?}"))),
    }
}

pub(crate) async fn login_form(req: HttpRequest, console: Data) -> HttpResponse {
    let base = base(&req, 1);
    let csrf = session(&req, &console);
    html(StatusCode::OK, pages::login(&view(&console, &base, csrf.as_deref()), None))
}

/// The session cookie's `Path`: the console's pages, and nothing else of the application.
fn cookie_path(base: &str) -> String {
    if base.is_empty() { "/".to_owned() } else { base.to_owned() }
}

pub(crate) async fn login(req: HttpRequest, console: Data, body: web::Bytes) -> HttpResponse {
    let base = base(&req, 1);
    let Some(token) = &console.config.token else {
        return html(StatusCode::FORBIDDEN, pages::login(&view(&console, &base, None), None));
    };
    let form = Form::parse(&body);
    if !token.matches(form.field("token").unwrap_or("")) {
        let page = pages::login(&view(&console, &base, None), Some("That is not the operator token."));
        return html(StatusCode::UNAUTHORIZED, page);
    }
    let (id, _csrf) = console.shared.sessions.lock().unwrap_or_else(|e| e.into_inner()).open();
    let cookie = Cookie::build(auth::SESSION_COOKIE, id)
        .path(cookie_path(&base))
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(req.connection_info().scheme() == "https")
        .finish();
    tracing::info!("console: an operator logged in");
    HttpResponse::SeeOther().insert_header((header::LOCATION, format!("{base}/"))).cookie(cookie).finish()
}

pub(crate) async fn logout(req: HttpRequest, console: Data, body: web::Bytes) -> HttpResponse {
    let base = base(&req, 1);
    let form = Form::parse(&body);
    if auth::authorize(&req, console.config.token.as_ref(), &console.shared.sessions, form.field("csrf"))
        == Ok(Via::Session)
        && let Some(cookie) = req.cookie(auth::SESSION_COOKIE)
    {
        console.shared.sessions.lock().unwrap_or_else(|e| e.into_inner()).close(cookie.value());
    }
    let mut gone = Cookie::build(auth::SESSION_COOKIE, "")
        .path(cookie_path(&base))
        .http_only(true)
        .same_site(SameSite::Strict)
        .finish();
    gone.make_removal();
    HttpResponse::SeeOther().insert_header((header::LOCATION, format!("{base}/"))).cookie(gone).finish()
}
