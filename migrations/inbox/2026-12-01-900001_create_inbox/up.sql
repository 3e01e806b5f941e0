-- The consumer side's inbox, for the consumer's own database (not the producer's outbox).
--
-- Versions of this set end in 9xxxxx so that they can never collide with the outbox set's: diesel
-- keeps both in the one `__diesel_schema_migrations` table, and each set only ever looks at its
-- own versions.

-- One row per (consumer, message id) a consumer has handled: inserted in the same transaction as
-- the handler's effect, so that a redelivered copy finds it and is acknowledged without a second
-- effect. The other columns are for operators.
CREATE TABLE inbox (
    consumer       text        NOT NULL,
    -- the AMQP message_id: the producer's outbox id
    message_id     bigint      NOT NULL,
    -- the AMQP `type` property and the x-aggregate-* headers ('' when the message had none)
    event_type     text        NOT NULL DEFAULT '',
    aggregate_type text        NOT NULL DEFAULT '',
    aggregate_id   text        NOT NULL DEFAULT '',
    -- true when the message arrived after a newer one of its aggregate (ordered consumers only)
    late           boolean     NOT NULL DEFAULT false,
    received_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Operators purge old rows by age.
CREATE INDEX inbox_received_at ON inbox (received_at);

-- Ordered consumers: the highest message id applied per aggregate, updated in the same
-- transaction as the inbox row, so that an older event arriving after a newer one is noticed.
CREATE TABLE inbox_aggregates (
    consumer        text        NOT NULL,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    last_message_id bigint      NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);
