//! Who may change rows: the operator token, the sessions the login form opens, and the
//! anti-CSRF token each session's forms carry.
//!
//! A request changes something only if it carries the token as `Authorization: Bearer`, or a
//! live session cookie together with that session's CSRF token in its form. A browser attaches
//! the cookie to a cross-site request only when `SameSite=Strict` lets it (never), and a forged
//! form from another origin cannot know the CSRF token, which only the console's own pages
//! contain; a bearer header is never attached by a browser on its own, so it needs no CSRF token.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use actix_web::HttpRequest;
use actix_web::http::header;
use rand::RngExt;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "outbox_console_session";
/// How long a login lasts.
const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Sessions kept at most; the oldest goes first beyond it, so that logins cannot fill memory.
const MAX_SESSIONS: usize = 1024;

/// The operator token, kept as its SHA-256 digest: comparing digests of equal length in
/// constant time says neither how much of a guess was right nor how long the token is.
#[derive(Clone)]
pub(crate) struct Token([u8; 32]);

impl Token {
    /// `None` for an empty (or blank) token: no token means read-only.
    pub(crate) fn new(token: &str) -> Option<Self> {
        let token = token.trim();
        (!token.is_empty()).then(|| Token(digest(token)))
    }

    pub(crate) fn matches(&self, given: &str) -> bool {
        digest(given.trim()).ct_eq(&self.0).into()
    }
}

fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// Constant-time equality of two strings (their lengths may leak; CSRF tokens have one length).
pub(crate) fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// 32 random bytes in hex, from the thread's cryptographically secure generator.
fn random_hex() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct Session {
    csrf: String,
    expires: Instant,
}

/// The open operator sessions, by session id (the cookie's value).
#[derive(Default)]
pub(crate) struct Sessions {
    by_id: HashMap<String, Session>,
}

impl Sessions {
    /// Opens a session; returns its id (the cookie) and its CSRF token.
    pub(crate) fn open(&mut self) -> (String, String) {
        let now = Instant::now();
        self.by_id.retain(|_, s| s.expires > now);
        if self.by_id.len() >= MAX_SESSIONS
            && let Some(oldest) = self.by_id.iter().min_by_key(|(_, s)| s.expires).map(|(id, _)| id.clone())
        {
            self.by_id.remove(&oldest);
        }
        let (id, csrf) = (random_hex(), random_hex());
        self.by_id.insert(id.clone(), Session { csrf: csrf.clone(), expires: now + SESSION_TTL });
        (id, csrf)
    }

    /// The CSRF token of a live session.
    pub(crate) fn csrf(&self, id: &str) -> Option<String> {
        self.by_id.get(id).filter(|s| s.expires > Instant::now()).map(|s| s.csrf.clone())
    }

    pub(crate) fn close(&mut self, id: &str) {
        self.by_id.remove(id);
    }
}

/// How a request proved it is the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// `Authorization: Bearer`: a script, answered in JSON.
    Bearer,
    /// The session cookie and the form's CSRF token: a browser, answered in HTML.
    Session,
}

/// Why a change was refused. Nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Denied {
    /// No token is configured: the console is read-only (403).
    ReadOnly,
    /// No credentials, a wrong bearer token, or a session that expired (401).
    Unauthenticated,
    /// A session cookie without the session's CSRF token (403).
    BadCsrf,
}

impl Denied {
    pub(crate) fn status(self) -> actix_web::http::StatusCode {
        use actix_web::http::StatusCode;
        match self {
            Denied::ReadOnly | Denied::BadCsrf => StatusCode::FORBIDDEN,
            Denied::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    pub(crate) fn message(self) -> &'static str {
        match self {
            Denied::ReadOnly => "this console is read-only: no operator token is configured, so nothing can be changed",
            Denied::Unauthenticated => {
                "log in with the operator token (or send it as Authorization: Bearer) to change rows"
            }
            Denied::BadCsrf => {
                "the form's anti-CSRF token is missing or wrong: reload the page and submit the form again"
            }
        }
    }
}

/// The bearer token of a request, if it sent one.
pub(crate) fn bearer(req: &HttpRequest) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Whether a request carries an `Authorization` header at all: such a client is a script and
/// is answered in JSON even when it is refused.
pub(crate) fn wants_json(req: &HttpRequest) -> bool {
    req.headers().contains_key(header::AUTHORIZATION)
}

/// The CSRF token of the request's live session, if it has one: the pages put it in their forms.
pub(crate) fn session_csrf(req: &HttpRequest, sessions: &std::sync::Mutex<Sessions>) -> Option<String> {
    let cookie = req.cookie(SESSION_COOKIE)?;
    sessions.lock().unwrap_or_else(|e| e.into_inner()).csrf(cookie.value())
}

/// Decides whether a request may change rows. `form_csrf` is the `csrf` field of its form.
pub(crate) fn authorize(
    req: &HttpRequest,
    token: Option<&Token>,
    sessions: &std::sync::Mutex<Sessions>,
    form_csrf: Option<&str>,
) -> Result<Via, Denied> {
    let Some(token) = token else { return Err(Denied::ReadOnly) };
    if req.headers().contains_key(header::AUTHORIZATION) {
        // A header that is there but wrong is refused, even with a good cookie beside it.
        return match bearer(req) {
            Some(given) if token.matches(given) => Ok(Via::Bearer),
            _ => Err(Denied::Unauthenticated),
        };
    }
    let Some(expected) = session_csrf(req, sessions) else { return Err(Denied::Unauthenticated) };
    match form_csrf {
        Some(given) if same(given, &expected) => Ok(Via::Session),
        _ => Err(Denied::BadCsrf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_exactly_and_blank_ones_mean_read_only() {
        let token = Token::new("  s3cret-token \n").unwrap();
        assert!(token.matches("s3cret-token"));
        assert!(!token.matches("s3cret-toke"));
        assert!(!token.matches("s3cret-token2"));
        assert!(!token.matches(""));
        assert!(Token::new("").is_none());
        assert!(Token::new(" \n\t").is_none());
    }

    #[test]
    fn sessions_give_distinct_ids_and_csrf_tokens_and_close() {
        let mut sessions = Sessions::default();
        let (a, csrf_a) = sessions.open();
        let (b, csrf_b) = sessions.open();
        assert_ne!(a, b);
        assert_ne!(csrf_a, csrf_b);
        assert_eq!(a.len(), 64);
        assert_eq!(sessions.csrf(&a).as_deref(), Some(csrf_a.as_str()));
        sessions.close(&a);
        assert_eq!(sessions.csrf(&a), None);
        assert_eq!(sessions.csrf(&b).as_deref(), Some(csrf_b.as_str()));
        assert_eq!(sessions.csrf("not a session"), None);
    }

    #[test]
    fn sessions_are_bounded() {
        let mut sessions = Sessions::default();
        for _ in 0..MAX_SESSIONS + 10 {
            sessions.open();
        }
        assert_eq!(sessions.by_id.len(), MAX_SESSIONS);
    }
}
