-- Outbox headers are stored as the AMQP field table itself, in the bytes
-- amqp091-go would write on the wire (internal/fieldtable): jsonb refuses
-- strings with NUL bytes and turns names and values that are not UTF-8 into
-- U+FFFD, so the typed JSON of 002 could not carry every header unchanged.
--
-- Rows written before this migration keep their JSON in headers_jsonb, and
-- the relay still reads it: nothing is rewritten here, so the migration
-- takes no time on a large table. The old column is renamed, not kept under
-- its name, so that a process of an older version fails loudly on this
-- schema (its insert and its relay's claim name a column that is gone)
-- instead of relaying new rows without their headers.
ALTER TABLE {{.schema}}.outbox RENAME COLUMN headers TO headers_jsonb;
ALTER TABLE {{.schema}}.outbox ADD COLUMN headers_amqp bytea;

---- create above / drop below ----

-- Going back would drop the headers of rows not yet published.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM {{.schema}}.outbox
               WHERE headers_amqp IS NOT NULL AND published_at IS NULL) THEN
        RAISE EXCEPTION 'pending outbox rows hold headers in headers_amqp: publish or delete them first';
    END IF;
END
$$;
ALTER TABLE {{.schema}}.outbox DROP COLUMN headers_amqp;
ALTER TABLE {{.schema}}.outbox RENAME COLUMN headers_jsonb TO headers;
