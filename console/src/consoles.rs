//! [`Consoles`]: the consoles of several outboxes under one scope, with a picker.

use std::sync::{Arc, RwLock};

use actix_web::dev::HttpServiceFactory;
use actix_web::{FromRequest, HttpRequest, web};

use crate::Console;

/// The consoles of several outboxes (one a tenant schema, one a module) under one scope:
/// `GET /` lists every outbox with its figures, and each outbox's console lives under
/// `/{outbox}/` with every page of [`Console::scope`], its navigation holding a picker of the
/// others. Outboxes can be added and removed while the server runs (a relay that discovers
/// new tenant schemas); clones share the list.
///
/// Each outbox keeps its own console: its own pool, dispatcher, FIFO gate, token and operator
/// sessions (a login opens the repairs of that outbox alone).
///
/// ```no_run
/// # async fn f(a: actix_outbox::PgPool, b: actix_outbox::PgPool) -> std::io::Result<()> {
/// use actix_outbox_console::{Console, Consoles};
/// use actix_web::{App, HttpServer};
///
/// let consoles = Consoles::new();
/// consoles.insert("tenant_a.outbox", Console::new(a).source("tenant_a"));
/// consoles.insert("tenant_b.outbox", Console::new(b).source("tenant_b"));
/// // /outbox/ lists both, /outbox/tenant_a.outbox/ is tenant_a's overview.
/// HttpServer::new(move || App::new().service(consoles.scope("/outbox")))
///     .bind("127.0.0.1:8080")?
///     .run()
///     .await
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Consoles {
    outboxes: Arc<RwLock<Vec<Entry>>>,
}

/// One outbox of a [`Consoles`].
#[derive(Clone)]
struct Entry {
    name: String,
    /// The path segment it is served under.
    slug: String,
    console: Console,
}

impl std::fmt::Debug for Consoles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consoles").field("outboxes", &self.names()).finish()
    }
}

/// The path segment of an outbox named `name`: its name with every character but ASCII
/// letters, digits, `.`, `_` and `-` replaced by `-` (`tenant_a.outbox` stays itself).
fn slug_of(name: &str) -> String {
    let slug: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '-' }).collect();
    // `.` and `..` are not segments a browser keeps.
    if slug.is_empty() || slug.chars().all(|c| c == '.') { format!("outbox{slug}") } else { slug }
}

impl Consoles {
    /// No outbox yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the console of the outbox `name`, or replaces the one of that name; in a running
    /// server at once. It is served under `/{name}/` (characters other than ASCII letters,
    /// digits, `.`, `_` and `-` become `-`, and a segment another outbox has already gets a
    /// suffix `-2`, `-3`, ...). The picker lists outboxes in the order they were added.
    pub fn insert(&self, name: impl Into<String>, console: Console) {
        let name = name.into();
        console.start_sampler();
        let mut outboxes = self.outboxes.write().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = outboxes.iter_mut().find(|e| e.name == name) {
            entry.console = console;
            return;
        }
        let base = slug_of(&name);
        let mut slug = base.clone();
        for n in 2.. {
            if !outboxes.iter().any(|e| e.slug == slug) {
                break;
            }
            slug = format!("{base}-{n}");
        }
        outboxes.push(Entry { name, slug, console });
    }

    /// Removes the console of the outbox `name` (its pages answer 404 from then on); whether
    /// there was one.
    pub fn remove(&self, name: &str) -> bool {
        let mut outboxes = self.outboxes.write().unwrap_or_else(|e| e.into_inner());
        let before = outboxes.len();
        outboxes.retain(|e| e.name != name);
        outboxes.len() != before
    }

    /// The outboxes' names, in the picker's order.
    pub fn names(&self) -> Vec<String> {
        self.entries().into_iter().map(|e| e.name).collect()
    }

    /// The list of outboxes at `path` (`"/outbox"`, or `""` for the root) and each one's console
    /// under it, for `App::service`. Call it in the `HttpServer` factory on a clone of one
    /// `Consoles`.
    pub fn scope(&self, path: &str) -> impl HttpServiceFactory + 'static {
        for entry in self.entries() {
            entry.console.start_sampler();
        }
        crate::list_routes(
            web::scope(path).app_data(web::Data::new(Mount::Many(self.clone()))).wrap(crate::security_headers()),
        )
    }

    fn entries(&self) -> Vec<Entry> {
        self.outboxes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every outbox as `(name, slug, console)`, for the list.
    pub(crate) fn all(&self) -> Vec<(String, String, Console)> {
        self.entries().into_iter().map(|e| (e.name, e.slug, e.console)).collect()
    }

    /// The picker with `current` (a slug) picked, and the console of that outbox.
    fn pick(&self, current: &str) -> Option<(Console, Picker)> {
        let entries = self.entries();
        let picked = entries.iter().find(|e| e.slug == current)?;
        let (console, current) = (picked.console.clone(), Some(picked.name.clone()));
        Some((console, Picker { current, ..Picker::of(entries) }))
    }

    /// The picker of the list itself (no outbox picked).
    pub(crate) fn picker(&self) -> Picker {
        Picker::of(self.entries())
    }
}

/// How the console's routes were mounted: the scope's app data, of a type of this crate's own
/// so that no application's data can stand in for it.
pub(crate) enum Mount {
    /// [`Console::scope`].
    One(Box<Console>),
    /// [`Consoles::scope`]: the outbox is the `{outbox}` segment.
    Many(Consoles),
}

/// The other outboxes of a [`Consoles`], shown in every page's navigation.
pub(crate) struct Picker {
    /// The name of the outbox whose page this is; `None` on the list.
    pub(crate) current: Option<String>,
    /// Every outbox as `(name, slug)`.
    pub(crate) outboxes: Vec<(String, String)>,
}

impl Picker {
    /// Every outbox of `entries`, none picked.
    fn of(entries: Vec<Entry>) -> Picker {
        Picker { current: None, outboxes: entries.into_iter().map(|e| (e.name, e.slug)).collect() }
    }
}

/// The console a request is for, with the picker when it is one of several: what every
/// handler of [`crate::routes`] takes.
pub(crate) struct Mounted {
    pub(crate) console: Console,
    pub(crate) picker: Option<Picker>,
}

impl std::ops::Deref for Mounted {
    type Target = Console;

    fn deref(&self) -> &Console {
        &self.console
    }
}

impl FromRequest for Mounted {
    type Error = actix_web::Error;
    type Future = std::future::Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        std::future::ready(match req.app_data::<web::Data<Mount>>().map(|m| m.get_ref()) {
            Some(Mount::One(console)) => Ok(Mounted { console: Console::clone(console), picker: None }),
            Some(Mount::Many(consoles)) => {
                let slug = req.match_info().get("outbox").unwrap_or_default();
                match consoles.pick(slug) {
                    Some((console, picker)) => Ok(Mounted { console, picker: Some(picker) }),
                    None => Err(actix_web::error::ErrorNotFound(format!("no outbox {slug:?} in this console"))),
                }
            }
            None => Err(actix_web::error::ErrorInternalServerError("the console's routes are mounted without it")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::slug_of;

    #[test]
    fn slugs_keep_plain_names_and_replace_the_rest() {
        assert_eq!(slug_of("tenant_a.outbox"), "tenant_a.outbox");
        assert_eq!(slug_of("db 1/public.outbox"), "db-1-public.outbox");
        assert_eq!(slug_of(".."), "outbox..");
        assert_eq!(slug_of(""), "outbox");
    }
}
