//! `actix-outbox`: the operator's command line. Everything lives in the `actix_outbox_cli`
//! library; this binary is only its entry point.

/// jemalloc, not the system's malloc: the dispatcher allocates many small objects a message on
/// one thread and frees them on another (the message, its publish, its confirm), which cost
/// glibc's malloc about a fifth of the relay's CPU (docs/benchmarks.md, "What the defaults rest
/// on").
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    actix_outbox_cli::main()
}
