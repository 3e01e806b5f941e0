CREATE INDEX IF NOT EXISTS outbox_ready ON outbox (available_at, id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS outbox_leased ON outbox (lease_until) WHERE status = 'processing';
CREATE INDEX IF NOT EXISTS outbox_done_at ON outbox (done_at) WHERE status = 'done';
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 'dead';
