ALTER TABLE outbox DROP COLUMN headers;
