//! `actix-outbox`: the operator's command line. Everything lives in [`actix_outbox::cli`]; this
//! binary is only its entry point.

fn main() -> std::process::ExitCode {
    actix_outbox::cli::main()
}
