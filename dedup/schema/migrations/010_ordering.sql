-- Ordered per key: the last sequence applied per (consumer, tenant, ordering
-- key), which commits with the effect, and the operators' skips.
--
-- A consumer with ordering on (consumer.Config.Ordering) reads and advances
-- its key's row in the handler's transaction: a sequence at or below
-- last_sequence is a duplicate, the next one runs, a later one waits. A key
-- is blocked (blocked_at set) when one of its messages was dead-lettered;
-- the message that brings the next sequence clears it, and so does an
-- operator's `idemq order skip`, which ordering_skips records. See
-- docs/ordering.md.
CREATE TABLE {{.schema}}.ordering_keys (
    consumer         text        NOT NULL,
    tenant           text        NOT NULL,
    ordering_key     text        NOT NULL,
    last_sequence    bigint      NOT NULL DEFAULT 0,
    -- the sequence last found when the row was last written: what the
    -- upsert of a message compares its sequence with.
    seen_sequence    bigint      NOT NULL DEFAULT 0,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    blocked_at       timestamptz,
    blocked_reason   text,
    blocked_sequence bigint,
    PRIMARY KEY (consumer, tenant, ordering_key)
);

-- The blocked keys, for `idemq order status` and the UI.
CREATE INDEX ordering_keys_blocked_idx ON {{.schema}}.ordering_keys (consumer, blocked_at) WHERE blocked_at IS NOT NULL;

-- Every row is updated with each message of its key.
ALTER TABLE {{.schema}}.ordering_keys SET (fillfactor = 80);

CREATE TABLE {{.schema}}.ordering_skips (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer      text        NOT NULL,
    tenant        text        NOT NULL,
    ordering_key  text        NOT NULL,
    from_sequence bigint      NOT NULL,
    to_sequence   bigint      NOT NULL,
    operator      text        NOT NULL,
    note          text        NOT NULL DEFAULT '',
    skipped_at    timestamptz NOT NULL DEFAULT now()
);

-- The outbox's side: a row enqueued with an ordering key takes the next
-- sequence of its key in the enqueuing transaction (the counter's row lock
-- orders the key's writers, so sequences follow commit order), and the
-- relay publishes it with x-ordering-key and x-sequence.
ALTER TABLE {{.schema}}.outbox ADD COLUMN sequence bigint;

CREATE TABLE {{.schema}}.outbox_sequences (
    ordering_key  text   PRIMARY KEY,
    last_sequence bigint NOT NULL
);

---- create above / drop below ----

DROP TABLE {{.schema}}.outbox_sequences;
ALTER TABLE {{.schema}}.outbox DROP COLUMN sequence;
DROP TABLE {{.schema}}.ordering_skips;
DROP TABLE {{.schema}}.ordering_keys;
