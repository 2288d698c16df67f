-- The one GC run of a schema's keys at a time (dedup.Store.GC). A run takes
-- the row's lease, keeps it while it runs and gives it back at its end; a
-- run that finds the lease held by another skips. A table rather than a
-- session's advisory lock: through a transaction pooler (PgBouncer) no
-- session outlives a transaction, and a lease whose holder died expires.
CREATE TABLE {{.schema}}.gc_runs (
    name   text        PRIMARY KEY,
    holder text        NOT NULL,
    until  timestamptz NOT NULL
);

---- create above / drop below ----

DROP TABLE {{.schema}}.gc_runs;
