-- GC deletes the oldest rows together, so after a GC run fewer than 2 % of a
-- table's pages hold dead rows. Postgres's VACUUM then skips its index pass
-- (INDEX_CLEANUP AUTO), and a page whose dead rows keep their index entries
-- has its free space left out of the free space map: the heap grows by what
-- GC deleted until 2 % of its pages are in that state. Measured with
-- autovacuum alone (make scale, 10 M keys, ten cycles): the key heap grew by
-- 2.3 % and was still growing, where GC's own VACUUM, which asks for the
-- index pass, kept it flat. vacuum_index_cleanup = on makes every VACUUM of
-- both tables, autovacuum's included, run the pass: each run then reads the
-- tables' indexes once (1.6 GB at 10 M keys, about ten seconds throttled)
-- and the space of the deleted rows is reused at once. See
-- docs/operations.md (Retention at scale).
--
-- Changing the setting takes a brief SHARE UPDATE EXCLUSIVE lock, which does
-- not block reads or writes.
ALTER TABLE {{.schema}}.keys SET (vacuum_index_cleanup = on);
ALTER TABLE {{.schema}}.outbox SET (vacuum_index_cleanup = on);

---- create above / drop below ----

ALTER TABLE {{.schema}}.outbox RESET (vacuum_index_cleanup);
ALTER TABLE {{.schema}}.keys RESET (vacuum_index_cleanup);
