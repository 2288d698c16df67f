\set k random(1, 1000000000)
BEGIN;
INSERT INTO pgb.ledger (key) VALUES (:k);
COMMIT;
