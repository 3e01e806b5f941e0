DROP INDEX IF EXISTS outbox_dead;
CREATE INDEX IF NOT EXISTS outbox_fifo_gate ON outbox (aggregate_type, aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'dead');
