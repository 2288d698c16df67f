-- Reservations, heartbeats, releases and completions change only columns
-- that no index covers, so Postgres can update the row in place (a HOT
-- update: no new index entries). Retention scans go through created_at, which
-- never changes: a key completed or abandoned before a cutoff was created
-- before it too.
DROP INDEX {{.schema}}.keys_completed_at_idx;
DROP INDEX {{.schema}}.keys_locked_until_idx;
CREATE INDEX keys_created_at_idx ON {{.schema}}.keys (created_at);
-- Room on each page for the updated versions of its rows.
ALTER TABLE {{.schema}}.keys SET (fillfactor = 70);

---- create above / drop below ----

ALTER TABLE {{.schema}}.keys RESET (fillfactor);
DROP INDEX {{.schema}}.keys_created_at_idx;
CREATE INDEX keys_completed_at_idx ON {{.schema}}.keys (completed_at) WHERE state = 'completed';
CREATE INDEX keys_locked_until_idx ON {{.schema}}.keys (locked_until) WHERE state = 'in_progress';
