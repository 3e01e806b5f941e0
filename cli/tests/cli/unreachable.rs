//! Exit code 1: an unreachable database.

use crate::common::*;

#[tokio::test]
async fn an_unreachable_database_exits_1_with_one_line_that_masks_the_password() {
    let url = "postgres://admin:s3cret@127.0.0.1:1/outbox";
    for args in [
        &["migrate"][..],
        &["run"],
        &["stats"],
        &["dead", "list"],
        &["dead", "retry", "--all"],
        &["dead", "skip", "1", "--reason", "r"],
        &["dead", "blocked", "--fifo"],
        &["stats", "--fifo"],
        &["purge", "--older-than", "7d"],
        &["enqueue", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", "{}"],
    ] {
        let ran = cli(url, args).await;
        assert_eq!(ran.code, 1, "{args:?}: {ran:?}");
        let line = ran.error_line();
        assert!(
            line.starts_with("error: cannot connect to PostgreSQL at postgres://admin:***@127.0.0.1:1/outbox: ")
                && line.contains("refused"),
            "{args:?}: {line}"
        );
        assert!(!line.contains("s3cret"), "password leaked: {line}");
    }
}

/// Each password form of a database that refuses connections, for the commands that connect
/// each way (`migrate` through `ensure_database`, `run` before its pool, the one-shot commands):
/// exit 1, exactly this line.
#[tokio::test]
async fn an_unreachable_database_exits_1_with_the_password_masked_in_every_form() {
    for (url, masked) in [
        ("postgres://admin:s3cret@127.0.0.1:1/outbox", "postgres://admin:***@127.0.0.1:1/outbox"),
        ("postgres://admin@127.0.0.1:1/outbox?password=s3cret", "postgres://admin@127.0.0.1:1/outbox?password=***"),
        (
            "host=127.0.0.1 port=1 user=admin password=s3cret dbname=outbox",
            "host=127.0.0.1 port=1 user=admin password=*** dbname=outbox",
        ),
        (
            "host=127.0.0.1 port=1 user=admin password='s3cret word' dbname=outbox",
            "host=127.0.0.1 port=1 user=admin password=*** dbname=outbox",
        ),
    ] {
        for command in [&["migrate"][..], &["run"], &["stats"], &["dead", "retry", "--all"]] {
            let ran = cli(url, command).await;
            assert_eq!(ran.code, 1, "{url} {command:?}: {ran:?}");
            assert_eq!(
                ran.error_line(),
                format!(
                    "error: cannot connect to PostgreSQL at {masked}: error connecting to server: Connection refused (os error 111)"
                ),
                "{command:?}"
            );
            assert_eq!(ran.stdout, "", "{command:?}");
        }
    }
}
