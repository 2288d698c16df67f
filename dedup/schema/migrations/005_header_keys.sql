-- The keys that sign idemq's own message headers (x-idemq-*): workers sign
-- the retry and dead-letter copies they publish, and trust those headers only
-- on a copy whose signature verifies under one of these keys (see
-- docs/security.md). Migrating creates one random key, so that all the
-- workers of a schema share a key without any configuration. The worker role
-- needs SELECT on this table, nothing more.
--
-- Every key verifies; the key with the latest signs_from that has passed
-- signs. A rotation inserts a new key with signs_from in the future: it
-- verifies at once and signs from then on.
CREATE TABLE {{.schema}}.header_keys (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    secret     bytea       NOT NULL CHECK (length(secret) >= 16),
    signs_from timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now()
);
-- 32 bytes from two version 4 UUIDs (244 bits from Postgres's strong random
-- source, pg_strong_random), hashed.
INSERT INTO {{.schema}}.header_keys (secret)
SELECT sha256(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()));

---- create above / drop below ----

DROP TABLE {{.schema}}.header_keys;
