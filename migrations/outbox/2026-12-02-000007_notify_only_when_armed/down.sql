CREATE OR REPLACE FUNCTION outbox_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_insert', TG_TABLE_NAME);
    RETURN NULL;
END
$$;
