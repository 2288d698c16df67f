-- What operators did by hand: every replay of dead letters, unpark of outbox
-- rows and skip of an ordering key, from the UI or the CLI (`idemq audit`,
-- the UI's Audit page). A row is written when the action starts (result
-- 'running') and updated when it ends, so an action whose process died
-- shows as never finished. audit_keys holds the SHA-256 digest of the key of
-- each message an action moved (never the key), so that a key's page can
-- show its replay history. Rows are kept until deleted: retention does not
-- touch them.
CREATE TABLE {{.schema}}.audit (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text        NOT NULL,
    via      text        NOT NULL,
    action   text        NOT NULL,
    target   text        NOT NULL,
    what     text        NOT NULL,
    count    integer     NOT NULL DEFAULT 0,
    result   text        NOT NULL DEFAULT 'running',
    ended_at timestamptz
);
CREATE INDEX ON {{.schema}}.audit (at DESC);

CREATE TABLE {{.schema}}.audit_keys (
    audit_id   bigint NOT NULL REFERENCES {{.schema}}.audit ON DELETE CASCADE,
    key_digest text   NOT NULL
);
CREATE INDEX ON {{.schema}}.audit_keys (key_digest);
CREATE INDEX ON {{.schema}}.audit_keys (audit_id);

---- create above / drop below ----

DROP TABLE {{.schema}}.audit_keys;
DROP TABLE {{.schema}}.audit;
