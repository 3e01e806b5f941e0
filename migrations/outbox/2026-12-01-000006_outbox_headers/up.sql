-- Message headers a producer attaches to an event (a JSON object of string values), copied by
-- the RabbitMQ sink into the AMQP headers. Nullable with a constant default: producers that
-- insert only the four business columns keep working (they get '{}'), and adding the column is
-- a catalog change only (PostgreSQL >= 11 rewrites no row). NULL, a non-object, and non-string
-- values are tolerated: the dispatcher reads NULL or a non-object as no headers, skips null
-- values and sends any other non-string value as its JSON text.
ALTER TABLE outbox ADD COLUMN headers jsonb DEFAULT '{}'::jsonb;
