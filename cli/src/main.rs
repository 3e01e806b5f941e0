//! `actix-outbox`: the operator's command line. Everything lives in the `actix_outbox_cli`
//! library; this binary is only its entry point.

/// mimalloc rather than the system allocator: see the manifest.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    actix_outbox_cli::main()
}
