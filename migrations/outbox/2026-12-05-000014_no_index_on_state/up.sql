-- The indexes whose predicate is `status`: no claim or finalize reads them any more, and while
-- any of them exists no update of `status` is HOT. The catalog change is instant once the lock
-- is had; the lock timeout keeps a long transaction on the table from queueing producers
-- behind it (run `migrate` again then).
SET LOCAL lock_timeout = '10s';
DROP INDEX IF EXISTS outbox_ready;
DROP INDEX IF EXISTS outbox_leased;
DROP INDEX IF EXISTS outbox_done_at;
DROP INDEX IF EXISTS outbox_dead;
