-- New rows in the order a dispatcher's cursor takes them. Built without blocking producers
-- (hence a migration of its own, outside a transaction). Rows inserted before the `txid`
-- column existed have none and are left out; the next migrations give the unfinished ones a
-- place. If this fails midway it leaves an invalid index behind: `actix-outbox migrate` drops
-- it and builds it again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_txid ON outbox (txid, id) WHERE txid IS NOT NULL;
