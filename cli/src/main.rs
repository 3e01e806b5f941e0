//! `actix-outbox`: the operator's command line. Everything lives in the `actix_outbox_cli`
//! library; this binary is only its entry point.

/// jemalloc, not the system's malloc: the dispatcher allocates and frees many small objects a
/// message, on one thread and freed on another (the message, its publish, its confirm), which
/// glibc's malloc does at about a fifth of the relay's CPU (docs/benchmarks.md, "The allocator").
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    actix_outbox_cli::main()
}
