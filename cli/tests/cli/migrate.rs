//! `migrate` and `migrate --inbox`.

use std::collections::BTreeSet;

use actix_outbox_test_support::{ScratchDb, database_exists};
use diesel::sql_types::Text;
use diesel_async::RunQueryDsl;

use crate::common::*;

#[tokio::test]
async fn migrate_creates_the_database_applies_migrations_and_is_idempotent() {
    let db = ScratchDb::new();
    let first = ok(&db.url, &["migrate"]).await;
    assert!(first.contains(&format!("created database {}", db.name)), "{first}");
    let applied: Vec<&str> = first.lines().filter(|l| l.starts_with("applied migration ")).collect();
    let embedded =
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::admin::MIGRATIONS).unwrap();
    assert_eq!(applied.len(), embedded.len(), "{first}");

    let second = ok(&db.url, &["migrate"]).await;
    assert_eq!(second.trim(), format!("database {} is up to date: no pending migrations", db.name));

    // The table is there and usable.
    let id: i64 = ok(
        &db.url,
        &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    )
    .await
    .trim()
    .parse()
    .unwrap();
    assert_eq!(id, 1);
}

/// What a first `migrate` of database `name` prints: the database, then every migration.
fn first_migrate_output(name: &str) -> String {
    use diesel::migration::{Migration, MigrationSource};
    let embedded = MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::admin::MIGRATIONS).unwrap();
    let mut out = format!("created database {name}\n");
    for migration in embedded {
        out += &format!("applied migration {}\n", migration.name().version());
    }
    out
}

/// `migrate` reaches the server's `postgres` database with every option of the string: here
/// the host and port are only in the pairs, or in the URL's query (a URL cut down to
/// `postgres://root@/postgres` reaches nothing).
#[tokio::test]
async fn migrate_creates_the_database_of_a_key_value_string_or_of_a_url_with_its_host_in_the_query() {
    // The server of the default TEST_DATABASE_URL, spelled out (root, trust auth).
    for form in ["pairs", "url"] {
        let db = ScratchDb::new();
        let url = match form {
            "pairs" => format!("host=127.0.0.1 port=5432 user=root dbname={} application_name='outbox it'", db.name),
            _ => format!("postgres://root@/{}?host=127.0.0.1&port=5432&application_name=outbox-it", db.name),
        };
        assert_eq!(ok(&url, &["migrate"]).await, first_migrate_output(&db.name), "{form}");
        assert_eq!(
            ok(&url, &["migrate"]).await,
            format!("database {} is up to date: no pending migrations\n", db.name),
            "{form}"
        );
        let id = ok(
            &url,
            &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
        )
        .await;
        assert_eq!(id, "1\n", "{form}");
    }
}

/// The public tables of the database at `url`, by name.
async fn tables(url: &str) -> BTreeSet<String> {
    use diesel_async::AsyncConnection;
    #[derive(diesel::QueryableByName)]
    struct Table {
        #[diesel(sql_type = Text)]
        name: String,
    }
    let mut conn = diesel_async::AsyncPgConnection::establish(url).await.unwrap();
    let sql = "SELECT table_name::text AS name FROM information_schema.tables \
               WHERE table_schema = 'public' AND table_name <> '__diesel_schema_migrations'";
    let rows: Vec<Table> = diesel::sql_query(sql).load(&mut conn).await.unwrap();
    rows.into_iter().map(|t| t.name).collect()
}

/// `migrate --inbox` creates the database if needed and installs only the inbox; a plain
/// `migrate` afterwards installs the outbox beside it; neither run disturbs the other's
/// migrations, and `--help` documents the flag.
#[tokio::test]
async fn migrate_inbox_installs_only_the_inbox_and_leaves_the_outbox_to_plain_migrate() {
    let db = ScratchDb::new();
    let first = ok(&db.url, &["migrate", "--inbox"]).await;
    assert!(first.contains(&format!("created database {}", db.name)), "{first}");
    let applied: Vec<&str> = first.lines().filter(|l| l.starts_with("applied migration ")).collect();
    let inbox =
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::inbox::INBOX_MIGRATIONS)
            .unwrap();
    assert_eq!(applied.len(), inbox.len(), "{first}");
    assert_eq!(applied, ["applied migration 20261201900001", "applied migration 20261202900002"]);
    let inbox_tables = BTreeSet::from(["inbox".to_owned(), "inbox_aggregates".to_owned()]);
    assert_eq!(tables(&db.url).await, inbox_tables, "only the inbox");

    let again = ok(&db.url, &["migrate", "--inbox"]).await;
    assert_eq!(again.trim(), format!("database {} is up to date: no pending inbox migrations", db.name));

    let outbox = ok(&db.url, &["migrate"]).await;
    let embedded =
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&actix_outbox::admin::MIGRATIONS).unwrap();
    assert_eq!(outbox.lines().filter(|l| l.starts_with("applied migration ")).count(), embedded.len(), "{outbox}");
    let mut both = inbox_tables.clone();
    both.insert("outbox".to_owned());
    both.insert("outbox_horizon".to_owned());
    assert_eq!(tables(&db.url).await, both);
    assert_eq!(
        ok(&db.url, &["migrate"]).await.trim(),
        format!("database {} is up to date: no pending migrations", db.name)
    );
    assert_eq!(
        ok(&db.url, &["migrate", "--inbox"]).await.trim(),
        format!("database {} is up to date: no pending inbox migrations", db.name)
    );

    let help = ok(&db.url, &["migrate", "--help"]).await;
    assert!(help.contains("--inbox") && help.contains("inbox_aggregates"), "{help}");
}

/// `migrate --fifo` builds the FIFO gate's index, which a plain `migrate` leaves out, once.
#[tokio::test]
async fn migrate_fifo_builds_the_gate_index_once() {
    let db = ScratchDb::new();
    let first = ok(&db.url, &["migrate"]).await;
    assert_eq!(first, first_migrate_output(&db.name));
    assert_eq!(
        ok(&db.url, &["migrate", "--fifo"]).await,
        format!(
            "database {} is up to date: no pending migrations\nbuilt the FIFO gate's index outbox_fifo_gate\n",
            db.name
        )
    );
    assert_eq!(
        ok(&db.url, &["migrate", "--fifo"]).await,
        format!("database {} is up to date: no pending migrations\nthe FIFO gate's index is there\n", db.name)
    );
}

/// A URL cut short, naming no database, is bad input for every command, with the fix named:
/// `migrate` installs nothing in the database named after the user, and `stats` does not send
/// the user to `migrate` it.
#[tokio::test]
async fn a_url_that_names_no_database_is_bad_input_with_the_fix() {
    let url = "postgres://root@127.0.0.1:5432/";
    let expected = "error: database URL \"postgres://root@127.0.0.1:5432/\" names no database (PostgreSQL would use the \
                    one named after the user, \"root\"): name it in the path, postgres://root@127.0.0.1:5432/DATABASE \
                    (or with ?dbname=DATABASE)";
    let existed = database_exists("root").await;
    for args in [&["migrate"][..], &["stats"], &["dead", "list"], &["run", "--amqp-url", "amqp://127.0.0.1:1/%2f"]] {
        let ran = cli(url, args).await;
        assert_eq!(ran.code, 2, "{args:?}: {ran:?}");
        assert_eq!(ran.error_line(), expected, "{args:?}");
    }
    assert_eq!(database_exists("root").await, existed, "nothing created");
}
