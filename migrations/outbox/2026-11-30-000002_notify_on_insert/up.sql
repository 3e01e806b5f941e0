-- Wake idle dispatchers the moment rows are inserted, whoever the producer is (any language,
-- plain SQL). One notification per INSERT statement, not per row; PostgreSQL also folds
-- identical notifications within a transaction, so a bulk insert costs one. Dispatchers keep
-- polling as the fallback, so a lost notification only costs latency.
CREATE FUNCTION outbox_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_insert', TG_TABLE_NAME);
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify_insert
    AFTER INSERT ON outbox
    FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_notify_insert();
