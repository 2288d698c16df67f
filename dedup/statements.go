package dedup

import (
	"strings"

	"github.com/idemq/idemq/internal/sweep"
)

// statements holds the SQL of a store, with its schema filled in.
type statements struct {
	reserve, complete, release, forget, extend, inspect, checkpoint string
	gcCompleted, gcAbandoned, gcBehind                              string
	// The lease of the schema's one GC run (gc_runs, see Store.holdGC):
	// taken when free or expired, renewed, given back.
	gcTake, gcRenew, gcGive                                string
	reserveBatch, inspectBatch, extendBatch, completeBatch string
	headerKeys                                             string
	releaseBatch                                           string
	stats                                                  string
	// holds reads, without locking it, whether a lease still holds its key
	// and has time left.
	holds string
	// The statements of a lease held by the caller's transaction (see
	// keystore.Keys.ReserveTx): the reservation writes the row completed, the
	// completion only records a result other than the presumed one.
	reserveHeld, reserveBatchHeld, completeHeld, completeBatchHeld string
	releaseBatchHeld, leaseBatchHeld                               string
	// completeOrFail and completeHeldOrFail are complete and completeHeld
	// that fail when they complete no row (orFail).
	completeOrFail, completeHeldOrFail string
	// insertCompleted writes the row of an unwritten lease (TryReserveTx),
	// completed with its result, unless another reservation wrote the key
	// meanwhile; insertCompletedOrFail fails then (orFail).
	insertCompleted, insertCompletedOrFail string
	// table is the key table's quoted name.
	table string
}

func newStatements(schema string, durable bool) statements {
	t := schema + ".keys"
	// Reservations, releases and heartbeats commit without waiting for the
	// WAL flush unless durable: losing one in a database crash can only make
	// a key look absent or expired, and every later write is fenced by the
	// lease token, so the worst case is a retry, never a double effect.
	// Completions commit with the caller's transaction, as durable as it is.
	async, from := "WITH async AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))\n", " async,"
	if durable {
		async, from = "", ""
	}
	st := statements{
		table: t,
		stats: statsSQL(t),
		// One statement decides the race: insert, or take over an expired
		// lease of the same operation, or return nothing.
		reserve: async + `INSERT INTO ` + t + ` AS k
    (consumer, tenant, key, state, fingerprint, lease_token, locked_until, attempts, trace_id, span_id)
SELECT $1, $2, $3, 'in_progress', $4::bytea, $5::uuid, now() + $6::bigint * interval '1 microsecond', 1, $7::text, $8::text` + fromClause(from) + `
` + takeover + `RETURNING attempts, locked_until, coalesce(recovery_point, ''), recovery_data, steps, (xmax = 0)`,

		complete: `UPDATE ` + t + `
SET state = 'completed', outcome = $5, response_code = $6, response = $7, response_reason = $8, response_headers = $9::jsonb,
    lease_token = NULL, locked_until = NULL, release_reason = NULL, completed_at = now(), updated_at = now()
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND lease_token = $4 AND state = 'in_progress'`,

		release: async + `UPDATE ` + t + `
SET lease_token = NULL, locked_until = now(), release_reason = $5, updated_at = now()` + fromClause(from) + `
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND lease_token = $4 AND state = 'in_progress'`,

		forget: async + `DELETE FROM ` + t + strings.Replace(fromClause(from), "FROM", "USING", 1) + `
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND lease_token = $4 AND state = 'in_progress'`,

		extend: async + `UPDATE ` + t + `
SET locked_until = now() + $5::bigint * interval '1 microsecond', updated_at = now()` + fromClause(from) + `
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND lease_token = $4 AND state = 'in_progress'
RETURNING locked_until`,

		checkpoint: `UPDATE ` + t + `
SET recovery_point = $5, recovery_data = $6, steps = array_append(steps, $5), updated_at = now()
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND lease_token = $4 AND state = 'in_progress'`,

		holds: `SELECT true FROM ` + t + `
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND lease_token = $4 AND state = 'in_progress'
  AND locked_until > now()`,

		inspect: `SELECT ` + recordColumns("") + `
FROM ` + t + `
WHERE consumer = $1 AND tenant = $2 AND key = $3`,

		// The batch form of reserve: the same upsert over arrays.
		reserveBatch: async + `INSERT INTO ` + t + ` AS k
    (consumer, tenant, key, state, fingerprint, lease_token, locked_until, attempts, trace_id, span_id)
SELECT c.consumer, c.tenant, c.key, 'in_progress', c.fingerprint, c.token,
       now() + c.lease * interval '1 microsecond', 1, c.trace_id, c.span_id
FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::uuid[], $6::bigint[], $7::text[], $8::text[])
     AS c(consumer, tenant, key, fingerprint, token, lease, trace_id, span_id)` + crossJoin(from) + `
-- One order for every batch, so that two batches never wait on each other's rows in a cycle:
-- byte order (COLLATE "C"), the order the runtime sorts keys in, whatever the database's collation.
ORDER BY c.consumer COLLATE "C", c.tenant COLLATE "C", c.key COLLATE "C"
` + takeover + `RETURNING consumer, tenant, key, lease_token, attempts, locked_until, coalesce(recovery_point, ''), recovery_data, steps, (xmax = 0)`,

		inspectBatch: `SELECT ` + recordColumns("k.") + `
FROM ` + t + ` k
JOIN unnest($1::text[], $2::text[], $3::text[]) AS c(consumer, tenant, key)
  ON k.consumer = c.consumer AND k.tenant = c.tenant AND k.key = c.key`,

		// The rows are locked first, in the global key order that batch
		// reservations use, so that the two never wait on each other in a cycle.
		completeBatch: `WITH c AS MATERIALIZED (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::int[], $7::bytea[], $8::text[], $9::jsonb[])
        AS c(consumer, tenant, key, token, outcome, code, response, reason, headers)
), locked AS MATERIALIZED (
    SELECT k.consumer, k.tenant, k.key FROM ` + t + ` AS k JOIN c USING (consumer, tenant, key)
    WHERE k.lease_token = c.token AND k.state = 'in_progress'
    ORDER BY k.consumer COLLATE "C", k.tenant COLLATE "C", k.key COLLATE "C"
    FOR UPDATE OF k
)
UPDATE ` + t + ` AS k
SET state = 'completed', outcome = c.outcome, response_code = c.code, response = c.response, response_reason = c.reason,
    response_headers = c.headers, lease_token = NULL, locked_until = NULL, release_reason = NULL, completed_at = now(), updated_at = now()
FROM c JOIN locked AS l USING (consumer, tenant, key)
WHERE k.consumer = c.consumer AND k.tenant = c.tenant AND k.key = c.key
  AND k.lease_token = c.token AND k.state = 'in_progress'
RETURNING c.token`,

		// The batch form of release, locking in the same global key order.
		releaseBatch: withCTE(async) + `c AS MATERIALIZED (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[], $5::text[]) AS c(consumer, tenant, key, token, reason)
), locked AS MATERIALIZED (
    SELECT k.consumer, k.tenant, k.key FROM ` + t + ` AS k JOIN c USING (consumer, tenant, key)
    WHERE k.lease_token = c.token AND k.state = 'in_progress'
    ORDER BY k.consumer COLLATE "C", k.tenant COLLATE "C", k.key COLLATE "C"
    FOR UPDATE OF k
)
UPDATE ` + t + ` AS k
SET lease_token = NULL, locked_until = now(), release_reason = c.reason, updated_at = now()
FROM` + from + ` c JOIN locked AS l USING (consumer, tenant, key)
WHERE k.consumer = c.consumer AND k.tenant = c.tenant AND k.key = c.key
  AND k.lease_token = c.token AND k.state = 'in_progress'
RETURNING c.token`,

		// Rows locked by another transaction are skipped, not waited for:
		// a group's heartbeat runs beside the group's own transaction,
		// which locks each key as it completes it, and waiting for those
		// locks while holding others deadlocks. A skipped lease comes back
		// with a NULL locked_until: busy, not lost.
		extendBatch: withCTE(async) + `wanted AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) AS c(consumer, tenant, key, token)
), free AS (
    SELECT k.consumer, k.tenant, k.key FROM ` + t + ` AS k JOIN wanted AS c USING (consumer, tenant, key)
    WHERE k.lease_token = c.token AND k.state = 'in_progress'
    FOR UPDATE OF k SKIP LOCKED
), extended AS (
    UPDATE ` + t + ` AS k
    SET locked_until = now() + $5::bigint * interval '1 microsecond', updated_at = now()
    FROM` + from + ` free AS f
    WHERE k.consumer = f.consumer AND k.tenant = f.tenant AND k.key = f.key
    RETURNING k.lease_token, k.locked_until
)
SELECT lease_token, locked_until FROM extended
UNION ALL
SELECT k.lease_token, NULL FROM ` + t + ` AS k JOIN wanted AS c USING (consumer, tenant, key)
WHERE k.lease_token = c.token AND k.state = 'in_progress'
  AND NOT EXISTS (SELECT FROM free AS f WHERE (f.consumer, f.tenant, f.key) = (k.consumer, k.tenant, k.key))`,

		// The key that signs first comes first (see HeaderKeys).
		headerKeys: `SELECT secret, signs_from FROM ` + schema + `.header_keys ORDER BY signs_from DESC, id DESC`,

		// Bounded batches, oldest first (the created_at index, in order, so
		// that the deleted rows sit together and the time GC is behind
		// shrinks as it works); SKIP LOCKED keeps GC out of the way of workers.
		gcCompleted: sweep.DeleteSQL(t, `created_at < now() - $1::bigint * interval '1 microsecond'
      AND state = 'completed' AND completed_at < now() - $1::bigint * interval '1 microsecond'`, "created_at"),

		gcAbandoned: sweep.DeleteSQL(t, `created_at < now() - $1::bigint * interval '1 microsecond'
      AND state = 'in_progress' AND locked_until < now() - $1::bigint * interval '1 microsecond'`, "created_at"),

		gcTake: `INSERT INTO ` + schema + `.gc_runs AS g (name, holder, until)
VALUES ('keys', $1, now() + $2::bigint * interval '1 microsecond')
ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, until = excluded.until
WHERE g.until < now()
RETURNING holder`,
		gcRenew: `UPDATE ` + schema + `.gc_runs SET until = now() + $2::bigint * interval '1 microsecond'
WHERE name = 'keys' AND holder = $1 AND until >= now()`,
		gcGive: `DELETE FROM ` + schema + `.gc_runs WHERE name = 'keys' AND holder = $1`,

		// How far past the horizon the oldest key still due was created, in
		// microseconds (0 when none is): the first due row of the created_at
		// index, so it costs one index probe while GC keeps up.
		gcBehind: `SELECT coalesce((
    SELECT (extract(epoch FROM (now() - $1::bigint * interval '1 microsecond') - created_at) * 1e6)::bigint
    FROM ` + t + `
    WHERE created_at < now() - $1::bigint * interval '1 microsecond'
      AND ((state = 'completed' AND completed_at < now() - $1::bigint * interval '1 microsecond')
        OR (state = 'in_progress' AND locked_until < now() - $1::bigint * interval '1 microsecond'))
    ORDER BY created_at
    LIMIT 1), 0)`,
	}
	st.reserveHeld, st.reserveBatchHeld = presumeCompleted(st.reserve), presumeCompleted(st.reserveBatch)
	// A held row is the caller's transaction's own (it wrote the row, and
	// holds its lock until it ends): no fencing token, no lock ordering.
	st.completeHeld = `UPDATE ` + t + `
SET outcome = $4, response_code = $5, response = $6, response_reason = $7, response_headers = $8::jsonb
WHERE consumer = $1 AND tenant = $2 AND key = $3 AND state = 'completed'`
	st.completeBatchHeld = `UPDATE ` + t + ` AS k
SET outcome = c.outcome, response_code = c.code, response = c.response, response_reason = c.reason, response_headers = c.headers
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::bytea[], $7::text[], $8::jsonb[])
    AS c(consumer, tenant, key, outcome, code, response, reason, headers)
WHERE k.consumer = c.consumer AND k.tenant = c.tenant AND k.key = c.key AND k.state = 'completed'`
	st.completeOrFail, st.completeHeldOrFail = orFail(st.complete), orFail(st.completeHeld)
	st.insertCompleted = `INSERT INTO ` + t + `
    (consumer, tenant, key, state, fingerprint, attempts, trace_id, span_id,
     outcome, response_code, response, response_reason, response_headers, completed_at)
VALUES ($1, $2, $3, 'completed', $4::bytea, 1, $5::text, $6::text, $7, $8, $9, $10, $11::jsonb, now())
ON CONFLICT (consumer, tenant, key) DO NOTHING`
	st.insertCompletedOrFail = orFail(st.insertCompleted)
	// Giving up a held key turns the presumed completion back into the row
	// Release leaves: in progress, no lease, released with a reason.
	st.releaseBatchHeld = `UPDATE ` + t + ` AS k
SET state = 'in_progress', outcome = NULL, response_code = NULL, response = NULL, response_reason = NULL, response_headers = NULL,
    completed_at = NULL, lease_token = NULL, locked_until = now(), release_reason = c.reason, updated_at = now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS c(consumer, tenant, key, reason)
WHERE k.consumer = c.consumer AND k.tenant = c.tenant AND k.key = c.key AND k.state = 'completed'`
	// Turning a held key into a lease others can see: the row a separate
	// reservation writes, from the statement's own clock.
	st.leaseBatchHeld = `UPDATE ` + t + ` AS k
SET state = 'in_progress', outcome = NULL, response_code = NULL, response = NULL, response_reason = NULL, response_headers = NULL,
    completed_at = NULL, lease_token = c.token, locked_until = clock_timestamp() + $5::bigint * interval '1 microsecond',
    release_reason = NULL, updated_at = now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) AS c(consumer, tenant, key, token)
WHERE k.consumer = c.consumer AND k.tenant = c.tenant AND k.key = c.key AND k.state = 'completed'
RETURNING c.token, k.locked_until`
	return st
}

// presumeCompleted turns a reservation into one for the caller's
// transaction that writes the row as it will be when the handler succeeds
// with the default result (completed, ok, no response; no lease, since the
// transaction's row lock is the lease): the key row is then written once
// instead of twice. Nobody sees it before the transaction commits, and it
// commits only with the completion (which records any other result).
func presumeCompleted(reserve string) string {
	return strings.NewReplacer(
		"(consumer, tenant, key, state, fingerprint, lease_token, locked_until, attempts, trace_id, span_id)",
		"(consumer, tenant, key, state, fingerprint, lease_token, locked_until, attempts, trace_id, span_id, outcome, response_code, completed_at)",
		"'in_progress', $4::bytea, $5::uuid, now() + $6::bigint * interval '1 microsecond', 1, $7::text, $8::text",
		"'completed', $4::bytea, NULLIF($5::uuid, $5::uuid), now() + NULLIF($6::bigint, $6::bigint) * interval '1 microsecond', 1, $7::text, $8::text, 'ok', 0, now()",
		"'in_progress', c.fingerprint, c.token,\n       now() + c.lease * interval '1 microsecond', 1, c.trace_id, c.span_id",
		"'completed', c.fingerprint, NULL::uuid,\n       NULL::timestamptz, 1, c.trace_id, c.span_id, 'ok', 0, now()",
		"SET lease_token    = excluded.lease_token,\n        locked_until   = excluded.locked_until,",
		"SET state = 'completed', outcome = 'ok', response_code = 0, response = NULL, response_reason = NULL, completed_at = now(),\n        lease_token    = NULL,\n        locked_until   = NULL,",
	).Replace(reserve)
}

// fromClause is " FROM async" when the statement reads the async CTE.
func fromClause(from string) string {
	if from == "" {
		return ""
	}
	return "\nFROM async"
}

// crossJoin joins the async CTE into a FROM list.
func crossJoin(from string) string {
	if from == "" {
		return ""
	}
	return ", async"
}

// withCTE opens a WITH clause that continues with more CTEs after the
// optional async one.
func withCTE(async string) string {
	if async == "" {
		return "WITH "
	}
	return strings.TrimSuffix(async, "\n") + ",\n"
}

// takeover is the conflict clause of both reservation statements: take the
// row over only when its lease has expired and the operation is the same.
const takeover = `ON CONFLICT (consumer, tenant, key) DO UPDATE
    SET lease_token    = excluded.lease_token,
        locked_until   = excluded.locked_until,
        attempts       = k.attempts + 1,
        trace_id       = coalesce(excluded.trace_id, k.trace_id),
        span_id        = coalesce(excluded.span_id, k.span_id),
        release_reason = NULL,
        updated_at     = now()
    WHERE k.state = 'in_progress'
      AND k.locked_until <= now()
      AND k.fingerprint = excluded.fingerprint
`

// recordColumns is the column list scanRecord reads, each prefixed (a table
// alias and a dot, or ""). A row is released when it is in progress with no
// lease token: every reservation writes one, and only Release clears it
// without completing; its release_reason counts only then.
func recordColumns(p string) string {
	return strings.NewReplacer("$", p).Replace(`$consumer, $tenant, $key, $state, $fingerprint,
    ($state = 'in_progress' AND $locked_until > now()), $locked_until,
    $attempts, $recovery_point, $recovery_data, $steps, $outcome, $response_code, $response,
    $trace_id, $span_id, $created_at, $updated_at, $completed_at, $response_reason,
    ($state = 'in_progress' AND $lease_token IS NULL),
    CASE WHEN $state = 'in_progress' AND $lease_token IS NULL THEN $release_reason END,
    $response_headers`)
}
