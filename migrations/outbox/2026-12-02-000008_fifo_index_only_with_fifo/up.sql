-- The FIFO gate's index (aggregate_type, aggregate_id, id) over the unfinished rows costs every
-- insert and every claim an index entry (measured: 19 % of PostgreSQL's CPU per message end to
-- end, 7 % of the WAL), and only the gate reads it. It goes here; a dispatcher whose `fifo` is
-- on builds it (CREATE INDEX CONCURRENTLY, once per table, producers keep writing) before its
-- first claim, and `actix-outbox migrate --fifo` builds it ahead of time. A deployment that
-- runs the gate today: run `actix-outbox migrate --fifo` after this migration, before its
-- dispatchers start.
DROP INDEX IF EXISTS outbox_fifo_gate;

-- Dead rows, for operators (`dead list`) and the table sampler: written only when a row goes
-- dead.
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 'dead';
