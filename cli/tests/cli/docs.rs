//! The help pasted in the docs is the binary's.

use crate::common::*;

/// docs/operations.md shows the help of every command as the binary prints it: each
/// ```` ```text ```` block that starts with `$ actix-outbox ... --help` must equal what that
/// command prints now. `UPDATE_DOCS=1 cargo test -p actix-outbox-cli --test cli help` rewrites
/// the blocks from the binary instead.
#[tokio::test]
async fn the_help_pasted_in_operations_md_is_the_binarys() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let mut out = String::with_capacity(doc.len());
    let (mut rest, mut checked, mut stale) = (doc.as_str(), 0, Vec::new());
    while let Some(start) = rest.find("```text\n$ actix-outbox ") {
        let body_start = start + "```text\n".len();
        let end = body_start + rest[body_start..].find("\n```").expect("a closed block");
        let block = &rest[body_start..end];
        let (command, shown) = block.split_once('\n').unwrap_or((block, ""));
        let args: Vec<&str> = command.trim_start_matches("$ actix-outbox ").split_whitespace().collect();
        let ran = cli("postgres://root@127.0.0.1:5432/unused", &args).await;
        assert_eq!(ran.code, 0, "{command}: {ran:?}");
        // Clap pads blank lines of long help with spaces; the doc keeps them blank.
        let printed: String = ran.stdout.trim_end().lines().map(str::trim_end).collect::<Vec<_>>().join("\n");
        if printed != shown {
            stale.push(command.to_owned());
        }
        out.push_str(&rest[..body_start]);
        out.push_str(command);
        out.push('\n');
        out.push_str(&printed);
        rest = &rest[end..];
        checked += 1;
    }
    out.push_str(rest);
    assert_eq!(checked, 12, "every command's help is shown, each once");
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(path, out).unwrap();
    } else {
        assert!(stale.is_empty(), "stale help in docs/operations.md (UPDATE_DOCS=1 rewrites it): {stale:?}");
    }
}
