CREATE INDEX IF NOT EXISTS outbox_fifo ON outbox (aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'dead');
DROP INDEX IF EXISTS outbox_fifo_gate;
