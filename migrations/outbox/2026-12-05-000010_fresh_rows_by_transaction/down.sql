DROP TABLE IF EXISTS outbox_horizon;
ALTER TABLE outbox RESET (fillfactor);
ALTER TABLE outbox DROP COLUMN IF EXISTS txid;
