DROP TABLE inbox_aggregates;
DROP TABLE inbox;
