//! Which outboxes a run relays: those its flags name at start, and with `--outbox-schemas` the
//! schemas found again every `--discover-interval` ([`rediscover`]).

use tracing::{info, warn};

use super::args::RunArgs;
use super::broker::sink_of;
use super::console::console_of;
use super::relay::{Running, prepare, start_one};
use crate::{CliError, DatabaseArgs, connect, serve};
use actix_outbox::DispatcherConfig;
use actix_outbox::dispatcher::Shutdown;
use actix_outbox::sink::RabbitConfig;

/// The schemas `pattern` finds in the database of `database` (without `--schema`).
pub(super) async fn discover(database: &DatabaseArgs, pattern: &str) -> Result<Vec<String>, CliError> {
    let url = database.url()?;
    let mut conn = connect(&url).await?;
    database
        .answered(&url, actix_outbox::admin::outbox_schemas(&mut conn, pattern))
        .await?
        .map_err(|e| CliError::store(&url, e))
}

/// Every outbox to relay at start, as `(where, name)`: the schemas of `--outbox` (or those
/// `--outbox-schemas` finds) in each database, or each database's own outbox.
pub(super) async fn outboxes(args: &RunArgs) -> Result<Vec<(DatabaseArgs, Option<String>)>, CliError> {
    let mut outboxes = Vec::new();
    for database in args.database.each() {
        let schemas = match &args.outbox_schemas {
            Some(pattern) => {
                let found = discover(&database, pattern).await?;
                info!(database = %database.url()?, pattern, found = ?found,
                    "outbox schemas found; new ones are looked for every {}", args.discover_interval);
                found
            }
            None => args.outbox.clone(),
        };
        if schemas.is_empty() && args.outbox_schemas.is_none() {
            outboxes.push((database.clone(), args.name_of(&database, None)?));
        }
        for schema in schemas {
            let name = args.name_of(&database, Some(&schema))?;
            outboxes.push((in_schema(&database, &schema), name));
        }
    }
    let mut names: Vec<&String> = outboxes.iter().filter_map(|(_, name)| name.as_ref()).collect();
    names.sort();
    if let Some(twice) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(CliError::BadInput(format!(
            "two outboxes would both be named {}: give each --database-url a database of another name",
            twice[0]
        )));
    }
    Ok(outboxes)
}

/// `database` for the outbox of `schema`.
pub(super) fn in_schema(database: &DatabaseArgs, schema: &str) -> DatabaseArgs {
    DatabaseArgs { schema: Some(schema.to_owned()), ..database.clone() }
}

/// Looks for the schemas `pattern` finds now: starts a dispatcher for each new one, stops
/// those of schemas that are gone. A failure is logged and tried again at the next look.
pub(super) async fn rediscover(
    args: &RunArgs,
    pattern: &str,
    config: &DispatcherConfig,
    rabbit: &RabbitConfig,
    relayed: &serve::SupervisorSlot,
    console: Option<(&actix_outbox_console::Consoles, Option<&str>)>,
    running: &mut Vec<Running>,
) {
    let mut found = Vec::new();
    for database in args.database.each() {
        match discover(&database, pattern).await {
            Ok(schemas) => found.extend(schemas.into_iter().map(|schema| in_schema(&database, &schema))),
            Err(e) => {
                warn!(error = %e, pattern, "looking for outbox schemas failed; trying again later");
                return;
            }
        }
    }
    let same = |a: &DatabaseArgs, b: &DatabaseArgs| a.database_url == b.database_url && a.schema == b.schema;
    let (kept, gone): (Vec<Running>, Vec<Running>) =
        running.drain(..).partition(|r| found.iter().any(|f| same(f, &r.database)));
    *running = kept;
    for stopped in gone {
        info!(outbox = stopped.relayed.name.as_deref(), "its schema is gone: stopping its dispatcher");
        if let Some((consoles, _)) = console {
            consoles.remove(&stopped.name());
        }
        let _ = stopped.relayed.supervisor.send(Shutdown).await;
        stopped.sink.close().await;
        relayed.lock().unwrap_or_else(|e| e.into_inner()).retain(|r| r.supervisor != stopped.relayed.supervisor);
    }
    for database in found {
        if running.iter().any(|r| same(&r.database, &database)) {
            continue;
        }
        let name = match args.name_of(&database, database.schema.as_deref()) {
            Ok(name) => name.unwrap_or_else(|| "outbox".to_owned()),
            Err(e) => {
                warn!(error = %e, "a new outbox schema cannot be relayed");
                continue;
            }
        };
        let started = async {
            let outbox = prepare(database, config, Some(name.clone())).await?;
            let sink = sink_of(rabbit, Some(&name)).await?;
            let one = start_one(outbox, sink, relayed)?;
            if let Some((consoles, token)) = console {
                match console_of(&one, args, token, true).await {
                    Ok(page) => consoles.insert(name.clone(), page),
                    Err(e) => warn!(outbox = %name, error = %e, "the console cannot show the new outbox"),
                }
            }
            Ok::<_, CliError>(one)
        };
        match started.await {
            Ok(one) => {
                info!(outbox = %name, "new outbox schema found: relaying it");
                running.push(one);
            }
            Err(e) => {
                warn!(outbox = %name, error = %e, "a new outbox schema cannot be relayed yet; trying again later")
            }
        }
    }
}
