//! The pages, as maud templates: every `(value)` below is HTML-escaped by maud, which is what
//! keeps aggregate ids, errors and payloads (written by whoever can insert a row) inert text.
//! Nothing here uses `PreEscaped` on a value from the table.

use actix_outbox::Fifo;
use actix_outbox::admin::{BlockedAggregate, OutboxRow, Status};
use actix_outbox::dispatcher::{Health, PaceReport};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use crate::consoles::Picker;
use crate::query::{DeadFilter, DeadPage, Overview};
use crate::report::BlockedView;

/// What every page needs to know of the request.
pub(crate) struct View<'a> {
    /// Where the console is mounted (`/outbox`), for links; empty at the root.
    pub(crate) base: &'a str,
    pub(crate) source: Option<&'a str>,
    pub(crate) read_only: bool,
    /// The session's CSRF token when an operator is logged in: forms are shown then.
    pub(crate) csrf: Option<&'a str>,
    /// The outboxes to pick from, when the console is one of several ([`crate::Consoles`]).
    pub(crate) picker: Option<&'a Picker>,
}

impl View<'_> {
    fn link(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Whether this is a page of one outbox (not the list of several).
    fn is_outbox(&self) -> bool {
        self.picker.is_none_or(|p| p.current.is_some())
    }

    /// Where the list of outboxes is: the base of an outbox's page less its own segment.
    fn home(&self) -> &str {
        if self.picker.is_some_and(|p| p.current.is_some()) {
            self.base.rsplit_once('/').map_or("", |(home, _)| home)
        } else {
            self.base
        }
    }

    /// Whether repair forms are shown.
    fn can_repair(&self) -> bool {
        !self.read_only && self.csrf.is_some()
    }

    fn csrf_field(&self) -> Markup {
        html! { input type="hidden" name="csrf" value=(self.csrf.unwrap_or_default()); }
    }
}

/// A time in the tables: UTC, to the millisecond.
fn timestamp(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

/// `3d 4h`, `4h 5m`, `5m 6s`, `6s`: two units are enough to compare ages at a glance.
pub(crate) fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    let (d, h, m, s) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h}h")
    } else if h > 0 {
        format!("{h}h {m}m")
    } else if m > 0 {
        format!("{m}m {s}s")
    } else {
        format!("{s}s")
    }
}

fn age_of(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    age((now - t).num_milliseconds() as f64 / 1000.0)
}

/// The frame of every page. `refresh`: seconds after which the page reloads itself (a
/// `<meta http-equiv=refresh>`, which needs no script and so no exception in the CSP).
pub(crate) fn layout(v: &View<'_>, title: &str, refresh: Option<u64>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(secs) = refresh { meta http-equiv="refresh" content=(secs); }
                title {
                    (title) " · outbox console"
                    @if let Some(name) = v.picker.and_then(|p| p.current.as_deref()) { " · " (name) }
                    @else if let Some(s) = v.source { " · " (s) }
                }
                link rel="stylesheet" href=(v.link("/console.css"));
            }
            body {
                header {
                    nav {
                        a.brand href=(v.link("/")) { "outbox" }
                        @if let Some(picker) = v.picker { (outbox_picker(v, picker)) }
                        @if let Some(source) = v.source { span.source #source { (source) } }
                        @if v.is_outbox() {
                            a href=(v.link("/")) { "Overview" }
                            a href=(v.link("/dead")) { "Dead" }
                            a href=(v.link("/blocked")) { "Blocked" }
                            a href=(v.link("/api/stats")) { "JSON" }
                        }
                        span.spacer {}
                        @if !v.is_outbox() {
                        } @else if v.read_only {
                            span.badge.readonly #read-only { "read-only: no operator token configured" }
                        } @else if v.csrf.is_some() {
                            form.inline method="post" action=(v.link("/logout")) {
                                (v.csrf_field())
                                button.link #logout type="submit" { "Log out" }
                            }
                        } @else {
                            a #login href=(v.link("/login")) { "Log in to repair" }
                        }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// The picker of [`crate::Consoles`]: the outbox shown, and a list of every other one (a
/// `<details>`, which opens without script).
fn outbox_picker(v: &View<'_>, p: &Picker) -> Markup {
    let home = v.home();
    html! {
        details.picker #picker {
            summary { (p.current.as_deref().unwrap_or("all outboxes")) }
            ul {
                li { a href=(format!("{home}/")) { "all outboxes" } }
                @for (name, slug) in &p.outboxes {
                    li {
                        @if p.current.as_deref() == Some(name.as_str()) {
                            a.current href=(format!("{home}/{slug}/")) aria-current="page" { (name) }
                        } @else {
                            a href=(format!("{home}/{slug}/")) { (name) }
                        }
                    }
                }
            }
        }
    }
}

/// One line of the list of outboxes.
pub(crate) struct OutboxLine {
    pub(crate) name: String,
    pub(crate) slug: String,
    pub(crate) source: Option<String>,
    pub(crate) table: Result<Overview, String>,
}

/// `GET /` of [`crate::Consoles`]: every outbox with its figures, each a link to its overview.
pub(crate) fn outboxes(v: &View<'_>, lines: &[OutboxLine], refresh: u64) -> Markup {
    let body = html! {
        @if lines.is_empty() {
            p.note #no-outboxes { "No outbox yet." }
        } @else {
            table.rows #outboxes {
                thead { tr { th { "outbox" } th { "source" } th { "pending" } th { "scheduled" } th { "processing" }
                    th { "dead" } th { "oldest unfinished" } th { "expired leases" } } }
                tbody {
                    @for line in lines {
                        tr.outbox data-outbox=(line.name) {
                            td { a href=(v.link(&format!("/{}/", line.slug))) { (line.name) } }
                            td { (line.source.as_deref().unwrap_or("")) }
                            @match &line.table {
                                Ok(t) => {
                                    td.pending { (t.ready()) }
                                    td.scheduled { (t.scheduled) }
                                    td.processing { (t.processing) }
                                    td.dead { a href=(v.link(&format!("/{}/dead", line.slug))) { (t.dead) } }
                                    td { (t.oldest_unfinished_age_s.map(age).unwrap_or_else(|| "none".to_owned())) }
                                    td { (t.expired_leases) }
                                }
                                Err(e) => { td.error colspan="6" { "The table could not be read: " (e) } }
                            }
                        }
                    }
                }
            }
        }
        p.note { "The page reloads every " (refresh) " s." }
    };
    layout(v, "Outboxes", Some(refresh), body)
}

/// What the overview shows besides the table's figures.
pub(crate) struct OverviewData {
    pub(crate) table: Result<Overview, String>,
    /// `None` with the FIFO gate off.
    pub(crate) blocked: Option<Result<i64, String>>,
    pub(crate) fifo: Fifo,
    /// `None` without the dispatcher's address.
    pub(crate) health: Option<Result<Health, String>>,
    /// `None` without the dispatcher's address.
    pub(crate) pace: Option<Result<PaceReport, String>>,
    pub(crate) chart: Markup,
}

/// `300/s`, `0.5/s`.
fn per_second(rate: f64) -> String {
    if rate >= 10.0 { format!("{rate:.0}/s") } else { format!("{rate:.2}/s") }
}

pub(crate) fn overview(v: &View<'_>, d: &OverviewData, refresh: u64) -> Markup {
    let body = html! {
        section.cards {
            @match &d.table {
                Ok(t) => {
                    (card("pending", "count-pending", &t.ready().to_string(), None))
                    (card("scheduled", "count-scheduled", &t.scheduled.to_string(), None))
                    (card("processing", "count-processing", &t.processing.to_string(), None))
                    (card("dead", "count-dead", &t.dead.to_string(), Some(&v.link("/dead"))))
                    @match &d.blocked {
                        None => (card("blocked aggregates", "count-blocked", "FIFO off", None)),
                        Some(Ok(n)) => (card("blocked aggregates", "count-blocked", &n.to_string(), Some(&v.link("/blocked")))),
                        Some(Err(e)) => (card("blocked aggregates", "count-blocked", &format!("unknown: {e}"), None)),
                    }
                    (card("oldest unfinished", "oldest-unfinished",
                        &t.oldest_unfinished_age_s.map(age).unwrap_or_else(|| "none".to_owned()), None))
                    (card("expired leases", "expired-leases", &t.expired_leases.to_string(), None))
                }
                Err(e) => { p.error #table-error { "The table could not be read: " (e) } }
            }
        }
        p.note {
            "pending counts the rows due now or backing off; scheduled, the rows a producer scheduled for later \
             and not yet due, which are neither backlog nor in the oldest unfinished row's age. "
            "done rows are the table's history and are not counted here; "
            a href=(v.link("/api/stats")) { "/api/stats" }
            " (as " code { "actix-outbox stats" } ") counts every status."
        }
        section.health {
            h2 { "Health" }
            table.kv {
                tr {
                    th { "database" }
                    td #health-database {
                        @match &d.table { Ok(_) => span.ok { "answers" }, Err(e) => span.bad { "does not answer: " (e) } }
                        @if let Some(Ok(h)) = &d.health { @if !h.database_reachable { " · " span.bad { "the dispatcher's last statement failed" } } }
                    }
                }
                tr {
                    th { "sink" }
                    td #health-sink {
                        @match &d.health {
                            None => span.unknown { "unknown: no dispatcher attached to this console" },
                            Some(Err(e)) => span.bad { "the dispatcher does not answer: " (e) },
                            Some(Ok(h)) => {
                                @if h.sink.is_up() { span.ok { (h.sink) } } @else { span.bad { (h.sink) } }
                                @if h.claiming_paused { " · " span.bad { "claiming paused" } }
                                @if h.stopping { " · " span.bad { "shutting down" } }
                            }
                        }
                    }
                }
                tr {
                    th { "max rate" }
                    td #pace {
                        @match &d.pace {
                            None => span.unknown { "unknown: no dispatcher attached to this console" },
                            Some(Err(e)) => span.bad { "the dispatcher does not answer: " (e) },
                            Some(Ok(p)) => {
                                @match (p.max_rate, p.rate) {
                                    (Some(cap), Some(rate)) if p.is_pushed_back() => {
                                        (per_second(cap)) " · " span.bad { "pacing at " (per_second(rate)) ": the broker pushes back" }
                                    }
                                    (Some(cap), _) => { (per_second(cap)) }
                                    (None, Some(rate)) => {
                                        "not capped · " span.bad { "pacing at " (per_second(rate)) ": the broker refuses messages" }
                                    }
                                    (None, None) => { "not paced" }
                                }
                                @if v.can_repair() {
                                    form.inline #pace-form method="post" action=(v.link("/pace")) {
                                        (v.csrf_field())
                                        input type="text" name="max_rate" inputmode="decimal" size="8"
                                            value=(p.max_rate.map(|r| r.to_string()).unwrap_or_default())
                                            placeholder="none" aria-label="messages a second";
                                        " /s "
                                        button type="submit" { "set" }
                                        span.note { " empty: not paced" }
                                    }
                                }
                            }
                        }
                    }
                }
                tr { th { "FIFO gate" } td #fifo { (d.fifo) } }
                @if let Some(source) = v.source { tr { th { "source" } td #overview-source { (source) } } }
            }
        }
        section {
            h2 { "Last hour" }
            (d.chart)
            p.legend {
                span.key.published { "published / min" } " "
                span.key.failed { "failed / min" } " "
                span.key.backlog { "backlog (pending + processing, scheduled rows left out)" } " "
                span.key.dead { "dead" }
            }
            p.note { "One sample a minute, kept in this process for an hour; the page reloads every " (refresh) " s." }
        }
    };
    layout(v, "Overview", Some(refresh), body)
}

fn card(label: &str, id: &str, value: &str, link: Option<&str>) -> Markup {
    html! {
        div.card {
            div.label { (label) }
            @if let Some(href) = link { a.value id=(id) href=(href) { (value) } } @else { div.value id=(id) { (value) } }
        }
    }
}

/// The query string of `/dead` for `filter`, starting after `after`.
fn dead_query(filter: &DeadFilter, after: Option<i64>) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    for (key, value) in [("event_type", &filter.event_type), ("aggregate", &filter.aggregate), ("error", &filter.error)]
    {
        if !value.trim().is_empty() {
            q.append_pair(key, value);
        }
    }
    if let Some(after) = after {
        q.append_pair("after", &after.to_string());
    }
    q.finish()
}

/// At most this many characters of an error in the list; the row's page has it whole.
const ERROR_SHOWN: usize = 240;

fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max { text.to_owned() } else { text.chars().take(max - 1).collect::<String>() + "…" }
}

pub(crate) fn dead(
    v: &View<'_>,
    filter: &DeadFilter,
    after: Option<i64>,
    page: &DeadPage,
    now: DateTime<Utc>,
) -> Markup {
    let body = html! {
        form.filter method="get" action=(v.link("/dead")) {
            label { "event type " input type="text" name="event_type" value=(filter.event_type) placeholder="order.created"; }
            label { "aggregate " input type="text" name="aggregate" value=(filter.aggregate) placeholder="order/42"; }
            label { "error text " input type="text" name="error" value=(filter.error) placeholder="timeout"; }
            button type="submit" { "Filter" }
            a href=(v.link("/dead")) { "clear" }
        }
        p #dead-total { (page.total) " dead " (if page.total == 1 { "row matches" } else { "rows match" }) }
        @if v.can_repair() {
            // The selection's form is empty here; the checkboxes and buttons join it through
            // their `form` attribute, so that each row can also hold forms of its own.
            form #batch method="post" action=(v.link("/dead/retry")) { (v.csrf_field()) }
            div.batch {
                button form="batch" type="submit" formaction=(v.link("/dead/retry")) #retry-selected { "Retry selected" }
                input form="batch" type="text" name="reason" placeholder="reason for skipping" #batch-reason;
                button form="batch" type="submit" formaction=(v.link("/dead/skip")) #skip-selected { "Skip selected" }
            }
        } @else if !v.read_only {
            p.note { a href=(v.link("/login")) { "Log in" } " with the operator token to retry or skip." }
        }
        @if page.rows.is_empty() {
            p.empty { "No dead rows." }
        } @else {
            table.rows #dead-rows {
                thead { tr {
                    @if v.can_repair() { th {} }
                    th { "id" } th { "aggregate" } th { "event type" } th { "attempts" } th { "age" } th { "last error" }
                    @if v.can_repair() { th { "repair" } }
                } }
                tbody {
                    @for r in &page.rows {
                        tr id=(format!("row-{}", r.id)) {
                            @if v.can_repair() {
                                td { input form="batch" type="checkbox" name="id" value=(r.id) aria-label=(format!("select {}", r.id)); }
                            }
                            td.num { a href=(v.link(&format!("/rows/{}", r.id))) { (r.id) } }
                            td.aggregate { span.agg-type { (r.aggregate_type) } "/" span.agg-id { (r.aggregate_id) } }
                            td { (r.event_type) }
                            td.num { (r.attempts) }
                            td.num title=(timestamp(r.created_at)) { (age_of(r.created_at, now)) }
                            td.error { (cut(r.last_error.as_deref().unwrap_or(""), ERROR_SHOWN)) }
                            @if v.can_repair() {
                                td.repair {
                                    form.inline method="post" action=(v.link(&format!("/dead/{}/retry", r.id))) {
                                        (v.csrf_field())
                                        button type="submit" class="retry" { "Retry" }
                                    }
                                    form.inline method="post" action=(v.link(&format!("/dead/{}/skip", r.id))) {
                                        (v.csrf_field())
                                        input type="text" name="reason" required placeholder="reason";
                                        button type="submit" class="skip" { "Skip" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        p.pager {
            @if after.is_some() {
                a href=(format!("{}?{}", v.link("/dead"), dead_query(filter, None))) { "first page" }
            }
            @if page.more {
                @if let Some(last) = page.rows.last() {
                    " " a #next-page href=(format!("{}?{}", v.link("/dead"), dead_query(filter, Some(last.id)))) { "next page →" }
                }
            }
        }
    };
    layout(v, "Dead rows", None, body)
}

/// JSON pretty-printed, for `<pre>` (escaped there like any other text).
fn pretty(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

pub(crate) fn row(v: &View<'_>, r: &OutboxRow) -> Markup {
    let opt_time = |t: Option<DateTime<Utc>>| t.map(timestamp).unwrap_or_else(|| "—".to_owned());
    let body = html! {
        table.kv #row {
            tr { th { "id" } td #col-id { (r.id) } }
            tr { th { "status" } td #col-status { span class=(format!("status {}", r.status.as_str())) { (r.status.as_str()) } } }
            tr { th { "aggregate_type" } td #col-aggregate-type { (r.aggregate_type) } }
            tr { th { "aggregate_id" } td #col-aggregate-id { (r.aggregate_id) } }
            tr { th { "event_type" } td #col-event-type { (r.event_type) } }
            tr { th { "created_at" } td { (timestamp(r.created_at)) } }
            tr { th { "available_at" } td { (timestamp(r.available_at)) } }
            tr { th { "attempts" } td #col-attempts { (r.attempts) } }
            tr { th { "lease_owner" } td { (r.lease_owner.as_deref().unwrap_or("—")) } }
            tr { th { "lease_until" } td { (opt_time(r.lease_until)) } }
            tr { th { "lease_version" } td { (r.lease_version) } }
            tr { th { "done_at" } td { (opt_time(r.done_at)) } }
            tr { th { "last_error" } td.error #col-last-error { (r.last_error.as_deref().unwrap_or("—")) } }
        }
        h2 { "payload" }
        pre #payload { (pretty(&r.payload)) }
        h2 { "headers" }
        pre #headers { @match &r.headers { Some(h) => (pretty(h)), None => "NULL" } }
        @if r.status == Status::Dead && v.can_repair() {
            h2 { "Repair" }
            form.inline method="post" action=(v.link(&format!("/dead/{}/retry", r.id))) {
                (v.csrf_field())
                button type="submit" #retry { "Retry" }
            }
            form.inline method="post" action=(v.link(&format!("/dead/{}/skip", r.id))) {
                (v.csrf_field())
                input type="text" name="reason" required placeholder="reason for skipping";
                button type="submit" #skip { "Skip" }
            }
        }
    };
    layout(v, &format!("Row {}", r.id), None, body)
}

pub(crate) fn blocked(v: &View<'_>, fifo: &Fifo, view: Option<&BlockedView>) -> Markup {
    let body = html! {
        @match view {
            None => p.empty { "The FIFO gate is off: a dead row blocks no aggregate. (Give the console the dispatchers' gate to see blocked aggregates.)" },
            Some(view) => {
                p #blocked-total { (view.blocked_aggregates_total) " blocked under FIFO on " (fifo) }
                @if view.blocked_aggregates.is_empty() {
                    p.empty { "No aggregate is blocked." }
                } @else {
                    table.rows #blocked-rows {
                        thead { tr { th { "aggregate" } th { "dead head" } th { "event type" } th { "waiting" } th { "attempts" } th { "created" } th { "last error" } @if v.can_repair() { th { "repair" } } } }
                        tbody { @for b in &view.blocked_aggregates { (blocked_row(v, b)) } }
                    }
                    @if view.blocked_aggregates_total > view.blocked_aggregates.len() as i64 {
                        p.note { "First " (view.blocked_aggregates.len()) " shown; " code { "actix-outbox dead blocked --limit N" } " lists more." }
                    }
                }
            }
        }
    };
    layout(v, "Blocked aggregates", None, body)
}

fn blocked_row(v: &View<'_>, b: &BlockedAggregate) -> Markup {
    html! {
        tr {
            td.aggregate { (b.aggregate_type) "/" (b.aggregate_id) }
            td.num { a href=(v.link(&format!("/rows/{}", b.dead_id))) { (b.dead_id) } }
            td { (b.event_type) }
            td.num { (b.waiting) }
            td.num { (b.attempts) }
            td { (timestamp(b.created_at)) }
            td.error { (cut(b.last_error.as_deref().unwrap_or(""), ERROR_SHOWN)) }
            @if v.can_repair() {
                td.repair {
                    form.inline method="post" action=(v.link(&format!("/dead/{}/retry", b.dead_id))) {
                        (v.csrf_field())
                        button type="submit" { "Retry head" }
                    }
                    form.inline method="post" action=(v.link(&format!("/dead/{}/skip", b.dead_id))) {
                        (v.csrf_field())
                        input type="text" name="reason" required placeholder="reason";
                        button type="submit" { "Skip head" }
                    }
                }
            }
        }
    }
}

pub(crate) fn login(v: &View<'_>, problem: Option<&str>) -> Markup {
    let body = html! {
        @if v.read_only {
            p.error { "This console is read-only: it was started without an operator token, so there is nothing to log in to." }
        } @else {
            @if let Some(problem) = problem { p.error #login-error { (problem) } }
            form.login method="post" action=(v.link("/login")) {
                label { "operator token " input #token type="password" name="token" autocomplete="current-password" required autofocus; }
                button #login-submit type="submit" { "Log in" }
            }
            p.note { "The session cookie lasts eight hours, is sent only to this console's pages, and never to a request started by another site." }
        }
    };
    layout(v, "Log in", None, body)
}

/// The answer to a form: what was done, or why nothing was.
pub(crate) fn outcome(v: &View<'_>, title: &str, message: &str, ok: bool) -> Markup {
    let body = html! {
        p class=(if ok { "ok" } else { "error" }) #outcome { (message) }
        p { a href=(v.link("/dead")) { "Dead rows" } " · " a href=(v.link("/")) { "Overview" } }
    };
    layout(v, title, None, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_show_two_units() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(59.0), "59s");
        assert_eq!(age(61.0), "1m 1s");
        assert_eq!(age(3600.0 * 5.0 + 120.0), "5h 2m");
        assert_eq!(age(86_400.0 * 3.0 + 3600.0 * 4.0 + 5.0), "3d 4h");
        assert_eq!(age(-5.0), "0s");
    }

    #[test]
    fn the_dead_list_keeps_its_filter_across_pages() {
        let filter = DeadFilter { event_type: "order.paid".into(), aggregate: "a&b=c".into(), error: " ".into() };
        assert_eq!(dead_query(&filter, Some(41)), "event_type=order.paid&aggregate=a%26b%3Dc&after=41");
        assert_eq!(dead_query(&DeadFilter::default(), None), "");
    }
}
