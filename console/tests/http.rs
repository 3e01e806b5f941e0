//! The console over HTTP, with actix-web's test service and the real PostgreSQL: what each
//! page shows, and what the door lets through (token, session, CSRF, read-only), with the
//! table read back after every refused change.

mod support;

use actix_outbox::Fifo;
use actix_outbox_console::report::StatsReport;
use actix_outbox_console::{CONTENT_SECURITY_POLICY, Console, Consoles};
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::{StatusCode, header};
use actix_web::{App, test};
use support::{HOSTILE, TestDb};

const TOKEN: &str = "operator-token-for-tests-0123456789";

async fn service(
    console: Console,
) -> impl Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error> {
    test::init_service(App::new().service(console.scope("/outbox"))).await
}

async fn body(resp: ServiceResponse) -> String {
    String::from_utf8(test::read_body(resp).await.to_vec()).unwrap()
}

/// The value of `name="csrf"` in a page.
fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("the page has a CSRF field") + "name=\"csrf\" value=\"".len();
    page[at..at + 64].to_owned()
}

/// Logs in through the form; returns the session cookie (`name=value`) and the CSRF token.
async fn login(
    app: &impl Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error>,
) -> (String, String) {
    let req = test::TestRequest::post()
        .uri("/outbox/login")
        .insert_header((header::CONTENT_TYPE, "application/x-www-form-urlencoded"))
        .set_payload(format!("token={TOKEN}"))
        .to_request();
    let resp = test::call_service(app, req).await;
    assert_eq!(resp.status(), StatusCode::SEE_OTHER);
    assert_eq!(resp.headers().get(header::LOCATION).unwrap(), "/outbox/");
    let set_cookie = resp.headers().get(header::SET_COOKIE).unwrap().to_str().unwrap().to_owned();
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    let req = test::TestRequest::get().uri("/outbox/dead").insert_header((header::COOKIE, cookie.clone())).to_request();
    let page = body(test::call_service(app, req).await).await;
    (cookie, csrf_of(&page))
}

fn form_post(uri: &str, form: &str) -> test::TestRequest {
    test::TestRequest::post()
        .uri(uri)
        .insert_header((header::CONTENT_TYPE, "application/x-www-form-urlencoded"))
        .set_payload(form.to_owned())
}

#[actix_web::test]
async fn the_overview_counts_unfinished_and_dead_rows_and_carries_the_security_headers() {
    let db = TestDb::new().await;
    for _ in 0..3 {
        db.insert("pending", "1", "order.created", None).await;
    }
    db.insert("processing", "2", "order.created", None).await;
    for _ in 0..2 {
        db.insert("dead", "3", "order.paid", Some("boom")).await;
    }
    db.insert("done", "4", "order.created", None).await;
    let app = service(Console::new(db.pool.clone()).source("billing".to_owned())).await;

    let resp = test::call_service(&app, test::TestRequest::get().uri("/outbox/").to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let headers = resp.headers();
    assert_eq!(headers.get("content-security-policy").unwrap(), CONTENT_SECURITY_POLICY);
    assert_eq!(headers.get("x-content-type-options").unwrap(), "nosniff");
    assert_eq!(headers.get("x-frame-options").unwrap(), "DENY");
    assert_eq!(headers.get("cache-control").unwrap(), "no-store");
    assert_eq!(headers.get(header::CONTENT_TYPE).unwrap(), "text/html; charset=utf-8");
    let page = body(resp).await;
    assert!(page.contains(r#"<div class="value" id="count-pending">3</div>"#), "{page}");
    assert!(page.contains(r#"<div class="value" id="count-processing">1</div>"#), "{page}");
    assert!(page.contains(r#"<a class="value" id="count-dead" href="/outbox/dead">2</a>"#), "{page}");
    assert!(page.contains(r#"<div class="value" id="count-blocked">FIFO off</div>"#), "{page}");
    assert!(page.contains(r#"<div class="value" id="expired-leases">0</div>"#), "{page}");
    assert!(page.contains(r#"<td id="overview-source">billing</td>"#), "{page}");
    assert!(page.contains("unknown: no dispatcher attached to this console"), "{page}");
    assert!(page.contains(r#"<meta http-equiv="refresh" content="15">"#), "{page}");
    assert!(page.contains(r#"id="read-only">read-only: no operator token configured"#), "{page}");
    // No script of any kind: the CSP would refuse it, and the console needs none.
    assert!(!page.contains("<script"), "{page}");

    // The stylesheet is the console's own, and the scope answers without the trailing slash too.
    let resp = test::call_service(&app, test::TestRequest::get().uri("/outbox/console.css").to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers().get(header::CONTENT_TYPE).unwrap(), "text/css; charset=utf-8");
    let resp = test::call_service(&app, test::TestRequest::get().uri("/outbox").to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
}

#[actix_web::test]
async fn api_stats_is_the_stats_report_of_the_command_line() {
    let db = TestDb::new().await;
    db.insert("pending", "1", "order.created", None).await;
    let head = db.insert("dead", "2", "order.created", Some("boom")).await;
    db.insert("pending", "2", "order.paid", None).await;
    db.insert("done", "3", "order.created", None).await;
    let fifo = Fifo::All;
    let app = service(Console::new(db.pool.clone()).fifo(fifo.clone())).await;

    let resp = test::call_service(&app, test::TestRequest::get().uri("/outbox/api/stats").to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers().get(header::CONTENT_TYPE).unwrap(), "application/json");
    let served: serde_json::Value = serde_json::from_str(&body(resp).await).unwrap();
    let mut conn = db.conn().await;
    let mut expected = serde_json::to_value(StatsReport::read(&mut conn, &fifo).await.unwrap()).unwrap();
    // The age grows between the two reads; everything else must be equal.
    let age = served["oldest_unfinished_age_s"].as_f64().unwrap();
    assert!(age >= 0.0);
    expected["oldest_unfinished_age_s"] = served["oldest_unfinished_age_s"].clone();
    assert_eq!(served, expected);
    assert_eq!(served["by_status"], serde_json::json!({"pending": 2, "processing": 0, "done": 1, "dead": 1}));
    assert_eq!(served["blocked_aggregates_total"], 1);
    assert_eq!(served["blocked_aggregates"][0]["dead_id"], head);
    assert_eq!(served["blocked_aggregates"][0]["waiting"], 1);
}

#[actix_web::test]
async fn a_change_without_credentials_is_refused_and_changes_nothing() {
    let db = TestDb::new().await;
    let dead = db.insert("dead", "1", "order.created", Some("boom")).await;
    let app = service(Console::new(db.pool.clone()).token(TOKEN)).await;

    let cases: Vec<(test::TestRequest, StatusCode)> = vec![
        (form_post(&format!("/outbox/dead/{dead}/retry"), ""), StatusCode::UNAUTHORIZED),
        (form_post(&format!("/outbox/dead/{dead}/skip"), "reason=x"), StatusCode::UNAUTHORIZED),
        (form_post("/outbox/dead/retry", &format!("id={dead}")), StatusCode::UNAUTHORIZED),
        (form_post("/outbox/dead/skip", &format!("id={dead}&reason=x")), StatusCode::UNAUTHORIZED),
        (
            form_post(&format!("/outbox/dead/{dead}/retry"), "")
                .insert_header((header::AUTHORIZATION, "Bearer operator-token-for-tests-012345678")),
            StatusCode::UNAUTHORIZED,
        ),
        (
            form_post(&format!("/outbox/dead/{dead}/retry"), "").insert_header((header::AUTHORIZATION, TOKEN)),
            StatusCode::UNAUTHORIZED,
        ),
        (
            form_post(&format!("/outbox/dead/{dead}/retry"), "")
                .insert_header((header::COOKIE, "outbox_console_session=forged")),
            StatusCode::UNAUTHORIZED,
        ),
    ];
    for (i, (req, status)) in cases.into_iter().enumerate() {
        let resp = test::call_service(&app, req.to_request()).await;
        assert_eq!(resp.status(), status, "case {i}");
        assert_eq!(
            resp.headers().get(header::WWW_AUTHENTICATE).unwrap(),
            "Bearer realm=\"outbox console\"",
            "case {i}"
        );
        assert_eq!(db.state(dead).await, ("dead".to_owned(), 12, Some("boom".to_owned())), "case {i}");
    }

    // A wrong token typed into the login form opens no session.
    let resp = test::call_service(&app, form_post("/outbox/login", "token=guess").to_request()).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert!(resp.headers().get(header::SET_COOKIE).is_none());

    // The right bearer token goes through, answered in JSON.
    let req = form_post(&format!("/outbox/dead/{dead}/retry"), "")
        .insert_header((header::AUTHORIZATION, format!("Bearer {TOKEN}")))
        .to_request();
    let resp = test::call_service(&app, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(body(resp).await, format!("{{\"retried\":[{dead}]}}"));
    assert_eq!(db.state(dead).await, ("pending".to_owned(), 0, Some("boom".to_owned())));
}

#[actix_web::test]
async fn a_session_form_needs_its_csrf_token() {
    let db = TestDb::new().await;
    let dead = db.insert("dead", "1", "order.created", Some("boom")).await;
    let app = service(Console::new(db.pool.clone()).token(TOKEN)).await;

    let req = form_post("/outbox/login", &format!("token={TOKEN}")).to_request();
    let resp = test::call_service(&app, req).await;
    let set_cookie = resp.headers().get(header::SET_COOKIE).unwrap().to_str().unwrap().to_owned();
    assert!(set_cookie.starts_with("outbox_console_session="), "{set_cookie}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/outbox"] {
        assert!(set_cookie.split("; ").any(|a| a == attribute), "{attribute} missing: {set_cookie}");
    }
    let (cookie, csrf) = login(&app).await;
    let other_session_csrf = login(&app).await.1;

    for (form, what) in [
        (String::new(), "no CSRF token"),
        ("csrf=0000".to_owned(), "a wrong CSRF token"),
        (format!("csrf={other_session_csrf}"), "another session's CSRF token"),
    ] {
        let req =
            form_post(&format!("/outbox/dead/{dead}/retry"), &form).insert_header((header::COOKIE, cookie.clone()));
        let resp = test::call_service(&app, req.to_request()).await;
        assert_eq!(resp.status(), StatusCode::FORBIDDEN, "{what}");
        assert_eq!(db.state(dead).await.0, "dead", "{what}");
    }

    let req = form_post(&format!("/outbox/dead/{dead}/skip"), &format!("csrf={csrf}&reason=+cancelled+by+hand+"))
        .insert_header((header::COOKIE, cookie.clone()));
    let resp = test::call_service(&app, req.to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let page = body(resp).await;
    assert!(
        page.contains(&format!("skipped 1 dead row (now done, the reason recorded in last_error): {dead}")),
        "{page}"
    );
    assert_eq!(
        db.state(dead).await,
        ("done".to_owned(), 12, Some("skipped by operator: cancelled by hand (was: boom)".to_owned()))
    );

    // Logging out ends the session: its cookie and CSRF token change nothing any more.
    let again = db.insert("dead", "2", "order.created", Some("boom")).await;
    let req = form_post("/outbox/logout", &format!("csrf={csrf}")).insert_header((header::COOKIE, cookie.clone()));
    assert_eq!(test::call_service(&app, req.to_request()).await.status(), StatusCode::SEE_OTHER);
    let req = form_post(&format!("/outbox/dead/{again}/retry"), &format!("csrf={csrf}"))
        .insert_header((header::COOKIE, cookie.clone()));
    assert_eq!(test::call_service(&app, req.to_request()).await.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(db.state(again).await.0, "dead");
}

#[actix_web::test]
async fn without_a_token_the_console_is_read_only() {
    let db = TestDb::new().await;
    let dead = db.insert("dead", "1", "order.created", Some("boom")).await;
    let app = service(Console::new(db.pool.clone()).token("  ")).await;

    for req in [
        form_post(&format!("/outbox/dead/{dead}/retry"), "").insert_header((header::AUTHORIZATION, "Bearer  ")),
        form_post(&format!("/outbox/dead/{dead}/retry"), ""),
        form_post("/outbox/login", "token="),
    ] {
        let resp = test::call_service(&app, req.to_request()).await;
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        assert_eq!(db.state(dead).await.0, "dead");
    }
    let page = body(test::call_service(&app, test::TestRequest::get().uri("/outbox/dead").to_request()).await).await;
    assert!(page.contains("read-only: no operator token configured"), "{page}");
    assert!(!page.contains("name=\"csrf\""), "{page}");
}

#[actix_web::test]
async fn batch_repairs_are_all_or_nothing() {
    let db = TestDb::new().await;
    let a = db.insert("dead", "1", "order.created", Some("boom")).await;
    let b = db.insert("dead", "2", "order.created", Some("boom")).await;
    let pending = db.insert("pending", "3", "order.created", None).await;
    let app = service(Console::new(db.pool.clone()).token(TOKEN)).await;
    let bearer = (header::AUTHORIZATION, format!("Bearer {TOKEN}"));

    let req = form_post("/outbox/dead/retry", &format!("id={a}&id={pending}&id={b}")).insert_header(bearer.clone());
    let resp = test::call_service(&app, req.to_request()).await;
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    assert_eq!(body(resp).await, format!("{{\"error\":\"not a dead row: {pending} (no row changed)\"}}"));
    assert_eq!((db.state(a).await.0, db.state(b).await.0), ("dead".to_owned(), "dead".to_owned()));

    let req = form_post("/outbox/dead/skip", &format!("id={a}&id={b}&reason=")).insert_header(bearer.clone());
    let resp = test::call_service(&app, req.to_request()).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(db.state(a).await.0, "dead");

    let req = form_post("/outbox/dead/retry", "id=x").insert_header(bearer.clone());
    assert_eq!(test::call_service(&app, req.to_request()).await.status(), StatusCode::BAD_REQUEST);
    let req = form_post("/outbox/dead/retry", "").insert_header(bearer.clone());
    assert_eq!(test::call_service(&app, req.to_request()).await.status(), StatusCode::BAD_REQUEST);

    let req = form_post("/outbox/dead/retry", &format!("id={b}&id={a}&id={a}")).insert_header(bearer.clone());
    let resp = test::call_service(&app, req.to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(body(resp).await, format!("{{\"retried\":[{a},{b}]}}"));
    assert_eq!((db.state(a).await.0, db.state(b).await.0), ("pending".to_owned(), "pending".to_owned()));
}

#[actix_web::test]
async fn table_values_are_escaped_on_every_page() {
    let db = TestDb::new().await;
    let dead = db.insert("dead", HOSTILE, "order.created", Some("<img src=x onerror=alert(1)>")).await;
    let fifo = Fifo::All;
    let app = service(Console::new(db.pool.clone()).token(TOKEN).fifo(fifo)).await;
    let (cookie, _) = login(&app).await;
    let escaped = "&lt;script&gt;document.title='pwned'&lt;/script&gt;&lt;b id=&quot;pwned&quot;&gt;&quot;quoted&quot; 'single' &amp; ünïcødé ✓ 注文&lt;/b&gt;";
    for uri in ["/outbox/dead".to_owned(), format!("/outbox/rows/{dead}"), "/outbox/blocked".to_owned()] {
        let req = test::TestRequest::get().uri(&uri).insert_header((header::COOKIE, cookie.clone()));
        let page = body(test::call_service(&app, req.to_request()).await).await;
        assert!(!page.contains("<script"), "{uri}: {page}");
        assert!(!page.contains("<b id=\"pwned\""), "{uri}: {page}");
        assert!(!page.contains("<img"), "{uri}: {page}");
        assert!(page.contains(escaped), "{uri}: {page}");
        assert!(page.contains("&lt;img src=x onerror=alert(1)&gt;"), "{uri}: {page}");
    }
    // The payload is pretty-printed JSON, escaped as well.
    let page = body(
        test::call_service(&app, test::TestRequest::get().uri(&format!("/outbox/rows/{dead}")).to_request()).await,
    )
    .await;
    let json = serde_json::to_string(HOSTILE).unwrap();
    let json = json.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
    assert!(page.contains("<pre id=\"payload\">{\n  &quot;"), "{page}");
    assert!(page.contains(&format!("\n  &quot;aggregate&quot;: {json}")), "{page}");
    assert!(page.contains("<pre id=\"headers\">{\n  &quot;x-tenant&quot;: &quot;acme&quot;\n}</pre>"), "{page}");
}

#[actix_web::test]
async fn the_dead_list_filters_and_pages() {
    let db = TestDb::new().await;
    let mut ids = Vec::new();
    for i in 0..55 {
        let event = if i % 2 == 0 { "order.created" } else { "order.paid" };
        let error = if i == 7 { "Connection 50%_reset" } else { "timeout" };
        ids.push(db.insert("dead", &format!("A{i}"), event, Some(error)).await);
    }
    db.insert("pending", "A0", "order.created", None).await;
    let app = service(Console::new(db.pool.clone())).await;
    let get = async |uri: &str| {
        let resp = test::call_service(&app, test::TestRequest::get().uri(uri).to_request()).await;
        assert_eq!(resp.status(), StatusCode::OK, "{uri}");
        body(resp).await
    };
    let rows_of = |page: &str| page.matches("<tr id=\"row-").count();

    let first = get("/outbox/dead").await;
    assert!(first.contains("<p id=\"dead-total\">55 dead rows match</p>"), "{first}");
    assert_eq!(rows_of(&first), 50);
    let next = format!("/outbox/dead?after={}", ids[49]);
    assert!(first.contains(&format!("href=\"{}\"", next.replace('&', "&amp;"))), "{first}");
    let second = get(&next).await;
    assert_eq!(rows_of(&second), 5);
    assert!(second.contains(&format!("<tr id=\"row-{}\">", ids[50])), "{second}");
    assert!(!second.contains("id=\"next-page\""), "{second}");

    let paid = get("/outbox/dead?event_type=order.paid").await;
    assert!(paid.contains("<p id=\"dead-total\">27 dead rows match</p>"), "{paid}");
    let one = get("/outbox/dead?aggregate=order%2FA13").await;
    assert!(one.contains("<p id=\"dead-total\">1 dead row matches</p>"), "{one}");
    assert!(one.contains(&format!("<tr id=\"row-{}\">", ids[13])), "{one}");
    // The error filter is a substring, case-insensitive, with % and _ taken literally.
    let error = get("/outbox/dead?error=50%25_RESET").await;
    assert!(error.contains("<p id=\"dead-total\">1 dead row matches</p>"), "{error}");
    assert!(error.contains(&format!("<tr id=\"row-{}\">", ids[7])), "{error}");
    let none = get("/outbox/dead?error=5%25").await;
    assert!(none.contains("<p id=\"dead-total\">0 dead rows match</p>"), "{none}");
}

#[actix_web::test]
async fn a_row_page_shows_every_column_and_unknown_rows_are_404() {
    let db = TestDb::new().await;
    let id = db.insert("processing", "42", "order.created", Some("try 1 failed")).await;
    let app = service(Console::new(db.pool.clone()).token(TOKEN)).await;
    let resp = test::call_service(&app, test::TestRequest::get().uri(&format!("/outbox/rows/{id}")).to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let page = body(resp).await;
    for column in [
        "id",
        "status",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "created_at",
        "available_at",
        "attempts",
        "lease_owner",
        "lease_until",
        "lease_version",
        "done_at",
        "last_error",
    ] {
        assert!(page.contains(&format!("<th>{column}</th>")), "{column}: {page}");
    }
    assert!(page.contains("<td id=\"col-status\"><span class=\"status processing\">processing</span></td>"), "{page}");
    assert!(page.contains("<td>test:worker-0</td>"), "{page}");
    assert!(page.contains("<td class=\"error\" id=\"col-last-error\">try 1 failed</td>"), "{page}");
    // Not dead: nothing to repair here.
    assert!(!page.contains("id=\"retry\""), "{page}");

    let resp = test::call_service(&app, test::TestRequest::get().uri("/outbox/rows/999999").to_request()).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}

#[actix_web::test]
async fn no_database_password_appears_on_any_page() {
    // Trust authentication ignores the password, so the console connects with it in its URL.
    let db = TestDb::new().await;
    db.insert("dead", "1", "order.created", Some("boom")).await;
    let with_password = db.url.replacen("postgres://root@", "postgres://root:s3cret-pw@", 1);
    assert_ne!(with_password, db.url);
    let pool = actix_outbox::connect_pool(&with_password, 2).await.unwrap();
    let app = service(Console::new(pool).token(TOKEN).fifo(Fifo::All)).await;
    for uri in ["/outbox/", "/outbox/dead", "/outbox/rows/1", "/outbox/blocked", "/outbox/api/stats", "/outbox/login"] {
        let page = body(test::call_service(&app, test::TestRequest::get().uri(uri).to_request()).await).await;
        assert!(!page.contains("s3cret-pw"), "{uri}: {page}");
        assert!(!page.contains(TOKEN), "{uri}: {page}");
    }
}

#[actix_web::test]
async fn links_follow_the_mount_point_even_inside_another_scope() {
    let db = TestDb::new().await;
    let dead = db.insert("dead", "1", "order.created", Some("boom")).await;
    let console = Console::new(db.pool.clone()).token(TOKEN);
    let app =
        test::init_service(App::new().service(actix_web::web::scope("/admin").service(console.scope("/outbox")))).await;
    let page =
        body(test::call_service(&app, test::TestRequest::get().uri("/admin/outbox/dead").to_request()).await).await;
    assert!(page.contains(r#"<link rel="stylesheet" href="/admin/outbox/console.css">"#), "{page}");
    assert!(page.contains(&format!(r#"<a href="/admin/outbox/rows/{dead}">{dead}</a>"#)), "{page}");
    let page = body(
        test::call_service(&app, test::TestRequest::get().uri(&format!("/admin/outbox/rows/{dead}")).to_request())
            .await,
    )
    .await;
    assert!(page.contains(r#"<a id="login" href="/admin/outbox/login">"#), "{page}");

    // At the root of an application, the links have no prefix.
    let app = service_at_root(Console::new(db.pool.clone())).await;
    let page = body(test::call_service(&app, test::TestRequest::get().uri("/").to_request()).await).await;
    assert!(page.contains(r#"<a class="value" id="count-dead" href="/dead">1</a>"#), "{page}");
}

async fn service_at_root(
    console: Console,
) -> impl Service<actix_http::Request, Response = ServiceResponse, Error = actix_web::Error> {
    test::init_service(App::new().service(console.scope(""))).await
}

/// The console on a pool made for a transaction pooler (`Pooler::Transaction`), through a
/// PgBouncer of the test's own in `pool_mode = transaction`: the overview, the dead list and a
/// row page count what is there, many pages at once included, and a retry of a dead row goes
/// through and shows on every page afterwards. No page speaks of a prepared statement.
#[actix_web::test]
async fn the_console_works_on_a_pool_through_a_transaction_pooler() {
    use actix_outbox::{PoolConfig, Pooler};
    use actix_outbox_test_support::{PgBouncer, database_addr};

    let db = TestDb::new().await;
    for _ in 0..3 {
        db.insert("pending", "1", "order.created", None).await;
    }
    db.insert("processing", "2", "order.created", None).await;
    let dead = db.insert("dead", "3", "order.paid", Some("boom")).await;
    let other = db.insert("dead", "4", "order.paid", Some("bang")).await;
    db.insert("done", "5", "order.created", None).await;
    let bouncer = PgBouncer::start(&database_addr()).await;
    let pool = PoolConfig::new(bouncer.route(&db.url)).size(4).pooler(Pooler::Transaction).connect().await.unwrap();
    let app = service(Console::new(pool).token(TOKEN)).await;
    let get = async |uri: &str| {
        let resp = test::call_service(&app, test::TestRequest::get().uri(uri).to_request()).await;
        let status = resp.status();
        let page = body(resp).await;
        assert_eq!(status, StatusCode::OK, "{uri}: {page}");
        assert!(!page.contains("prepared statement"), "{uri}: {page}");
        page
    };

    let overview = get("/outbox/").await;
    assert!(overview.contains(r#"<div class="value" id="count-pending">3</div>"#), "{overview}");
    assert!(overview.contains(r#"<div class="value" id="count-processing">1</div>"#), "{overview}");
    assert!(overview.contains(r#"<a class="value" id="count-dead" href="/outbox/dead">2</a>"#), "{overview}");
    // Pages at once, more than the pool holds: each read a transaction of its own, on whichever
    // server connection the bouncer gives it.
    let pages = futures_util::future::join_all((0..12).map(|i| {
        let uri = match i % 3 {
            0 => "/outbox/".to_owned(),
            1 => "/outbox/dead".to_owned(),
            _ => format!("/outbox/rows/{dead}"),
        };
        let app = &app;
        async move {
            let resp = test::call_service(app, test::TestRequest::get().uri(&uri).to_request()).await;
            (uri, resp.status(), body(resp).await)
        }
    }))
    .await;
    for (uri, status, page) in pages {
        assert_eq!(status, StatusCode::OK, "{uri}: {page}");
        assert!(!page.contains("prepared statement"), "{uri}: {page}");
    }

    let list = get("/outbox/dead").await;
    assert!(list.contains("<p id=\"dead-total\">2 dead rows match</p>"), "{list}");
    assert_eq!(list.matches("<tr id=\"row-").count(), 2, "{list}");
    let row = get(&format!("/outbox/rows/{dead}")).await;
    assert!(row.contains("<td id=\"col-status\"><span class=\"status dead\">dead</span></td>"), "{row}");
    assert!(row.contains("<td class=\"error\" id=\"col-last-error\">boom</td>"), "{row}");
    let resp = test::call_service(&app, test::TestRequest::get().uri("/outbox/rows/999999").to_request()).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);

    // A repair: retry the dead row, with the operator's bearer token.
    let req = form_post(&format!("/outbox/dead/{dead}/retry"), "")
        .insert_header((header::AUTHORIZATION, format!("Bearer {TOKEN}")))
        .to_request();
    let resp = test::call_service(&app, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(body(resp).await, format!("{{\"retried\":[{dead}]}}"));
    assert_eq!(db.state(dead).await, ("pending".to_owned(), 0, Some("boom".to_owned())));
    assert_eq!(db.state(other).await.0, "dead", "only the row named");
    let overview = get("/outbox/").await;
    assert!(overview.contains(r#"<div class="value" id="count-pending">4</div>"#), "{overview}");
    assert!(overview.contains(r#"<a class="value" id="count-dead" href="/outbox/dead">1</a>"#), "{overview}");
    assert!(get("/outbox/dead").await.contains("<p id=\"dead-total\">1 dead row matches</p>"));
    let row = get(&format!("/outbox/rows/{dead}")).await;
    assert!(row.contains("<td id=\"col-status\"><span class=\"status pending\">pending</span></td>"), "{row}");
}

/// The pace of the dispatcher the console is attached to: shown on the overview, set with the
/// bearer token (answered in JSON) or a session's form, refused without credentials or with a
/// cap that is not a number above zero, the dispatcher's cap unchanged by every refusal.
#[actix_web::test]
async fn the_max_rate_is_shown_and_set_behind_the_token() {
    use actix_outbox::dispatcher::{GetPace, Shutdown};
    use actix_outbox::testkit::MemorySink;
    use actix_outbox::{DispatcherConfig, OutboxSupervisor};

    let db = TestDb::new().await;
    let config = DispatcherConfig::default().max_rate(40.0);
    let dispatcher = OutboxSupervisor::start(config, db.pool.clone(), MemorySink::new()).unwrap();
    let app = service(Console::new(db.pool.clone()).token(TOKEN).supervisor(dispatcher.clone())).await;
    let cap = async || dispatcher.send(GetPace).await.unwrap().max_rate;

    let page = body(test::call_service(&app, test::TestRequest::get().uri("/outbox/").to_request()).await).await;
    assert!(page.contains(r#"<td id="pace">40/s"#), "{page}");
    assert!(!page.contains("pace-form"), "no form before logging in: {page}");

    let resp = test::call_service(&app, form_post("/outbox/pace", "max_rate=5").to_request()).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(cap().await, Some(40.0));

    let bearer = (header::AUTHORIZATION, format!("Bearer {TOKEN}"));
    for (form, status, answer) in [
        ("max_rate=250", StatusCode::OK, r#"{"max_rate":250.0}"#),
        (
            "max_rate=0",
            StatusCode::BAD_REQUEST,
            r#"{"error":"max rate must be a number of messages a second above zero, not 0"}"#,
        ),
        ("max_rate=fast", StatusCode::BAD_REQUEST, r#"{"error":"max_rate \"fast\" is not a number"}"#),
    ] {
        let resp =
            test::call_service(&app, form_post("/outbox/pace", form).insert_header(bearer.clone()).to_request()).await;
        assert_eq!(resp.status(), status, "{form}");
        assert_eq!(body(resp).await, answer, "{form}");
        assert_eq!(cap().await, Some(250.0), "{form}");
    }

    let (cookie, csrf) = login(&app).await;
    let req = test::TestRequest::get().uri("/outbox/").insert_header((header::COOKIE, cookie.clone())).to_request();
    let page = body(test::call_service(&app, req).await).await;
    assert!(page.contains(r#"<td id="pace">250/s"#), "{page}");
    assert!(page.contains(r#"<form class="inline" id="pace-form" method="post" action="/outbox/pace">"#), "{page}");
    assert!(page.contains(r#"name="max_rate" inputmode="decimal" size="8" value="250""#), "{page}");

    let req = form_post("/outbox/pace", "max_rate=1").insert_header((header::COOKIE, cookie.clone()));
    assert_eq!(test::call_service(&app, req.to_request()).await.status(), StatusCode::FORBIDDEN, "no CSRF token");
    assert_eq!(cap().await, Some(250.0));
    let req = form_post("/outbox/pace", &format!("csrf={csrf}&max_rate=")).insert_header((header::COOKIE, cookie));
    let resp = test::call_service(&app, req.to_request()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(body(resp).await.contains("the dispatcher is not paced"));
    assert_eq!(cap().await, None);
    dispatcher.send(Shutdown).await.unwrap();

    // A console without a dispatcher has no pace to set.
    let app = service(Console::new(db.pool.clone()).token(TOKEN)).await;
    let resp =
        test::call_service(&app, form_post("/outbox/pace", "max_rate=5").insert_header(bearer).to_request()).await;
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    assert_eq!(body(resp).await, r#"{"error":"no dispatcher is attached to this console"}"#);
}

/// Two outboxes (two databases) in one [`Consoles`]: the list counts each one's rows and links
/// to its pages; each outbox's pages show its rows alone, with a picker of the other; a repair
/// needs that outbox's own login; an outbox added while serving shows at once, and one removed
/// answers 404.
#[actix_web::test]
async fn consoles_list_several_outboxes_and_pick_between_them() {
    let (a, b, c) = (TestDb::new().await, TestDb::new().await, TestDb::new().await);
    for _ in 0..3 {
        a.insert("pending", "a1", "order.created", None).await;
    }
    let dead_a = a.insert("dead", "a2", "order.paid", Some("boom a")).await;
    let dead_b = b.insert("dead", "b1", "invoice.sent", Some("boom b")).await;
    b.insert("dead", "b2", "invoice.sent", Some("boom b")).await;
    c.insert("pending", "c1", "order.created", None).await;
    let consoles = Consoles::new();
    consoles.insert("tenant_a.outbox", Console::new(a.pool.clone()).source("tenant_a").token(TOKEN));
    consoles.insert("tenant_b.outbox", Console::new(b.pool.clone()).source("tenant_b").token(TOKEN));
    let app = test::init_service(App::new().service(consoles.scope("/outbox"))).await;
    let get = async |uri: &str| {
        let resp = test::call_service(&app, test::TestRequest::get().uri(uri).to_request()).await;
        (resp.status(), body(resp).await)
    };

    let (status, list) = get("/outbox/").await;
    assert_eq!(status, StatusCode::OK);
    let line = |name: &str| {
        let at = list.find(&format!(r#"data-outbox="{name}""#)).unwrap_or_else(|| panic!("{name} listed: {list}"));
        list[at..at + list[at..].find("</tr>").unwrap()].to_owned()
    };
    let (line_a, line_b) = (line("tenant_a.outbox"), line("tenant_b.outbox"));
    assert!(line_a.contains(r#"<a href="/outbox/tenant_a.outbox/">tenant_a.outbox</a>"#), "{line_a}");
    assert!(line_a.contains(r#"<td class="pending">3</td>"#), "{line_a}");
    assert!(line_a.contains(r#"<a href="/outbox/tenant_a.outbox/dead">1</a>"#), "{line_a}");
    assert!(line_b.contains(r#"<td class="pending">0</td>"#), "{line_b}");
    assert!(line_b.contains(r#"<a href="/outbox/tenant_b.outbox/dead">2</a>"#), "{line_b}");
    assert_eq!(list.matches(r#"<tr class="outbox""#).count(), 2, "{list}");
    assert_eq!(get("/outbox/console.css").await.0, StatusCode::OK);

    // Each outbox's pages: its own rows, and the picker of both.
    let (status, overview) = get("/outbox/tenant_b.outbox/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        overview.contains(r#"<a class="value" id="count-dead" href="/outbox/tenant_b.outbox/dead">2</a>"#),
        "{overview}"
    );
    assert!(overview.contains(r#"<div class="value" id="count-pending">0</div>"#), "{overview}");
    assert!(overview.contains(r#"<summary>tenant_b.outbox</summary>"#), "{overview}");
    assert!(overview.contains(r#"<li><a href="/outbox/">all outboxes</a></li>"#), "{overview}");
    assert!(overview.contains(r#"<li><a href="/outbox/tenant_a.outbox/">tenant_a.outbox</a></li>"#), "{overview}");
    assert!(
        overview
            .contains(r#"<a class="current" href="/outbox/tenant_b.outbox/" aria-current="page">tenant_b.outbox</a>"#),
        "{overview}"
    );
    assert!(overview.contains(r#"<link rel="stylesheet" href="/outbox/tenant_b.outbox/console.css">"#), "{overview}");
    assert_eq!(get("/outbox/tenant_b.outbox/console.css").await.0, StatusCode::OK);
    let (_, dead) = get("/outbox/tenant_a.outbox/dead").await;
    assert!(dead.contains(&format!(r#"<a href="/outbox/tenant_a.outbox/rows/{dead_a}">{dead_a}</a>"#)), "{dead}");
    assert!(!dead.contains("invoice.sent"), "{dead}");
    let (status, row) = get(&format!("/outbox/tenant_b.outbox/rows/{dead_b}")).await;
    assert_eq!(status, StatusCode::OK, "{row}");
    assert_eq!(get("/outbox/tenant_c.outbox/").await.0, StatusCode::NOT_FOUND);

    // A repair goes to the outbox whose page it is, with that outbox's login.
    let resp = test::call_service(
        &app,
        test::TestRequest::post()
            .uri(&format!("/outbox/tenant_b.outbox/dead/{dead_b}/retry"))
            .insert_header((header::AUTHORIZATION, format!("Bearer {TOKEN}")))
            .insert_header((header::ACCEPT, "application/json"))
            .to_request(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(b.state(dead_b).await.0, "pending");
    assert_eq!(a.state(dead_a).await.0, "dead");
    let req = form_post("/outbox/tenant_a.outbox/login", &format!("token={TOKEN}")).to_request();
    let resp = test::call_service(&app, req).await;
    assert_eq!(resp.status(), StatusCode::SEE_OTHER);
    assert_eq!(resp.headers().get(header::LOCATION).unwrap(), "/outbox/tenant_a.outbox/");
    let cookie = resp.headers().get(header::SET_COOKIE).unwrap().to_str().unwrap();
    assert!(cookie.contains("Path=/outbox/tenant_a.outbox"), "{cookie}");

    // Added and removed while serving.
    consoles.insert("tenant_c.outbox", Console::new(c.pool.clone()));
    let (status, overview) = get("/outbox/tenant_c.outbox/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(overview.contains(r#"<div class="value" id="count-pending">1</div>"#), "{overview}");
    assert!(consoles.remove("tenant_a.outbox"));
    assert!(!consoles.remove("tenant_a.outbox"));
    assert_eq!(consoles.names(), ["tenant_b.outbox", "tenant_c.outbox"]);
    assert_eq!(get("/outbox/tenant_a.outbox/").await.0, StatusCode::NOT_FOUND);
    let (_, list) = get("/outbox/").await;
    assert!(!list.contains("tenant_a.outbox"), "{list}");
    assert_eq!(list.matches(r#"<tr class="outbox""#).count(), 2, "{list}");
}

/// Scheduled rows (pending, never claimed, due later) are shown apart from the pending rows due
/// now or backing off, and are left out of the oldest unfinished row's age however old they are,
/// as `actix_outbox::admin::stats` counts them (the console reads its own bounded statement).
#[actix_web::test]
async fn scheduled_rows_are_shown_apart_as_stats_counts_them() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    db.insert("pending", "1", "order.created", None).await;
    let scheduled = db.insert("pending", "2", "order.reminder", None).await;
    let backing_off = db.insert("pending", "3", "order.paid", Some("retryable: busy")).await;
    db.insert("processing", "4", "order.created", None).await;
    db.conn()
        .await
        .batch_execute(&format!(
            "UPDATE outbox SET available_at = now() + interval '1 day', created_at = now() - interval '3 hours'
             WHERE id = {scheduled};
             UPDATE outbox SET available_at = now() + interval '1 hour', lease_version = 1,
                               created_at = now() - interval '2 minutes'
             WHERE id = {backing_off};"
        ))
        .await
        .unwrap();
    let stats = actix_outbox::admin::stats(&mut db.conn().await).await.unwrap();
    assert_eq!((stats.by_status["pending"], stats.scheduled, stats.backlog()), (3, 1, 3));

    let app = service(Console::new(db.pool.clone())).await;
    let page = body(test::call_service(&app, test::TestRequest::get().uri("/outbox/").to_request()).await).await;
    assert!(page.contains(r#"<div class="value" id="count-pending">2</div>"#), "the two due: {page}");
    assert!(page.contains(r#"<div class="value" id="count-scheduled">1</div>"#), "{page}");
    assert!(page.contains(r#"<div class="value" id="count-processing">1</div>"#), "{page}");
    assert!(page.contains(r#"<div class="value" id="oldest-unfinished">2m "#), "the row backing off, not 3h: {page}");
    let served: serde_json::Value = serde_json::from_str(
        &body(test::call_service(&app, test::TestRequest::get().uri("/outbox/api/stats").to_request()).await).await,
    )
    .unwrap();
    assert_eq!((served["by_status"]["pending"].as_i64(), served["scheduled"].as_i64()), (Some(3), Some(1)));

    let consoles = Consoles::new();
    consoles.insert("billing.outbox", Console::new(db.pool.clone()));
    let app = test::init_service(App::new().service(consoles.scope("/outbox"))).await;
    let list = body(test::call_service(&app, test::TestRequest::get().uri("/outbox/").to_request()).await).await;
    assert!(
        list.contains(r#"<td class="pending">2</td><td class="scheduled">1</td><td class="processing">1</td>"#),
        "{list}"
    );
}
