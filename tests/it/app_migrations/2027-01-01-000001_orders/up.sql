-- An application's own table, migrated by TestDatabaseOptions::migrations in tests/it/testkit.rs.
CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer text NOT NULL);
