//! Roles of a test's own on the shared server: a crowded server for one role alone (its
//! `CONNECTION LIMIT`), or a user whose name a test needs, removed with their databases.

use diesel::sql_types::Text;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use actix_outbox_test_support::{database_addr, database_url, unique};

/// A role of the test's own (`LOGIN CREATEDB`), allowed `limit` sessions: with a small limit, a
/// server with few free connections for this role alone, so that the shared server stays open
/// to everyone else's tests. Its databases and itself are dropped with it, a panic included.
pub(crate) struct Role {
    pub(crate) name: String,
}

impl Role {
    pub(crate) async fn new(limit: u32) -> Self {
        let name = unique("role").replace('.', "_");
        let mut admin = actix_outbox::admin::connect(&database_url("postgres")).await.unwrap();
        admin.batch_execute(&format!("CREATE ROLE {name} LOGIN CREATEDB CONNECTION LIMIT {limit}")).await.unwrap();
        Role { name }
    }

    /// The server as this role, at its `postgres` database.
    pub(crate) fn server_url(&self) -> String {
        format!("postgres://{}@{}/postgres", self.name, database_addr())
    }

    /// `n` idle sessions of the role, each holding one of its slots until dropped.
    pub(crate) async fn hold(&self, n: usize) -> Vec<AsyncPgConnection> {
        let mut held = Vec::new();
        for _ in 0..n {
            held.push(actix_outbox::admin::connect(&self.server_url()).await.expect("a free slot of the role"));
        }
        held
    }

    /// The databases the role owns, by name.
    pub(crate) async fn databases(&self) -> Vec<String> {
        #[derive(diesel::QueryableByName)]
        struct Name {
            #[diesel(sql_type = Text)]
            name: String,
        }
        let mut admin = actix_outbox::admin::connect(&database_url("postgres")).await.unwrap();
        let names: Vec<Name> = diesel::sql_query(
            "SELECT datname::text AS name FROM pg_database WHERE datdba = (SELECT oid FROM pg_roles WHERE rolname = $1) \
             ORDER BY 1",
        )
        .bind::<Text, _>(&self.name)
        .load(&mut admin)
        .await
        .unwrap();
        names.into_iter().map(|n| n.name).collect()
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let Ok(mut admin) = actix_outbox::admin::connect(&database_url("postgres")).await else { return };
                let role = Role { name: name.clone() };
                for database in role.databases().await {
                    let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)")).await;
                }
                std::mem::forget(role);
                let _ = admin.batch_execute(&format!("DROP ROLE IF EXISTS {name}")).await;
            });
        })
        .join();
    }
}
