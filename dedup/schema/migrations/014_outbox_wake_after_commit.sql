-- The outbox's insert trigger goes: a NOTIFY in a transaction takes
-- Postgres' database-wide notify lock at COMMIT and holds it through the
-- WAL flush, so the transactions that enqueued outbox rows committed one at
-- a time and never grouped. The writers wake the relays themselves now
-- (outbox.Enqueue): after the commit where the library owns it (the
-- consumer runtime, idemhttp, outbox.WakeAfterCommit), else with a
-- pg_notify in the transaction, as the trigger did. A writer that inserts
-- rows by other means wakes the relays with pg_notify('<schema>_outbox',
-- '') (outbox.ChannelName) or waits for their poll (1 s by default).
DROP TRIGGER outbox_notify ON {{.schema}}.outbox;
DROP FUNCTION {{.schema}}.outbox_notify();

---- create above / drop below ----

CREATE FUNCTION {{.schema}}.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left(TG_TABLE_SCHEMA, 56) || '_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON {{.schema}}.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {{.schema}}.outbox_notify();
