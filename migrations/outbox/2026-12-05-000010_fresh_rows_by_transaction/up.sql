-- Claims that cost the same however long the history is and however long vacuum is held off.
--
-- Until now the claim read partial indexes whose predicate is `status` (`outbox_ready` and the
-- others): every claim and every finalize changed `status`, so no update was HOT, each left a
-- dead entry in the index it left, and each claim walked past the dead entries until vacuum
-- removed them. A transaction that holds the vacuum horizon (a report, a forgotten session, a
-- standby's feedback) kept them all, and claims slowed down by the minute.
--
-- Now no index names a column that a claim or a finalize changes, so both are HOT updates,
-- and the claim finds rows by two indexes whose entries it never has to step over again:
--
-- - `txid`: the transaction that inserted the row (its top-level id, a 64-bit xid8 that never
--   wraps). A dispatcher keeps a cursor made of PostgreSQL snapshots and takes the rows whose
--   transaction committed after its cursor, in (txid, id) order (outbox_txid, next migration).
--   A transaction that commits late is still seen: its id was in progress in the cursor's
--   snapshot. Producers never write it: the default fills it in.
-- - `available_at > created_at`: a row that waits (a retry's backoff, a deferral, a release,
--   an event scheduled by its producer, an expired lease) is found through `outbox_later`
--   (migration after next), which holds only those rows.
--
-- `outbox_horizon` holds, per outbox, the snapshot behind which every row inserted is finished
-- or waits in `outbox_later`: where a starting dispatcher's cursor begins, and what the
-- dispatchers' sweep moves forward.
--
-- Online: catalog changes only (the new column has no stored value in existing rows), under a
-- short lock timeout so that a long transaction on the table makes this fail at once instead of
-- queueing every producer behind it. Run it again once the long transaction is gone.
SET LOCAL lock_timeout = '10s';

ALTER TABLE outbox ADD COLUMN txid xid8;
ALTER TABLE outbox ALTER COLUMN txid SET DEFAULT pg_current_xact_id();

-- Room on each page for a row's next versions (claimed, then done), so that they are written
-- beside it: a HOT update needs free space on the row's own page. Applies to pages written
-- from now on.
ALTER TABLE outbox SET (fillfactor = 50);

CREATE TABLE outbox_horizon (
    -- One row.
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    -- Every row whose txid is visible in this snapshot is done, dead, deleted, or waits in
    -- outbox_later. '3:3:' (before any transaction): nothing is known yet.
    horizon     pg_snapshot NOT NULL DEFAULT '3:3:',
    -- The snapshot the horizon moves to once every row visible in it is found finished.
    candidate   pg_snapshot NOT NULL DEFAULT '3:3:',
    -- Where the sweep's current pass over the rows after the horizon resumes (NULL: at its start),
    -- and whether it found every row visible in the candidate finished so far.
    pass_txid   xid8,
    pass_id     bigint,
    pass_clean  boolean NOT NULL DEFAULT true,
    swept_at    timestamptz
);
INSERT INTO outbox_horizon DEFAULT VALUES;
