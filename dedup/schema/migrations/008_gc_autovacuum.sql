-- Retention deletes the oldest keys and outbox rows all day long, and the
-- space of a deleted row is reused only once VACUUM has seen it. Postgres's
-- default waits for dead rows to reach 20 % of a table before autovacuum
-- runs (2 M dead rows in a table of 10 M keys): the table grows by that much
-- between runs, and each run has that much to do. At 1 % plus 10,000 rows
-- autovacuum runs every few minutes on a busy table, each run short, and the
-- table stays within about 2 % of its size (Postgres skips the index pass
-- while fewer pages than that hold dead rows, and their space is reused only
-- after one): see docs/operations.md (Retention at scale) for the figures.
--
-- Both tables refill what retention empties, so VACUUM never gives their
-- empty tail pages back to the file system (vacuum_truncate off): that
-- would take an ACCESS EXCLUSIVE lock, which stops every worker for its
-- duration, to shrink a file that grows again within minutes.
--
-- Changing these settings takes a brief SHARE UPDATE EXCLUSIVE lock, which
-- does not block reads or writes.
ALTER TABLE {{.schema}}.keys SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000, vacuum_truncate = false);
ALTER TABLE {{.schema}}.outbox SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000, vacuum_truncate = false);

---- create above / drop below ----

ALTER TABLE {{.schema}}.outbox RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, vacuum_truncate);
ALTER TABLE {{.schema}}.keys RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, vacuum_truncate);
