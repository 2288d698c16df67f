package scale

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
)

// day is the span the loaded keys cover.
const day = 24 * time.Hour

// consumers and tenants are the scopes the keys are spread over.
var consumers = []string{"payments", "ledger", "notify", "audit"}

const tenants = 50

// LoadResult is what the load did, and the simulated day it laid out.
type LoadResult struct {
	// Base is the database time at the load: the day covers [Base-24h, Base).
	Base time.Time
	// Keys and Outbox are the rows loaded.
	Keys, Outbox int
	// Took, KeysTook and OutboxTook are the wall times of the load (the two
	// tables load side by side).
	Took, KeysTook, OutboxTook time.Duration
	// Retired is how many keys earlier runs on the same day had GC retire
	// (Options.Reuse): 0 after a load. Past Keys, GC has gone on into the
	// keys the workers added, with the fixed Retention found then.
	Retired   int
	Retention time.Duration
	// Reused reports that the day was not loaded but taken over (Options.Reuse).
	Reused bool
}

// dayTable records the loaded day in the run's schema, so that a later run
// with Options.Reuse can go on with it.
const dayTable = "scale_day"

// saveDay records l in the schema.
func saveDay(ctx context.Context, pool *pgxpool.Pool, schema string, l LoadResult) error {
	_, err := pool.Exec(ctx, `CREATE TABLE `+schema+`.`+dayTable+` (base timestamptz NOT NULL, keys int NOT NULL, outbox int NOT NULL, retired int NOT NULL, retention_us bigint NOT NULL)`)
	if err == nil {
		_, err = pool.Exec(ctx, `INSERT INTO `+schema+`.`+dayTable+` VALUES ($1, $2, $3, 0, 0)`, l.Base, l.Keys, l.Outbox)
	}
	if err != nil {
		return fmt.Errorf("scale: record the day: %w", err)
	}
	return nil
}

// retired records that GC was asked to retire the first n keys, and the
// fixed retention past the day's end (0 before).
func retired(ctx context.Context, pool *pgxpool.Pool, schema string, n int, retention time.Duration) error {
	if _, err := pool.Exec(ctx, `UPDATE `+schema+`.`+dayTable+` SET retired = $1, retention_us = $2`, n, retention.Microseconds()); err != nil {
		return fmt.Errorf("scale: record the day: %w", err)
	}
	return nil
}

// loadedDay is the day an earlier run left in schema, if it loaded as many
// keys as o asks for.
func loadedDay(ctx context.Context, pool *pgxpool.Pool, o Options) (LoadResult, bool, error) {
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, o.Schema+"."+dayTable).Scan(&exists); err != nil {
		return LoadResult{}, false, fmt.Errorf("scale: look for a loaded day: %w", err)
	}
	if !exists {
		return LoadResult{}, false, nil
	}
	l := LoadResult{Reused: true}
	var us int64
	if err := pool.QueryRow(ctx, `SELECT base, keys, outbox, retired, retention_us FROM `+o.Schema+`.`+dayTable).Scan(&l.Base, &l.Keys, &l.Outbox, &l.Retired, &us); err != nil {
		return LoadResult{}, false, fmt.Errorf("scale: read the loaded day: %w", err)
	}
	l.Retention = time.Duration(us) * time.Microsecond
	if l.Keys != o.Keys || l.Outbox != o.Outbox {
		return LoadResult{}, false, nil
	}
	return l, true, nil
}

// at is the creation time of the i-th of n rows of the day.
func (l LoadResult) at(i, n int) time.Time {
	return l.Base.Add(-day + time.Duration(float64(day)*float64(i)/float64(n)))
}

// retentionFor is the retention GC runs with so that pos keys are retired in
// all. In the day, GC retires to the pos-th loaded key, whose creation time
// the compressed day gives. Past the day's end GC goes on into the keys the
// workers added, in real time: the retention is then fixed, the span in which
// they added as many keys as the day held (found when GC first goes past it,
// kept in l), so that the table keeps the day's row count as a retention in
// service does. So a run may turn the whole table over.
func retentionFor(ctx context.Context, pool *pgxpool.Pool, schema string, l *LoadResult, pos int) (time.Duration, error) {
	var now time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		return 0, fmt.Errorf("scale: clock: %w", err)
	}
	if l.Retention > 0 {
		return l.Retention, nil
	}
	if pos <= l.Keys {
		return now.Sub(l.at(pos, l.Keys)), nil
	}
	var at time.Time
	err := pool.QueryRow(ctx, `SELECT coalesce((SELECT created_at FROM `+schema+`.keys
WHERE created_at >= $1 AND state = 'completed' ORDER BY created_at OFFSET $2 LIMIT 1), now())`, l.Base, pos-l.Keys).Scan(&at)
	if err != nil {
		return 0, fmt.Errorf("scale: retention past the day: %w", err)
	}
	l.Retention = now.Sub(at)
	return l.Retention, nil
}

// scopeOf is the i-th loaded key's scope: deterministic, so that the worker
// can send a duplicate of any stored key without reading it first.
func scopeOf(i int) dedup.Scope {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(i))
	sum := sha256.Sum256(b[:])
	return dedup.Scope{
		Consumer: consumers[i%len(consumers)],
		Tenant:   fmt.Sprintf("tenant-%02d", (i/len(consumers))%tenants),
		Key:      hex.EncodeToString(sum[:8]) + "-" + hex.EncodeToString(sum[8:16]),
	}
}

// fingerprintOf is the fingerprint of a key's operation.
func fingerprintOf(key string) dedup.Fingerprint {
	return sha256.Sum256([]byte("operation " + key))
}

// response is the stored reply of a completed key, of a typical size.
var response = []byte(`{"status":"settled","amount":"125.00","currency":"EUR"}`)

// body is an outbox message body, of a typical size.
var body = []byte(`{"event":"payment.settled","payment":"pay_0000000000000000","amount":"125.00","currency":"EUR","at":"2026-01-01T00:00:00Z"}`)

const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// load copies one simulated day of completed keys and published outbox rows.
func load(ctx context.Context, pool *pgxpool.Pool, o Options) (LoadResult, error) {
	res := LoadResult{Keys: o.Keys, Outbox: o.Outbox}
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&res.Base); err != nil {
		return res, fmt.Errorf("scale: load: %w", err)
	}
	start := time.Now()
	errs := make(chan error, 2)
	go func() {
		t := time.Now()
		err := copyKeys(ctx, pool, o, res)
		res.KeysTook = time.Since(t)
		errs <- err
	}()
	var outboxTook time.Duration
	go func() {
		t := time.Now()
		err := copyOutbox(ctx, pool, o, res)
		outboxTook = time.Since(t)
		errs <- err
	}()
	err1, err2 := <-errs, <-errs
	res.OutboxTook = outboxTook
	res.Took = time.Since(start)
	if err := cmpErr(err1, err2); err != nil {
		return res, err
	}
	// Statistics for the planner and a clean start for the counters: the
	// run begins with a vacuumed table, as a table in service would.
	for _, t := range []string{"keys", "outbox", "outbox_published"} {
		if _, err := pool.Exec(ctx, "VACUUM (ANALYZE) "+o.Schema+"."+t); err != nil {
			return res, fmt.Errorf("scale: load: vacuum %s: %w", t, err)
		}
	}
	// And the load's dirty pages written out now, rather than by the
	// checkpoint that would otherwise spread them over the first cycles.
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		fmt.Fprintf(o.Log, "scale: no checkpoint after the load (%v): the first cycle shares the disk with it\n", err)
	}
	return res, nil
}

func cmpErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func copyKeys(ctx context.Context, pool *pgxpool.Pool, o Options, l LoadResult) error {
	cols := []string{"consumer", "tenant", "key", "state", "fingerprint", "attempts", "outcome",
		"response_code", "response", "trace_id", "span_id", "created_at", "updated_at", "completed_at"}
	i := 0
	n, err := pool.CopyFrom(ctx, pgx.Identifier{o.Schema, "keys"}, cols, pgx.CopyFromFunc(func() ([]any, error) {
		if i == o.Keys {
			return nil, nil
		}
		sc := scopeOf(i)
		fp := fingerprintOf(sc.Key)
		created := l.at(i, o.Keys)
		done := created.Add(40 * time.Millisecond)
		i++
		return []any{sc.Consumer, sc.Tenant, sc.Key, "completed", fp[:], 1, "ok",
			200, response, "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", created, done, done}, nil
	}))
	if err != nil {
		return fmt.Errorf("scale: load keys: %w", err)
	}
	if n != int64(o.Keys) {
		return fmt.Errorf("scale: load keys: copied %d of %d", n, o.Keys)
	}
	return nil
}

// copyOutbox loads the record of published outbox messages (the table
// outbox retention empties: migration 009).
func copyOutbox(ctx context.Context, pool *pgxpool.Pool, o Options, l LoadResult) error {
	cols := []string{"id", "message_id", "exchange", "routing_key", "created_at", "published_at", "attempts", "returns"}
	i := 0
	n, err := pool.CopyFrom(ctx, pgx.Identifier{o.Schema, "outbox_published"}, cols, pgx.CopyFromFunc(func() ([]any, error) {
		if i == o.Outbox {
			return nil, nil
		}
		created := l.at(i, o.Outbox)
		id := scopeOf(i).Key
		i++
		return []any{int64(i), id, "ledger", "payment.settled", created, created.Add(80 * time.Millisecond), 1, 0}, nil
	}))
	if err != nil {
		return fmt.Errorf("scale: load outbox: %w", err)
	}
	if n != int64(o.Outbox) {
		return fmt.Errorf("scale: load outbox: copied %d of %d", n, o.Outbox)
	}
	return nil
}
