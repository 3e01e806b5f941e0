-- Every claim and finalize leaves dead index entries at the head of outbox_ready that later
-- claims step over until VACUUM removes them (measured: 465 index pages per 50-row claim after
-- 120,000 claimed rows). The default trigger (20 % of the table) is far too lazy for a queue
-- table whose churn is its whole life: vacuum it after a small fixed number of changed rows.
-- Takes effect where autovacuum is on (the PostgreSQL default).
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
