-- Rows that wait (a backoff, a deferral, a release, a scheduled event, an expired lease), by the
-- time they are due; and dead rows, at 9999-12-31 (never due). A row enters it when its `available_at` is
-- set past its `created_at`, and leaves it when it is done (`available_at` goes back to
-- `created_at`). Built without blocking producers; see the migration before.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_later ON outbox (available_at, id) WHERE available_at > created_at;
