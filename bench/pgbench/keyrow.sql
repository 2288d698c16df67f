\set k random(1, 1000000000)
BEGIN;
INSERT INTO pgb.ledger (key) VALUES (:k);
INSERT INTO pgb.keys AS k (consumer, tenant, key, state, fingerprint, outcome, response_code, completed_at) VALUES ('bench-http', '', 'key-' || :k, 'completed', '\x0102'::bytea, 'ok', 201, now());
COMMIT;
