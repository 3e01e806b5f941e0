-- The FIFO gate identifies an aggregate by (aggregate_type, aggregate_id): `order/42` and
-- `customer/42` are different aggregates. The gate asks, per candidate row, "is there an
-- earlier unfinished row of this aggregate?"; this index answers that with one range probe.
-- Its predicate is exactly the gate's status list, and it holds only unfinished rows, so it
-- stays small however many done rows the table keeps.
--
-- On a large live table, build it by hand first without blocking writers
--   CREATE INDEX CONCURRENTLY outbox_fifo_gate ON outbox (aggregate_type, aggregate_id, id)
--       WHERE status IN ('pending', 'processing', 'dead');
-- and this migration then only drops the index it replaces.
CREATE INDEX IF NOT EXISTS outbox_fifo_gate ON outbox (aggregate_type, aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'dead');

-- Replaced: (aggregate_id, id) cannot tell aggregates of different types apart without a heap
-- visit per entry, and every index on this table costs every insert and status change.
DROP INDEX IF EXISTS outbox_fifo;
