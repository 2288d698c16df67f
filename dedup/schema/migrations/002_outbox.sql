-- The transactional outbox: one row per message to publish, written in the
-- caller's transaction and published by the relay with publisher confirms.
-- Rows are marked published (published_at), not deleted, and removed later by
-- retention (outbox.GC). Headers are jsonb in a typed encoding (every value
-- carries its AMQP type) so that they round-trip faithfully; see docs/outbox.md.
CREATE TABLE {{.schema}}.outbox (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    exchange         text        NOT NULL,
    routing_key      text        NOT NULL,
    headers          jsonb,
    body             bytea       NOT NULL,
    content_type     text        NOT NULL DEFAULT '',
    content_encoding text        NOT NULL DEFAULT '',
    delivery_mode    smallint    NOT NULL DEFAULT 2 CHECK (delivery_mode IN (1, 2)),
    priority         smallint    NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 255),
    correlation_id   text        NOT NULL DEFAULT '',
    reply_to         text        NOT NULL DEFAULT '',
    expiration       text        NOT NULL DEFAULT '',
    type             text        NOT NULL DEFAULT '',
    app_id           text        NOT NULL DEFAULT '',
    message_id       text        NOT NULL,
    ordering_key     text,
    traceparent      text,
    tracestate       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    available_at     timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    returns          integer     NOT NULL DEFAULT 0,
    last_error       text,
    published_at     timestamptz,
    parked_at        timestamptz,
    parked_reason    text
);

-- The relay's claim: pending rows in id order. Published and parked rows
-- leave this index, so it stays as small as the backlog.
CREATE INDEX outbox_pending_idx ON {{.schema}}.outbox (id)
    WHERE published_at IS NULL AND parked_at IS NULL;

-- Ordered rows: "is there an older pending row with my ordering key?"
CREATE INDEX outbox_ordering_idx ON {{.schema}}.outbox (ordering_key, id)
    WHERE published_at IS NULL AND parked_at IS NULL AND ordering_key IS NOT NULL;

-- Retention: published rows by age; parked rows for operators.
CREATE INDEX outbox_published_at_idx ON {{.schema}}.outbox (published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX outbox_parked_at_idx ON {{.schema}}.outbox (parked_at)
    WHERE parked_at IS NOT NULL;

-- Wake the relays: one notification per inserting statement (COPY included)
-- on channel <schema>_outbox, delivered at COMMIT, never for a rollback.
-- The schema part is cut to 56 bytes so the name fits Postgres' 63.
CREATE FUNCTION {{.schema}}.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left(TG_TABLE_SCHEMA, 56) || '_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON {{.schema}}.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {{.schema}}.outbox_notify();

---- create above / drop below ----

DROP TABLE {{.schema}}.outbox;
DROP FUNCTION {{.schema}}.outbox_notify();
