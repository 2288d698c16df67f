-- Published rows leave the outbox table for a narrow record of their own.
--
-- Until now the relay marked a confirmed row by setting published_at, which
-- the pending, ordering and published indexes all name: every mark wrote a
-- new version of the whole row (its body and headers too) and two index
-- entries, the largest part of Postgres's work per relayed message. The
-- relay now moves the row in the same transaction instead: it deletes it
-- from the outbox (a delete touches no index; VACUUM removes the entries
-- later) and appends what an operator asks of a published message (which
-- message, where it went, when, after how many attempts and returns) to
-- outbox_published, which retention empties oldest first. The outbox table
-- keeps the pending and the parked rows only.
--
-- Rows published before this migration stay in the outbox with published_at
-- set, and retention deletes them there as before; nothing is rewritten, so
-- the migration takes no time on a large table. A relay of an older version
-- still running on this schema marks in place as it did; retention deletes
-- those rows too. See docs/outbox.md (Storage).
CREATE TABLE {{.schema}}.outbox_published (
    id           bigint      NOT NULL,
    message_id   text        NOT NULL,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    created_at   timestamptz NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now(),
    attempts     integer     NOT NULL,
    returns      integer     NOT NULL
);

-- Retention, oldest first. The only index: the record is written once per
-- message and read by age.
CREATE INDEX outbox_published_published_at_idx ON {{.schema}}.outbox_published (published_at);

-- Retention deletes from it all day long, as from the keys (see 008).
ALTER TABLE {{.schema}}.outbox_published SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000, vacuum_truncate = false);

---- create above / drop below ----

-- Going back loses the record of the messages published since this
-- migration (their rows are no longer in the outbox); no pending row is lost.
DROP TABLE {{.schema}}.outbox_published;
