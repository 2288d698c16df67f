\set k random(1, 1000000000)
BEGIN;
SELECT pg_try_advisory_xact_lock(1, :k);
INSERT INTO pgb.ledger (key) VALUES (:k);
COMMIT;
