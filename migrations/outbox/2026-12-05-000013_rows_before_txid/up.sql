-- Rows from before the `txid` column, placed where the new claim finds them, ten thousand at a
-- time, each batch committed on its own (so producers and dispatchers are never held up):
-- - unfinished ones get the txid of their batch's transaction: the next cursor takes them;
-- - dead ones are parked at available_at 9999-12-31 (listed through outbox_later, never due);
-- - done ones that once waited leave outbox_later (available_at back to created_at).
-- Each kind is walked in the order of an index that finds it without reading the history (the
-- old partial indexes still exist here), from where the last batch stopped.
DO $$
DECLARE
    last_at timestamptz := '-infinity';
    last_id bigint := 0;
    n bigint;
BEGIN
    -- Pending rows, through outbox_ready.
    LOOP
        WITH batch AS (
            SELECT id, available_at FROM outbox
            WHERE status = 'pending' AND (available_at, id) > (last_at, last_id)
            ORDER BY available_at, id LIMIT 10000
        ), done AS (
            UPDATE outbox o SET txid = pg_current_xact_id() FROM batch WHERE o.id = batch.id AND o.txid IS NULL
        )
        SELECT count(*), (array_agg(available_at ORDER BY available_at DESC, id DESC))[1],
               (array_agg(id ORDER BY available_at DESC, id DESC))[1]
        FROM batch INTO n, last_at, last_id;
        EXIT WHEN n = 0;
        COMMIT;
    END LOOP;
    -- Processing rows (the rows in flight: few), through outbox_leased.
    UPDATE outbox SET txid = pg_current_xact_id() WHERE status = 'processing' AND txid IS NULL;
    COMMIT;
    -- Dead rows, through outbox_dead.
    last_id := 0;
    LOOP
        WITH batch AS (
            SELECT id FROM outbox WHERE status = 'dead' AND id > last_id ORDER BY id LIMIT 10000
        ), parked AS (
            UPDATE outbox o SET available_at = '9999-12-31 00:00:00+00' FROM batch WHERE o.id = batch.id
        )
        SELECT count(*), max(id) FROM batch INTO n, last_id;
        EXIT WHEN n = 0;
        COMMIT;
    END LOOP;
    -- Done rows that once waited, through outbox_later.
    last_at := '-infinity';
    last_id := 0;
    LOOP
        WITH batch AS (
            SELECT id, available_at FROM outbox
            WHERE available_at > created_at AND (available_at, id) > (last_at, last_id)
            ORDER BY available_at, id LIMIT 10000
        ), left_later AS (
            UPDATE outbox o SET available_at = o.created_at FROM batch WHERE o.id = batch.id AND o.status = 'done'
        )
        SELECT count(*), (array_agg(available_at ORDER BY available_at DESC, id DESC))[1],
               (array_agg(id ORDER BY available_at DESC, id DESC))[1]
        FROM batch INTO n, last_at, last_id;
        EXIT WHEN n = 0;
        COMMIT;
    END LOOP;
END
$$;
