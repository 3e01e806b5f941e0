//! [`Harness`]: diesel's migration harness on one connection, with every statement it prepares
//! inside a transaction, so that migrations work through a transaction pooler.
//!
//! diesel's own harness reads the applied versions, and records the version of a migration that
//! runs outside a transaction (`CREATE INDEX CONCURRENTLY`), with prepared statements in
//! autocommit. The driver closes such a statement only after the statement's own transaction
//! ended, so behind a transaction pooler the close may reach another server connection than the
//! one that prepared it: the statement stays where it was prepared, and the next process handed
//! that server connection fails to prepare its own statement of the same name (`prepared
//! statement "s7" already exists`). Here those statements run in a transaction of their own,
//! which keeps the prepare, the run and the close on one server connection; the migrations'
//! SQL itself goes by the simple protocol, which prepares nothing.

use diesel::migration::{Migration, MigrationVersion, Result};
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_migrations::MigrationHarness;

diesel::table! {
    /// diesel's table of applied migrations (as `diesel_migrations` declares it).
    __diesel_schema_migrations (version) {
        version -> VarChar,
        run_on -> Timestamp,
    }
}

/// A connection run as diesel's synchronous migration harness, every prepared statement in a
/// transaction (see the module's docs).
pub(super) struct Harness(AsyncConnectionWrapper<AsyncPgConnection>);

impl From<AsyncPgConnection> for Harness {
    fn from(conn: AsyncPgConnection) -> Self {
        Harness(AsyncConnectionWrapper::from(conn))
    }
}

impl MigrationHarness<Pg> for Harness {
    fn run_migration(&mut self, migration: &dyn Migration<Pg>) -> Result<MigrationVersion<'static>> {
        if migration.metadata().run_in_transaction() {
            // diesel's harness runs it and records it in one transaction.
            return self.0.run_migration(migration);
        }
        migration.run(&mut self.0)?;
        let version = migration.name().version().as_owned();
        self.0.transaction(|c| {
            diesel::insert_into(__diesel_schema_migrations::table)
                .values(__diesel_schema_migrations::version.eq(version.to_string()))
                .execute(c)
        })?;
        Ok(version)
    }

    fn revert_migration(&mut self, migration: &dyn Migration<Pg>) -> Result<MigrationVersion<'static>> {
        if migration.metadata().run_in_transaction() {
            return self.0.revert_migration(migration);
        }
        migration.revert(&mut self.0)?;
        let version = migration.name().version().as_owned();
        self.0
            .transaction(|c| diesel::delete(__diesel_schema_migrations::table.find(version.to_string())).execute(c))?;
        Ok(version)
    }

    fn applied_migrations(&mut self) -> Result<Vec<MigrationVersion<'static>>> {
        self.0.transaction(MigrationHarness::<Pg>::applied_migrations)
    }
}
