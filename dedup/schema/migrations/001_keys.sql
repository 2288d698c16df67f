-- The idempotency keys: one row per (consumer, tenant, key).
CREATE TABLE {{.schema}}.keys (
    consumer       text        NOT NULL,
    tenant         text        NOT NULL DEFAULT '',
    key            text        NOT NULL,
    state          text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fingerprint    bytea       NOT NULL,
    lease_token    uuid,
    locked_until   timestamptz,
    attempts       integer     NOT NULL DEFAULT 1,
    recovery_point text,
    recovery_data  bytea,
    steps          text[]      NOT NULL DEFAULT '{}',
    outcome        text        CHECK (outcome IN ('ok', 'rejected')),
    response_code  integer,
    response       bytea,
    trace_id       text,
    span_id        text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    completed_at   timestamptz,
    PRIMARY KEY (consumer, tenant, key)
);

-- Retention scans: completed keys by age, abandoned leases by expiry.
CREATE INDEX keys_completed_at_idx ON {{.schema}}.keys (completed_at) WHERE state = 'completed';
CREATE INDEX keys_locked_until_idx ON {{.schema}}.keys (locked_until) WHERE state = 'in_progress';

---- create above / drop below ----

DROP TABLE {{.schema}}.keys;
