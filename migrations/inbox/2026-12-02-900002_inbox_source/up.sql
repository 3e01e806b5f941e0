-- Message ids are unique only within the outbox that produced them: two producer databases
-- both publish a message 1. The inbox now keys on (consumer, source, message_id), the source
-- being the producer's `x-outbox-source` header ('' for a message without one, whose ids must
-- then be unique by themselves).
--
-- Existing rows keep their ids under the source '': they were recorded from messages that
-- carried no source. A copy of such a message redelivered later still carries none and is
-- still recognised. Only a message the producer publishes again after it starts sending its
-- source (a retry that spans the upgrade of the producer) can be applied a second time.
--
-- Safe on a populated table: adding a column with a constant default rewrites nothing; the new
-- primary keys are built under the migration's lock, which holds consumers back for as long as
-- the index build takes.
ALTER TABLE inbox ADD COLUMN source text NOT NULL DEFAULT '';
ALTER TABLE inbox DROP CONSTRAINT inbox_pkey;
ALTER TABLE inbox ADD PRIMARY KEY (consumer, source, message_id);

-- Ordered consumers: the highest message id applied per (source, aggregate), since ids of
-- different sources are not comparable.
ALTER TABLE inbox_aggregates ADD COLUMN source text NOT NULL DEFAULT '';
ALTER TABLE inbox_aggregates DROP CONSTRAINT inbox_aggregates_pkey;
ALTER TABLE inbox_aggregates ADD PRIMARY KEY (consumer, source, aggregate_type, aggregate_id);
