-- Keys and notifications of each outbox table of its own, so that several outboxes in one
-- database (one a schema: tenant_a.outbox, tenant_b.outbox) each have their own armed
-- dispatcher and wake only their own. The armed key is the 64-bit hash of
-- 'actix-outbox:armed:' and the table's qualified name (src/store/sql.rs spells the same
-- expression for the listener); the payload is the qualified name, which each listener
-- compares with its own table's.
CREATE OR REPLACE FUNCTION outbox_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    outbox text := TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME;
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(hashtextextended('actix-outbox:armed:' || outbox, 0)) THEN
        PERFORM pg_notify('outbox_insert', outbox);
    END IF;
    RETURN NULL;
END
$$;
