\set k random(1, 1000000000)
BEGIN;
INSERT INTO pgb.keys AS k (consumer, tenant, key, state, fingerprint, lease_token, locked_until, attempts, trace_id, span_id, outcome, response_code, completed_at) SELECT 'bench-http', '', 'key-' || :k, 'completed', '\x0102'::bytea, NULL::uuid, NULL::timestamptz, 1, NULL::text, NULL::text, 'ok', 0, now() WHERE pg_try_advisory_xact_lock(1, :k) ON CONFLICT (consumer, tenant, key) DO NOTHING RETURNING attempts, locked_until, (xmax = 0);
INSERT INTO pgb.ledger (key) VALUES (:k);
COMMIT;
