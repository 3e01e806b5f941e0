//! Rebuild when a migration is added: `embed_migrations!` reads the folder at compile time, and
//! cargo would not otherwise notice a new directory in it.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
