-- Fails (duplicate key) where two sources recorded the same message id for one consumer: those
-- rows cannot be told apart by the older key.
ALTER TABLE inbox_aggregates DROP CONSTRAINT inbox_aggregates_pkey;
ALTER TABLE inbox_aggregates ADD PRIMARY KEY (consumer, aggregate_type, aggregate_id);
ALTER TABLE inbox_aggregates DROP COLUMN source;

ALTER TABLE inbox DROP CONSTRAINT inbox_pkey;
ALTER TABLE inbox ADD PRIMARY KEY (consumer, message_id);
ALTER TABLE inbox DROP COLUMN source;
