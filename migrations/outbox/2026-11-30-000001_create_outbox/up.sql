-- The transactional outbox (docs/architecture.md, "The table"). Producers insert with only the four business columns;
-- every dispatcher column has a default so that any producer, in any language, can write here.
CREATE TABLE outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    status         text        NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    -- backoff: a pending row is not claimable before this instant (database clock)
    available_at   timestamptz NOT NULL DEFAULT now(),
    -- counted at claim time, so a worker that dies mid-publish still spends an attempt
    attempts       integer     NOT NULL DEFAULT 0,
    -- for humans; correctness rests on lease_version alone
    lease_owner    text,
    lease_until    timestamptz,
    -- the fencing token: +1 on every claim; every later write is predicated on it
    lease_version  bigint      NOT NULL DEFAULT 0,
    last_error     text,
    done_at        timestamptz
);

-- Ready rows, in the order the claim takes them.
CREATE INDEX outbox_ready ON outbox (available_at, id) WHERE status = 'pending';
-- Leased rows: expired-lease reclaim and the reaper walk this by lease_until.
CREATE INDEX outbox_leased ON outbox (lease_until) WHERE status = 'processing';
-- The per-aggregate FIFO gate: "is there an earlier unfinished row of this aggregate?"
CREATE INDEX outbox_fifo ON outbox (aggregate_id, id) WHERE status IN ('pending', 'processing', 'dead');
-- Operators list dead rows and purge old done rows.
CREATE INDEX outbox_done_at ON outbox (done_at) WHERE status = 'done';
