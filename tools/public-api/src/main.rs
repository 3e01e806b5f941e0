//! Holds `actix-outbox`'s public API still: lists it from rustdoc's JSON, one item a line, and
//! compares the listing with the one checked in (`tests/public-api.txt`), so that any change of
//! the API is a visible diff in review.
//!
//! ```text
//! RUSTC_BOOTSTRAP=1 RUSTDOCFLAGS='-Z unstable-options --output-format json' \
//!     cargo doc --no-deps -p actix-outbox --features opentelemetry,testkit,inbox
//! cargo run -p actix-outbox-public-api -- target/doc/actix_outbox.json tests/public-api.txt
//! ```
//!
//! (CI gives `RUSTC_BOOTSTRAP` to rustdoc alone, through a wrapper, and documents the
//! workspace less `actix-outbox-tools`, so that the dependencies checked for the documentation
//! serve this too: see `.ci/run`.)
//!
//! It exits 1 and prints the lines that differ (`-` gone from the API, `+` new in it) when the
//! listing is stale; `--bless` writes the listing anew instead. Rustdoc's JSON is unstable
//! (hence `RUSTC_BOOTSTRAP`) and versioned: the `public-api` crate this reads it with is pinned
//! to the JSON of the toolchain CI uses, and a toolchain whose JSON differs is told as such.
//!
//! The `testing` module (feature `test-util`) is the crate's own, outside semver: left out.

use std::collections::BTreeSet;
use std::process::ExitCode;

/// The JSON format version the pinned `public-api` crate reads.
const FORMAT_VERSION: u64 = 57;
/// Items under this path are outside semver.
const UNSTABLE: &str = "actix_outbox::testing";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bless = args.iter().any(|a| a == "--bless");
    let paths: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let [json, listing] = paths.as_slice() else {
        eprintln!("usage: public-api [--bless] RUSTDOC_JSON LISTING");
        return ExitCode::from(2);
    };
    match run(json, listing, bless) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("public-api: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(json: &str, listing: &str, bless: bool) -> Result<ExitCode, String> {
    let text = std::fs::read_to_string(json).map_err(|e| format!("reading {json}: {e}"))?;
    let version = serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| format!("{json} is not JSON: {e}"))?
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("{json} has no format_version: not rustdoc's JSON"))?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "{json} is rustdoc JSON format {version}; this tool reads format {FORMAT_VERSION} (the toolchain CI \
             uses): move the `public-api` dependency of tools/Cargo.toml to the release that reads {version}"
        ));
    }
    let api = public_api::Builder::from_rustdoc_json(json)
        .omit_blanket_impls(true)
        .build()
        .map_err(|e| format!("reading the public API from {json}: {e}"))?;
    let mut current: Vec<String> =
        api.items().map(ToString::to_string).filter(|item| !item.contains(UNSTABLE)).collect();
    current.sort();
    current.dedup();
    let mut rendered = current.join("\n");
    rendered.push('\n');
    if bless {
        std::fs::write(listing, &rendered).map_err(|e| format!("writing {listing}: {e}"))?;
        println!("public-api: wrote {} items to {listing}", current.len());
        return Ok(ExitCode::SUCCESS);
    }
    let recorded = std::fs::read_to_string(listing).map_err(|e| format!("reading {listing}: {e}"))?;
    let recorded: BTreeSet<&str> = recorded.lines().collect();
    let now: BTreeSet<&str> = current.iter().map(String::as_str).collect();
    let gone: Vec<&&str> = recorded.difference(&now).collect();
    let new: Vec<&&str> = now.difference(&recorded).collect();
    if gone.is_empty() && new.is_empty() {
        println!("public-api: {} items, as in {listing}", now.len());
        return Ok(ExitCode::SUCCESS);
    }
    for item in &gone {
        println!("- {item}");
    }
    for item in &new {
        println!("+ {item}");
    }
    println!(
        "public-api: the public API differs from {listing} ({} gone, {} new); if that is meant, rerun with \
         --bless and commit the listing",
        gone.len(),
        new.len()
    );
    Ok(ExitCode::from(1))
}
