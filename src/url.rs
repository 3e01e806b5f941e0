//! Connection strings: checked by the driver's own parser, shown with every password masked.
//!
//! The store and the sinks both use this module (the sinks import nothing from the store):
//! [`ConnectionString`] for PostgreSQL, [`mask_url`] for any connection string, PostgreSQL or
//! AMQP, parsed or not.
//!
//! Masking reads the text as written, not a parser's result: `tokio_postgres::Config` and
//! lapin's `AMQPUri` give values, not where they stood, and they disagree on where the user
//! info ends. tokio-postgres stops it at the first `@` of the whole string; the URL standard,
//! which `AMQPUri` follows, at the last `@` before the first `/`, and so reads
//! `postgres://app:12/ss@db/app` as host `app`, port 12, no password at all. The span masked
//! covers every such reading, and a string no parser accepts is masked on the same rules.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

/// What a password is replaced with.
const MASK: &str = "***";

/// What a database name is percent-encoded with in a URL's path: everything but RFC 3986's
/// unreserved characters, so that `my_db` stays readable.
const NOT_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

/// A PostgreSQL connection string in either form the driver accepts: a URL
/// (`postgres://app:secret@db:5432/app?sslmode=disable`) or `key=value` pairs
/// (`host=db user=app password=secret dbname=app`), parsed by `tokio_postgres::Config`, the
/// parser diesel-async itself hands the string to.
///
/// `Display` and `Debug` show it with the password masked (in the user info, in a
/// `?password=` query parameter or in a `password=` pair), so it can go into any message;
/// [`ConnectionString::expose`] gives the string as written, for a driver and nothing else. A
/// string that names no host is refused here rather than at the first connection.
///
/// Either form may list several servers, to follow a failover: with
/// `target_session_attrs=read-write` the driver tries them in turn and keeps the one that
/// accepts writes (`postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write`, or
/// `host=db1,db2 port=5432,5432 ... target_session_attrs=read-write`). The insert listener logs
/// the server it reached (`server=host:port`).
///
/// ```
/// use actix_outbox::ConnectionString;
///
/// let url: ConnectionString = "postgres://app:s3cret@db:5432/app?sslmode=disable".parse().unwrap();
/// assert_eq!(url.to_string(), "postgres://app:***@db:5432/app?sslmode=disable");
/// assert_eq!(url.with_database("postgres").to_string(), "postgres://app:***@db:5432/postgres?sslmode=disable");
/// assert_eq!(url.database(), Some("app"));
///
/// let pairs: ConnectionString = "host=db user=app password='s3 cret' dbname=app".parse().unwrap();
/// assert_eq!(format!("{pairs:?}"), r#"ConnectionString("host=db user=app password=*** dbname=app")"#);
/// ```
#[derive(Clone)]
pub struct ConnectionString {
    raw: String,
    config: tokio_postgres::Config,
}

impl ConnectionString {
    /// Parses `s` with `tokio_postgres::Config`, in either form. A URL of another scheme
    /// (`mysql://...`) is refused as such, not as whatever the driver made of it.
    pub fn parse(s: &str) -> Result<Self, InvalidConnectionString> {
        let config: tokio_postgres::Config = s.parse().map_err(|e| match scheme(s) {
            // Without one of its two prefixes the driver reads the string as key=value pairs, and
            // its complaint (`unexpected EOF`) would be about those.
            Some(other) if !matches!(other, "postgres" | "postgresql") => {
                InvalidConnectionString { masked: mask_url(s), reason: Reason::Scheme(other.to_owned()) }
            }
            _ => InvalidConnectionString::new(s, with_causes(&e)),
        })?;
        if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
            return Err(InvalidConnectionString::new(s, "it names no host".into()));
        }
        Ok(Self { raw: s.to_owned(), config })
    }

    /// The string as given, password included: for a driver, never for a message.
    pub fn expose(&self) -> &str {
        &self.raw
    }

    /// The database this string connects to: its `dbname`, or PostgreSQL's default, the user's
    /// name. `None` when it names neither.
    pub fn database(&self) -> Option<&str> {
        self.config.get_dbname().or(self.config.get_user())
    }

    /// The database this string connects to, where it must be the one meant: a URL that names no
    /// database (`postgres://app@db:5432/`, no path and no `?dbname=`) is refused, with the fix,
    /// rather than taken to mean PostgreSQL's default, the database named after the user. Such a
    /// URL is usually one cut short, and installing an outbox in `app` (or finding none there)
    /// would lead further down the wrong path.
    ///
    /// `key=value` pairs without `dbname` keep libpq's default on purpose (`host=db user=app` is
    /// the database `app`, as `psql` reads it). What [`admin::ensure_database`](crate::admin::ensure_database),
    /// [`migrate`](crate::migrate) and the command line check.
    ///
    /// ```
    /// # use actix_outbox::ConnectionString;
    /// let url = ConnectionString::parse("postgres://app@db:5432/").unwrap();
    /// assert_eq!(url.database(), Some("app"));
    /// assert_eq!(
    ///     url.require_database().unwrap_err().to_string(),
    ///     "database URL \"postgres://app@db:5432/\" names no database (PostgreSQL would use the one named after \
    ///      the user, \"app\"): name it in the path, postgres://app@db:5432/DATABASE (or with ?dbname=DATABASE)"
    /// );
    /// let pairs = ConnectionString::parse("host=db user=app").unwrap();
    /// assert_eq!(pairs.require_database().unwrap(), "app");
    /// ```
    pub fn require_database(&self) -> Result<&str, InvalidConnectionString> {
        let refused = |reason| InvalidConnectionString { masked: mask_url(&self.raw), reason };
        match self.config.get_dbname() {
            Some(name) => Ok(name),
            None if self.is_url() => Err(refused(Reason::NoDatabase {
                user: self.config.get_user().map(str::to_owned),
                fixed: self.with_database("DATABASE").to_string(),
            })),
            None => {
                self.config.get_user().ok_or_else(|| refused(Reason::NoDatabase { user: None, fixed: String::new() }))
            }
        }
    }

    /// Whether the string is a URL (`postgres://...`), not `key=value` pairs.
    fn is_url(&self) -> bool {
        ["postgres://", "postgresql://"].into_iter().any(|p| self.raw.starts_with(p))
    }

    /// The same server, user, password and options, another database: the string is rewritten
    /// in the form it was given, only its database name changed (the URL's path and any
    /// `dbname` query parameter, or the `dbname` pair, added when missing).
    ///
    /// ```
    /// # use actix_outbox::ConnectionString;
    /// let app = ConnectionString::parse("host=/run/postgresql user=app application_name=billing").unwrap();
    /// assert_eq!(app.with_database("postgres").expose(), "host=/run/postgresql user=app application_name=billing dbname=postgres");
    /// ```
    pub fn with_database(&self, name: &str) -> Self {
        let raw = match ["postgres://", "postgresql://"].into_iter().find(|p| self.raw.starts_with(p)) {
            Some(prefix) => url_with_database(&self.raw, prefix.len(), name),
            None => key_value_with_database(&self.raw, name),
        };
        let mut config = self.config.clone();
        config.dbname(name);
        Self { raw, config }
    }

    /// The same string, its connections confined to the schema `schema`: the startup option
    /// `-c search_path=SCHEMA` added (a `?options=` query parameter of a URL, an `options` pair
    /// otherwise), so that every statement on them reaches that schema's `outbox` table (or
    /// `inbox`), created there by the migrations too. One outbox a schema: a multi-tenant
    /// database keeps one per tenant.
    ///
    /// `schema` must be a lowercase unquoted SQL identifier (`[a-z_][a-z0-9_]*`, at most 63
    /// bytes), the spelling an outbox's qualified name is compared in. A string that sets
    /// `options` already is refused (add `-c search_path=...` to them yourself). A transaction
    /// pooler refuses the `options` startup parameter (PgBouncer: `unsupported startup
    /// parameter: options`): behind one, give each tenant a role whose `search_path` is its
    /// schema (`ALTER ROLE tenant_a SET search_path = tenant_a`) and a URL of that role.
    ///
    /// ```
    /// # use actix_outbox::ConnectionString;
    /// let url = ConnectionString::parse("postgres://app@db/app").unwrap();
    /// assert_eq!(url.in_schema("tenant_a").unwrap().expose(), "postgres://app@db/app?options=-c%20search_path%3Dtenant_a");
    /// let pairs = ConnectionString::parse("host=db dbname=app").unwrap();
    /// assert_eq!(pairs.in_schema("tenant_a").unwrap().expose(), "host=db dbname=app options='-c search_path=tenant_a'");
    /// assert!(url.in_schema("Tenant-A").is_err());
    /// ```
    pub fn in_schema(&self, schema: &str) -> Result<Self, InvalidConnectionString> {
        let refused = |reason| InvalidConnectionString { masked: mask_url(&self.raw), reason };
        if !is_plain_identifier(schema) {
            return Err(refused(Reason::Schema(schema.to_owned())));
        }
        if self.config.get_options().is_some() {
            return Err(refused(Reason::Options));
        }
        let raw = match ["postgres://", "postgresql://"].into_iter().find(|p| self.raw.starts_with(p)) {
            Some(_) => {
                let separator = if self.raw.contains('?') { '&' } else { '?' };
                format!("{}{separator}options=-c%20search_path%3D{schema}", self.raw)
            }
            None => format!("{} options='-c search_path={schema}'", self.raw),
        };
        let mut config = self.config.clone();
        config.options(format!("-c search_path={schema}"));
        Ok(Self { raw, config })
    }

    /// The parsed configuration, for connecting.
    pub(crate) fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }
}

impl FromStr for ConnectionString {
    type Err = InvalidConnectionString;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&mask_url(&self.raw))
    }
}

impl fmt::Debug for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ConnectionString").field(&mask_url(&self.raw)).finish()
    }
}

/// A database connection string the driver refuses, that names no host, or that is a URL of
/// another scheme. The message shows the string as typed with its passwords masked, and never a
/// character of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidConnectionString {
    masked: String,
    reason: Reason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Reason {
    /// The driver's reason, or ours, passwords masked.
    Malformed(String),
    /// A URL whose scheme is not PostgreSQL's.
    Scheme(String),
    /// A schema name that is not a plain lowercase identifier ([`ConnectionString::in_schema`]).
    Schema(String),
    /// A schema asked of a string that sets `options` already.
    Options,
    /// A URL that names no database, or pairs that name neither a database nor a user
    /// ([`ConnectionString::require_database`]): the user PostgreSQL would take the name from,
    /// and the URL with a placeholder where the name goes (empty for pairs).
    NoDatabase { user: Option<String>, fixed: String },
}

/// Whether `name` is a lowercase unquoted SQL identifier of at most 63 bytes: what PostgreSQL
/// keeps as written, so that it reads the same quoted or not.
pub(crate) fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 63
        && chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

impl InvalidConnectionString {
    pub(crate) fn new(raw: &str, mut reason: String) -> Self {
        // tokio-postgres names the character it did not expect, which may be one of a password's.
        if let Some(at) = reason.find(" but got `") {
            reason.truncate(at);
        }
        let secrets = secret_ranges(raw);
        for range in &secrets {
            let secret = &raw[range.clone()];
            if secret.chars().count() >= 3 {
                reason = reason.replace(secret, MASK);
            }
        }
        Self { masked: replace(raw, secrets, MASK), reason: Reason::Malformed(reason) }
    }

    /// The string that was refused, passwords masked.
    pub fn masked(&self) -> &str {
        &self.masked
    }
}

impl fmt::Display for InvalidConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let masked = &self.masked;
        match &self.reason {
            Reason::Malformed(reason) => write!(
                f,
                "malformed database URL {masked:?}: {reason} (expected postgres://user:password@host:port/database \
                 or key=value pairs: host=... user=... password=... dbname=...)"
            ),
            Reason::Scheme(scheme) => write!(
                f,
                "database URL {masked:?} has scheme {scheme:?}; expected postgres:// or postgresql:// \
                 (or key=value pairs: host=... user=... dbname=...)"
            ),
            Reason::Schema(schema) => write!(
                f,
                "schema {schema:?} for {masked:?}: expected a lowercase SQL identifier (letters a-z, digits and _, \
                 not starting with a digit, at most 63 bytes)"
            ),
            Reason::Options => write!(
                f,
                "database URL {masked:?} sets options already: add -c search_path=SCHEMA to them instead of asking \
                 for a schema"
            ),
            Reason::NoDatabase { user: Some(user), fixed } => write!(
                f,
                "database URL {masked:?} names no database (PostgreSQL would use the one named after the user, \
                 {user:?}): name it in the path, {fixed} (or with ?dbname=DATABASE)"
            ),
            Reason::NoDatabase { user: None, .. } => {
                write!(f, "database URL {masked:?} names no database and no user: add dbname=DATABASE")
            }
        }
    }
}

impl std::error::Error for InvalidConnectionString {}

/// `s` with every password replaced by `***`, fit for logs and error messages. `s` is any
/// connection string, parsed or not:
///
/// - a URL of any scheme (`postgres://`, `amqp://`, `amqps://`...): the password of the user
///   info, and the value of every query parameter whose name looks like a secret
///   (`?password=`, `sslpassword`, `passwd`, `pwd`...);
/// - PostgreSQL `key=value` pairs: the value of every such key, quoted or not.
///
/// It errs on the safe side: in a URL the user info is taken to run from the first `:` to the
/// last `@` (so a password with an unencoded `/`, `?` or `@` is still hidden), and in a
/// `key=value` string everything from the first pair that does not parse to the end is masked
/// when it names a secret or holds a `user:password@` shape (`not a url` is shown as typed).
///
/// ```text
/// postgres://app:s3cret@db:5432/app                  → postgres://app:***@db:5432/app
/// postgres://app@db/app?password=s3cret&sslmode=disable → postgres://app@db/app?password=***&sslmode=disable
/// host=db user=app password=s3cret dbname=app        → host=db user=app password=*** dbname=app
/// amqps://guest:s3cret@rabbit/%2f?heartbeat=10       → amqps://guest:***@rabbit/%2f?heartbeat=10
/// postgres://root@127.0.0.1/app                      → postgres://root@127.0.0.1/app
/// ```
///
/// Applications get it through [`ConnectionString`]'s `Display` and `Debug`, and the configs'
/// `Debug`.
pub(crate) fn mask_url(s: &str) -> String {
    replace(s, secret_ranges(s), MASK)
}

/// The scheme `s` starts with, if any (RFC 3986: a letter, then letters, digits, `+`, `-` or
/// `.`, then `:`). Compared as written: tokio-postgres takes only lowercase prefixes.
fn scheme(s: &str) -> Option<&str> {
    let (scheme, _) = s.split_once(':')?;
    let mut chars = scheme.chars();
    let well_formed =
        chars.next()?.is_ascii_alphabetic() && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    well_formed.then_some(scheme)
}

/// The byte ranges of `s` that hold a secret.
fn secret_ranges(s: &str) -> Vec<Range<usize>> {
    match scheme(s) {
        Some(scheme) => url_secrets(s, scheme.len() + 1),
        None => key_value_secrets(s),
    }
}

/// The secrets of a URL whose part after `scheme:` starts at `start`.
fn url_secrets(s: &str, start: usize) -> Vec<Range<usize>> {
    let rest = &s[start..];
    let mut secrets = Vec::new();
    // The user info's password: from its first `:` to the last `@`, which holds every
    // parser's reading of it (see the module's documentation), whatever the password holds.
    if let Some(at) = rest.rfind('@')
        && let Some(colon) = rest[..at].find(':')
    {
        secrets.push(start + colon + 1..start + at);
    }
    // `password=...` anywhere: its value runs to the next `&` (as in a query string) or the end.
    for (eq, _) in rest.match_indices('=') {
        let key_start = rest[..eq].trim_end_matches(|c: char| c.is_ascii_alphanumeric() || "_-.%".contains(c)).len();
        if is_secret_key(&rest[key_start..eq]) {
            let end = rest[eq + 1..].find('&').map_or(rest.len(), |i| eq + 1 + i);
            secrets.push(start + eq + 1..start + end);
        }
    }
    secrets
}

/// Whether a parameter of this name (percent-encoded or not) holds a secret.
fn is_secret_key(key: &str) -> bool {
    let key = percent_decode_str(key).decode_utf8_lossy().to_ascii_lowercase();
    ["pass", "pwd", "secret"].iter().any(|word| key.contains(word))
}

/// The secrets of a `key=value` connection string: the value of every secret key and, from the
/// first pair that does not parse, the rest when it could hold one.
fn key_value_secrets(s: &str) -> Vec<Range<usize>> {
    let (pairs, unparsed) = key_value_pairs(s);
    let mut secrets: Vec<_> = pairs.into_iter().filter(|p| is_secret_key(&s[p.key.clone()])).map(|p| p.value).collect();
    let rest = &s[unparsed..];
    if is_secret_key(rest) || rest.find(':').is_some_and(|colon| rest[colon..].contains('@')) {
        secrets.push(unparsed..s.len());
    }
    secrets
}

/// One `key = value` pair of a `key=value` connection string.
struct Pair {
    key: Range<usize>,
    /// The value as written, quotes included.
    value: Range<usize>,
}

/// The pairs of `s` read as tokio-postgres reads them (separated by whitespace, spaces allowed
/// around `=`, values bare with `\` escaping the next character, or single-quoted), and where
/// the first pair that does not parse starts (`s.len()` when every one does).
fn key_value_pairs(s: &str) -> (Vec<Pair>, usize) {
    let skip_whitespace = |pos: usize| s[pos..].find(|c: char| !c.is_whitespace()).map_or(s.len(), |i| pos + i);
    let mut pairs = Vec::new();
    let mut pos = skip_whitespace(0);
    while pos < s.len() {
        let key_end = s[pos..].find(|c: char| c.is_whitespace() || c == '=').map_or(s.len(), |i| pos + i);
        let eq = skip_whitespace(key_end);
        if key_end == pos || !s[eq..].starts_with('=') {
            break;
        }
        let value_start = skip_whitespace(eq + 1);
        let Some(value_end) = value_end(s, value_start) else { break };
        pairs.push(Pair { key: pos..key_end, value: value_start..value_end });
        pos = skip_whitespace(value_end);
    }
    (pairs, pos)
}

/// Where the value starting at `start` ends, or `None` if it is empty or its quote is not closed.
fn value_end(s: &str, start: usize) -> Option<usize> {
    let quoted = s[start..].starts_with('\'');
    let mut chars = s[start..].char_indices().skip(usize::from(quoted));
    while let Some((i, c)) = chars.next() {
        if c == '\\' {
            chars.next();
        } else if quoted && c == '\'' {
            return Some(start + i + 1);
        } else if !quoted && c.is_whitespace() {
            return Some(start + i);
        }
    }
    (!quoted && start < s.len()).then_some(s.len())
}

/// `s` with each of `ranges` replaced by `with`, once for ranges that overlap or touch.
fn replace(s: &str, ranges: Vec<Range<usize>>, with: &str) -> String {
    let mut hidden = vec![false; s.len()];
    for range in ranges {
        hidden[range].fill(true);
    }
    let mut out = String::with_capacity(s.len());
    for (i, c) in s.char_indices() {
        if !hidden[i] {
            out.push(c);
        } else if i == 0 || !hidden[i - 1] {
            out += with;
        }
    }
    out
}

/// A URL in tokio-postgres's reading (user info up to the first `@`, host up to the next `/`
/// or `?`, the database up to `?`, then `&`-separated parameters) with the database replaced.
fn url_with_database(raw: &str, prefix: usize, name: &str) -> String {
    let rest = &raw[prefix..];
    let host_start = rest.find('@').map_or(0, |at| at + 1);
    let host_end = rest[host_start..].find(['/', '?']).map_or(rest.len(), |i| host_start + i);
    let encoded = utf8_percent_encode(name, NOT_UNRESERVED).to_string();
    let mut out = format!("{}/{encoded}", &raw[..prefix + host_end]);
    if let Some((_, query)) = rest[host_end..].split_once('?') {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((key, _)) if percent_decode_str(key).decode_utf8_lossy() == "dbname" => format!("{key}={encoded}"),
                _ => param.to_owned(),
            })
            .collect();
        out = format!("{out}?{}", params.join("&"));
    }
    out
}

/// A `key=value` string with the value of every `dbname` pair replaced, or one added.
fn key_value_with_database(raw: &str, name: &str) -> String {
    let quoted = if !name.is_empty() && !name.contains(|c: char| c.is_whitespace() || c == '\'' || c == '\\') {
        name.to_owned()
    } else {
        format!("'{}'", name.replace('\\', "\\\\").replace('\'', "\\'"))
    };
    let (pairs, _) = key_value_pairs(raw);
    let dbnames: Vec<_> = pairs.into_iter().filter(|p| &raw[p.key.clone()] == "dbname").map(|p| p.value).collect();
    if dbnames.is_empty() {
        return format!("{raw} dbname={quoted}");
    }
    replace(raw, dbnames, &quoted)
}

/// `error: cause: cause's cause`, each message once (many errors repeat their cause's).
pub(crate) fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let message = cause.to_string();
        if !text.contains(&message) {
            text += ": ";
            text += &message;
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each password form, masked to exactly this.
    const FORMS: &[(&str, &str)] = &[
        ("postgres://app:s3cret@db:5432/app", "postgres://app:***@db:5432/app"),
        ("postgresql://app:s3cret@db/app?sslmode=disable", "postgresql://app:***@db/app?sslmode=disable"),
        ("postgres://app@db/app?password=s3cret", "postgres://app@db/app?password=***"),
        (
            "postgres://app@db/app?sslmode=disable&password=s3cret&application_name=x",
            "postgres://app@db/app?sslmode=disable&password=***&application_name=x",
        ),
        ("postgres://app@db/app?pass%77ord=s3cret", "postgres://app@db/app?pass%77ord=***"),
        ("host=db user=app password=s3cret dbname=app", "host=db user=app password=*** dbname=app"),
        ("host=db user=app password = s3cret", "host=db user=app password = ***"),
        ("host=db password='s3cret with spaces' dbname=app", "host=db password=*** dbname=app"),
        (r"host=db password='s3cret \' quoted' dbname=app", "host=db password=*** dbname=app"),
        (r"host=db password=s3cret\ escaped dbname=app", "host=db password=*** dbname=app"),
        ("amqp://guest:s3cret@rabbit:5672/%2f", "amqp://guest:***@rabbit:5672/%2f"),
        ("amqps://guest:s3cret@rabbit/%2f?heartbeat=10", "amqps://guest:***@rabbit/%2f?heartbeat=10"),
        ("amqp://guest@rabbit/%2f?password=s3cret&heartbeat=10", "amqp://guest@rabbit/%2f?password=***&heartbeat=10"),
    ];

    #[test]
    fn every_password_form_is_masked_exactly() {
        for (raw, masked) in FORMS {
            assert_eq!(mask_url(raw), *masked, "{raw}");
        }
    }

    #[test]
    fn parsed_connection_strings_display_and_debug_masked() {
        for (raw, masked) in FORMS.iter().filter(|(raw, _)| !raw.starts_with("amqp")) {
            let parsed = ConnectionString::parse(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(parsed.to_string(), *masked);
            assert_eq!(format!("{parsed:?}"), format!("ConnectionString({masked:?})"));
            assert_eq!(parsed.expose(), *raw);
        }
    }

    #[test]
    fn strings_without_a_password_are_unchanged() {
        for raw in [
            "postgres://root@127.0.0.1:5432/test",
            "postgres://h:5432/db?sslmode=disable",
            "host=db user=app dbname=app",
            "amqp://rabbit:5672/%2f",
        ] {
            assert_eq!(mask_url(raw), raw);
        }
    }

    #[test]
    fn passwords_that_break_the_url_syntax_stay_hidden() {
        for (raw, masked) in [
            ("postgres://app:pa/ss@db/app", "postgres://app:***@db/app"),
            ("postgres://app:pa?ss@db/app", "postgres://app:***@db/app"),
            ("postgres://app:p@ss@db/app", "postgres://app:***@db/app"),
            ("amqp://guest:pa/ss@rabbit/%2f", "amqp://guest:***@rabbit/%2f"),
            ("amqp:guest:s3cret@rabbit", "amqp:guest:***@rabbit"),
            (
                "postgres://app@db/app?password=s3cret&application_name=me@host",
                "postgres://app@db/app?password=***&application_name=me@host",
            ),
            ("mysql://db password=s3cret", "mysql://db password=***"),
        ] {
            assert_eq!(mask_url(raw), masked, "{raw}");
        }
    }

    #[test]
    fn key_value_strings_are_masked_from_the_first_pair_that_does_not_parse() {
        for (raw, masked) in [
            ("host=db password s3cret", "host=db ***"),
            ("host=db password='s3cret", "host=db ***"),
            ("host=db password=", "host=db ***"),
            // A `user:password@` shape, a URL's with its scheme mistyped.
            ("//app:s3cret@db/app", "***"),
            ("postgres//app:s3cret@db/app", "***"),
            ("host=db postgres//app:s3cret@db/app", "host=db ***"),
            // Nothing that could be a password: shown as typed, so the user sees the mistake.
            ("not a url", "not a url"),
            ("host=db port 5432", "host=db port 5432"),
        ] {
            assert_eq!(mask_url(raw), masked, "{raw}");
        }
    }

    #[test]
    fn malformed_strings_are_refused_without_a_character_of_their_password() {
        for (raw, message) in [
            (
                "postgres://admin:s3cret@127.0.0.1:port/app",
                r#"malformed database URL "postgres://admin:***@127.0.0.1:port/app": invalid connection string: invalid value for option `port`"#,
            ),
            (
                "postgres://admin@127.0.0.1:port/app?password=s3cret",
                r#"malformed database URL "postgres://admin@127.0.0.1:port/app?password=***": invalid connection string: invalid value for option `port`"#,
            ),
            (
                "host=127.0.0.1 port=x password=s3cret",
                r#"malformed database URL "host=127.0.0.1 port=x password=***": invalid connection string: invalid value for option `port`"#,
            ),
            (
                "host=127.0.0.1 port=x password='s3cret word'",
                r#"malformed database URL "host=127.0.0.1 port=x password=***": invalid connection string: invalid value for option `port`"#,
            ),
            (
                "host=127.0.0.1 password s3cret",
                r#"malformed database URL "host=127.0.0.1 ***": invalid connection string: unexpected character at byte 24: expected `=`"#,
            ),
            ("user=app password=s3cret", r#"malformed database URL "user=app password=***": it names no host"#),
        ] {
            let e = ConnectionString::parse(raw).unwrap_err();
            let hint = " (expected postgres://user:password@host:port/database or key=value pairs: host=... user=... password=... dbname=...)";
            assert_eq!(e.to_string(), format!("{message}{hint}"), "{raw}");
            assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");
        }
    }

    /// The two messages users hit most: input shown as typed (password masked), and a URL of
    /// another scheme named as such rather than as the driver's key=value reading of it.
    #[test]
    fn refusals_show_the_input_and_name_a_wrong_scheme() {
        let e = ConnectionString::parse("not a url").unwrap_err();
        assert_eq!(
            e.to_string(),
            "malformed database URL \"not a url\": invalid connection string: unexpected character at byte 4: \
             expected `=` (expected postgres://user:password@host:port/database or key=value pairs: host=... \
             user=... password=... dbname=...)"
        );
        assert_eq!(e.masked(), "not a url");
        for (raw, masked, scheme) in [
            ("mysql://u:secret@h/db", "mysql://u:***@h/db", "mysql"),
            ("mysql://u:pa/ss@h/db", "mysql://u:***@h/db", "mysql"),
            ("POSTGRES://u:secret@h/db", "POSTGRES://u:***@h/db", "POSTGRES"),
            ("localhost:5432/app", "localhost:5432/app", "localhost"),
        ] {
            let e = ConnectionString::parse(raw).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "database URL {masked:?} has scheme {scheme:?}; expected postgres:// or postgresql:// \
                     (or key=value pairs: host=... user=... dbname=...)"
                )
            );
            assert_eq!(e.masked(), masked);
            assert!(!format!("{e:?}").contains("secret") && !format!("{e:?}").contains("pa/ss"), "{e:?}");
        }
    }

    #[test]
    fn with_database_changes_the_database_and_nothing_else() {
        for (raw, expected) in [
            (
                "postgres://app:s3cret@db:5432/app?sslmode=disable",
                "postgres://app:s3cret@db:5432/other%20db?sslmode=disable",
            ),
            ("postgresql://app@db", "postgresql://app@db/other%20db"),
            ("postgres://app@db?application_name=x", "postgres://app@db/other%20db?application_name=x"),
            ("postgres://app@/app?host=127.0.0.1&port=5433", "postgres://app@/other%20db?host=127.0.0.1&port=5433"),
            ("postgres://app@db/app?dbname=third&user=me", "postgres://app@db/other%20db?dbname=other%20db&user=me"),
            ("postgres://app:p@ss@db/app", "postgres://app:p@ss@db/other%20db"),
            ("host=db user=app dbname=app application_name=x", "host=db user=app dbname='other db' application_name=x"),
            ("host=db user=app", "host=db user=app dbname='other db'"),
            ("host=db dbname = 'app' password='a b'", "host=db dbname = 'other db' password='a b'"),
        ] {
            let original = ConnectionString::parse(raw).unwrap();
            let other = original.with_database("other db");
            assert_eq!(other.expose(), expected, "{raw}");
            let mut config = original.config().clone();
            config.dbname("other db");
            assert_eq!(other.config(), &config, "{raw}");
            assert_eq!(ConnectionString::parse(other.expose()).unwrap().config(), &config, "{raw} reparsed");
            assert_eq!(other.database(), Some("other db"));
        }
        let quoted = ConnectionString::parse("host=db").unwrap().with_database(r"it's \ odd");
        assert_eq!(quoted.expose(), r"host=db dbname='it\'s \\ odd'");
        assert_eq!(ConnectionString::parse(quoted.expose()).unwrap().database(), Some(r"it's \ odd"));
    }

    /// A failover-ready string lists every server (`target_session_attrs=read-write` picks the
    /// primary): masked, parsed and rewritten like a single host's, in both forms.
    #[test]
    fn multi_host_strings_are_masked_and_rewritten_like_single_host_ones() {
        for (raw, masked, other) in [
            (
                "postgres://app:s3cret@db1:5432,db2:5433/app?target_session_attrs=read-write",
                "postgres://app:***@db1:5432,db2:5433/app?target_session_attrs=read-write",
                "postgres://app:s3cret@db1:5432,db2:5433/other?target_session_attrs=read-write",
            ),
            (
                "postgres://app@db1,db2/app?password=s3cret&target_session_attrs=read-write",
                "postgres://app@db1,db2/app?password=***&target_session_attrs=read-write",
                "postgres://app@db1,db2/other?password=s3cret&target_session_attrs=read-write",
            ),
            (
                "host=db1,db2 port=5432,5433 user=app password=s3cret dbname=app target_session_attrs=read-write",
                "host=db1,db2 port=5432,5433 user=app password=*** dbname=app target_session_attrs=read-write",
                "host=db1,db2 port=5432,5433 user=app password=s3cret dbname=other target_session_attrs=read-write",
            ),
        ] {
            let parsed = ConnectionString::parse(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(parsed.config().get_hosts().len(), 2, "{raw}");
            assert_eq!(
                parsed.config().get_target_session_attrs(),
                tokio_postgres::config::TargetSessionAttrs::ReadWrite
            );
            assert_eq!(parsed.to_string(), masked);
            assert_eq!(format!("{parsed:?}"), format!("ConnectionString({masked:?})"));
            let moved = parsed.with_database("other");
            assert_eq!(moved.expose(), other, "{raw}");
            assert!(!moved.to_string().contains("s3cret"), "{moved}");
        }
    }

    /// A URL must name its database; pairs keep libpq's default, the user's name, on purpose.
    #[test]
    fn a_url_that_names_no_database_is_refused_with_the_fix() {
        for (raw, database) in [
            ("postgres://app@db:5432/app", "app"),
            ("postgres://app@db:5432/?dbname=billing", "billing"),
            ("postgresql://app@db?dbname=billing&sslmode=disable", "billing"),
            ("host=db user=app", "app"),
            ("host=db user=app dbname=billing", "billing"),
        ] {
            assert_eq!(ConnectionString::parse(raw).unwrap().require_database(), Ok(database), "{raw}");
        }
        for (raw, message) in [
            (
                "postgres://root@127.0.0.1:5432/",
                r#"database URL "postgres://root@127.0.0.1:5432/" names no database (PostgreSQL would use the one named after the user, "root"): name it in the path, postgres://root@127.0.0.1:5432/DATABASE (or with ?dbname=DATABASE)"#,
            ),
            (
                "postgres://app:s3cret@db?sslmode=disable",
                r#"database URL "postgres://app:***@db?sslmode=disable" names no database (PostgreSQL would use the one named after the user, "app"): name it in the path, postgres://app:***@db/DATABASE?sslmode=disable (or with ?dbname=DATABASE)"#,
            ),
            (
                "host=db password=s3cret",
                r#"database URL "host=db password=***" names no database and no user: add dbname=DATABASE"#,
            ),
        ] {
            let e = ConnectionString::parse(raw).unwrap().require_database().unwrap_err();
            assert_eq!(e.to_string(), message, "{raw}");
            assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");
        }
    }

    #[test]
    fn the_database_defaults_to_the_user() {
        assert_eq!(ConnectionString::parse("postgres://app@db").unwrap().database(), Some("app"));
        assert_eq!(ConnectionString::parse("host=db user=app dbname=x").unwrap().database(), Some("x"));
        assert_eq!(ConnectionString::parse("host=db").unwrap().database(), None);
    }
}
