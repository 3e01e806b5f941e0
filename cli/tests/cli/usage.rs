//! Exit code 2: usage errors and bad input.

use std::process::Command;

use actix_outbox_test_support::TestDb;

use crate::common::*;

#[tokio::test]
async fn malformed_durations_exit_2_and_change_nothing() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    execute(&db, "UPDATE outbox SET status = 'done', done_at = now() - interval '30 days'").await;
    let before = db.rows().await;
    for args in [
        &["purge", "--older-than", "7x"][..],
        &["purge", "--older-than=-5m"],
        &["purge", "--older-than", ""],
        &["run", "--lease", "soon"],
        &["run", "--publish-timeout", "10"],
        &["run", "--poll-interval", "5 parsecs"],
    ] {
        let ran = cli(&db.url, args).await;
        assert_eq!(ran.code, 2, "{args:?}: {ran:?}");
        assert!(ran.error_line().starts_with("error: invalid value"), "{args:?}: {ran:?}");
    }
    // Well-formed durations that cannot work together are bad input too.
    let ran = cli(&db.url, &["run", "--lease", "5s", "--publish-timeout", "10s"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    assert!(ran.error_line().contains("publish timeout"), "{ran:?}");
    assert_eq!(db.rows().await, before);
}

#[tokio::test]
async fn malformed_urls_exit_2_with_the_password_masked_and_change_nothing() {
    let db = TestDb::new().await;
    db.seed(3, "agg").await;
    let before = db.rows().await;
    for (url, command) in [
        ("not a url", &["stats"][..]),
        ("mysql://root@127.0.0.1/app", &["dead", "retry", "--all"]),
        ("postgres://admin:s3cret@127.0.0.1:port/app", &["purge", "--older-than", "0s"]),
        // A key=value string is a connection string too: this one is malformed (port=x).
        ("host=127.0.0.1 port=x password=s3cret", &["run"]),
    ] {
        let ran = cli(url, command).await;
        assert_eq!(ran.code, 2, "{url}: {ran:?}");
        let line = ran.error_line();
        assert!(line.starts_with("error: malformed database URL") || line.starts_with("error: database URL"), "{line}");
        assert!(!line.contains("s3cret"), "password leaked: {line}");
    }
    let ran = cli(&db.url, &["run", "--amqp-url", "amqp://guest:s3cret@127.0.0.1:port/%2f"]).await;
    assert_eq!(ran.code, 2, "{ran:?}");
    let line = ran.error_line();
    assert!(line.contains("malformed AMQP URL") && line.contains("guest:***@"), "{line}");
    assert!(!line.contains("s3cret"), "password leaked: {line}");
    assert_eq!(db.rows().await, before, "run with a bad broker URL must not claim anything");
}

/// The input is shown as typed, password masked (`not a url` used to be all `***`), and a URL of
/// another scheme is named as such (it used to be the driver's "unexpected EOF").
#[tokio::test]
async fn refused_database_urls_show_what_was_typed_and_name_a_wrong_scheme() {
    for (url, line) in [
        (
            "not a url",
            "error: malformed database URL \"not a url\": invalid connection string: unexpected character at byte 4: \
             expected `=` (expected postgres://user:password@host:port/database or key=value pairs: host=... user=... \
             password=... dbname=...)",
        ),
        (
            "mysql://u:secret@h/db",
            "error: database URL \"mysql://u:***@h/db\" has scheme \"mysql\"; expected postgres:// or postgresql:// \
             (or key=value pairs: host=... user=... dbname=...)",
        ),
    ] {
        let ran = cli("postgres://root@127.0.0.1:1/unused", &["stats", "--database-url", url]).await;
        assert_eq!((ran.code, ran.error_line(), ran.stdout.as_str()), (2, line, ""), "{url}");
    }
}

/// Each password form in a malformed string (the port is not a number): exit 2, exactly this
/// line, nothing on stdout.
#[tokio::test]
async fn malformed_connection_strings_exit_2_with_the_password_masked_in_every_form() {
    let hint = " (expected postgres://user:password@host:port/database or key=value pairs: host=... user=... \
                password=... dbname=...)";
    for (url, masked) in [
        ("postgres://admin:s3cret@127.0.0.1:port/app", "postgres://admin:***@127.0.0.1:port/app"),
        ("postgres://admin@127.0.0.1:port/app?password=s3cret", "postgres://admin@127.0.0.1:port/app?password=***"),
        (
            "host=127.0.0.1 port=x user=admin password=s3cret dbname=app",
            "host=127.0.0.1 port=x user=admin password=*** dbname=app",
        ),
        (
            "host=127.0.0.1 port=x user=admin password='s3cret word' dbname=app",
            "host=127.0.0.1 port=x user=admin password=*** dbname=app",
        ),
    ] {
        for command in [&["migrate"][..], &["run"], &["stats"]] {
            let ran = cli(url, command).await;
            assert_eq!(ran.code, 2, "{url} {command:?}: {ran:?}");
            assert_eq!(
                ran.error_line(),
                format!(
                    "error: malformed database URL \"{masked}\": invalid connection string: invalid value for option `port`{hint}"
                ),
                "{command:?}"
            );
            assert_eq!(ran.stdout, "", "{command:?}");
        }
    }
    for (amqp, masked) in [
        ("amqp://guest:s3cret@127.0.0.1:port/%2f", "amqp://guest:***@127.0.0.1:port/%2f"),
        ("amqp://guest@127.0.0.1:port/%2f?password=s3cret", "amqp://guest@127.0.0.1:port/%2f?password=***"),
    ] {
        let ran = cli("postgres://root@127.0.0.1:1/unused", &["run", "--amqp-url", amqp]).await;
        assert_eq!(ran.code, 2, "{ran:?}");
        assert_eq!(
            ran.error_line(),
            format!("error: invalid RabbitMQ sink configuration: malformed AMQP URL \"{masked}\": invalid port number")
        );
        assert_eq!(ran.stdout, "");
    }
}

#[tokio::test]
async fn usage_errors_exit_2_on_one_line() {
    let db = TestDb::new().await;
    for (args, says) in [
        (&["stats", "--jsno"][..], "unexpected argument '--jsno'"),
        (&["vacuum"], "unrecognized subcommand 'vacuum'"),
        (&["dead", "retry"], "required arguments were not provided"),
        (&["dead", "retry", "1", "--all"], "cannot be used with"),
        (&["dead", "retry", "one"], "invalid value 'one'"),
        (&["dead", "list", "--limit", "0"], "invalid value '0'"),
        (&["run", "--workers", "0"], "workers must be at least 1"),
        (&["run", "--max-rate", "0"], "max rate must be a number of messages a second above zero, not 0"),
        (&["run", "--max-rate=-5"], "max rate must be a number of messages a second above zero, not -5"),
        (&["run", "--max-rate", "fast"], "invalid value 'fast' for '--max-rate <N>'"),
        (&["run", "--fifo", "order.created,,order.paid"], "--fifo: empty event type"),
        (&["stats", "--fifo", "order.created,"], "--fifo: empty event type"),
        (&["dead", "blocked", "--fifo", ","], "--fifo: empty event type"),
        (&["dead", "blocked", "--fifo", "--limit", "0"], "invalid value '0'"),
        (&["dead", "blocked"], "required arguments were not provided: --fifo"),
    ] {
        let ran = cli(&db.url, args).await;
        assert_eq!(ran.code, 2, "{args:?}: {ran:?}");
        assert!(ran.error_line().contains(says), "{args:?}: {ran:?}");
    }
    let ran = cli(&db.url, &["stats"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let mut no_url = Command::new(BIN);
    no_url.env_remove("DATABASE_URL").arg("stats");
    let output = tokio::task::spawn_blocking(move || no_url.output()).await.unwrap().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--database-url <URL>"));
}

#[tokio::test]
async fn every_command_explains_itself_with_an_example() {
    for command in [
        &["migrate"][..],
        &["run"],
        &["stats"],
        &["dead", "list"],
        &["dead", "retry"],
        &["dead", "skip"],
        &["dead", "blocked"],
        &["purge"],
        &["enqueue"],
    ] {
        let mut args = command.to_vec();
        args.push("--help");
        let ran = cli("postgres://unused@127.0.0.1:1/unused", &args).await;
        assert_eq!(ran.code, 0, "{args:?}: {ran:?}");
        let example = format!("actix-outbox {}", command.join(" "));
        assert!(
            ran.stdout.contains("Example") && ran.stdout.contains(&example),
            "{args:?} has no example:\n{}",
            ran.stdout
        );
        assert!(ran.stdout.contains("DATABASE_URL"), "{args:?}");
    }
}
