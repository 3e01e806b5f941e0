//! `actix-outbox`: the operator's command line. Everything lives in the `actix_outbox_cli`
//! library; this binary is only its entry point.

fn main() -> std::process::ExitCode {
    actix_outbox_cli::main()
}
