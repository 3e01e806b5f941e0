-- Notify only while a dispatcher is armed (holds the session advisory lock 122550254464888,
-- "outbox" in ASCII; see src/dispatcher/listener.rs). A transaction that notifies takes a
-- cluster-wide lock at commit and holds it across its WAL flush, so notifying commits run one
-- at a time: a busy dispatcher, which claims by polling anyway, disarms so that producers
-- commit in parallel again. A producer that finds the lock free holds it in shared mode until
-- it commits, which keeps a dispatcher from arming until its row is visible.
CREATE OR REPLACE FUNCTION outbox_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(122550254464888) THEN
        PERFORM pg_notify('outbox_insert', TG_TABLE_NAME);
    END IF;
    RETURN NULL;
END
$$;
