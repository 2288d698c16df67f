package scale

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/outboxsql"
	"github.com/idemq/idemq/outbox"
)

// Phases a worker operation is counted in: by what GC was doing when it
// began. phaseVacuum is told from phaseDelete by followVacuum.
const (
	phaseQuiet  = iota
	phaseDelete // GC's DELETE batches and their pauses
	phaseVacuum // GC's VACUUM of a table (GCOptions.Vacuum)
	phases
)

// recorder collects the worker's latencies per phase, and the longest lock
// wait seen, until taken.
type recorder struct {
	phase atomic.Int32

	mu   sync.Mutex
	lat  [phases][]time.Duration
	errs [phases]int
	dups int
	wait [phases]time.Duration
	// waitKind is the pg_locks locktype of the longest wait.
	waitKind [phases]string
	missed   int
	// firstErr is the first worker error since the last take, so that a
	// count of errors comes with what they were.
	firstErr error
}

func (r *recorder) add(p int32, d time.Duration, dup bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		r.errs[p]++
		if r.firstErr == nil {
			r.firstErr = err
		}
		return
	}
	r.lat[p] = append(r.lat[p], d)
	if dup {
		r.dups++
	}
}

func (r *recorder) lockWait(p int32, d time.Duration, kind string) {
	r.mu.Lock()
	if d > r.wait[p] {
		r.wait[p], r.waitKind[p] = d, kind
	}
	r.mu.Unlock()
}

func (r *recorder) miss() {
	r.mu.Lock()
	r.missed++
	r.mu.Unlock()
}

// window is what the recorder collected since the last take.
type window struct {
	lat      [phases][]time.Duration
	errs     [phases]int
	wait     [phases]time.Duration
	waitKind [phases]string
	dups     int
	missed   int
	firstErr error
}

func (r *recorder) take() window {
	r.mu.Lock()
	defer r.mu.Unlock()
	w := window{lat: r.lat, errs: r.errs, wait: r.wait, waitKind: r.waitKind, dups: r.dups, missed: r.missed, firstErr: r.firstErr}
	r.lat, r.errs, r.wait, r.waitKind, r.dups, r.missed, r.firstErr = [phases][]time.Duration{}, [phases]int{}, [phases]time.Duration{}, [phases]string{}, 0, 0, nil
	for p := range w.lat {
		slices.Sort(w.lat[p])
	}
	return w
}

// quantile of sorted durations, 0 when there are none.
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q * float64(len(sorted)-1))
	return sorted[i]
}

// worker runs operations at a steady rate: new keys (reserve, then enqueue
// and complete in one transaction) and duplicates of stored keys.
type worker struct {
	o     Options
	pool  *pgxpool.Pool
	store *dedup.Store
	ob    *outbox.Outbox
	rec   *recorder

	// inserted counts the new keys the worker completed.
	inserted atomic.Int64
	// retired is the index of the oldest loaded key GC has not been asked
	// to retire yet: duplicates pick among the keys after it.
	retired atomic.Int64
}

// run starts o.Concurrency goroutines fed by a pacer at o.Rate operations a
// second, until ctx ends.
func (w *worker) run(ctx context.Context) {
	tokens := make(chan struct{}, w.o.Rate)
	var wg sync.WaitGroup
	for range w.o.Concurrency {
		wg.Go(func() {
			for {
				select {
				case <-ctx.Done():
					return
				case <-tokens:
				}
				p := w.rec.phase.Load()
				start := time.Now()
				dup, err := w.op(ctx)
				if ctx.Err() != nil {
					return
				}
				w.rec.add(p, time.Since(start), dup, err)
			}
		})
	}
	const tick = 10 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	last, owed := time.Now(), 0.0
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case now := <-t.C:
			owed += float64(w.o.Rate) * now.Sub(last).Seconds()
			last = now
			for ; owed >= 1; owed-- {
				select {
				case tokens <- struct{}{}:
				default:
					w.rec.miss() // the workers are a second behind
				}
			}
		}
	}
}

// op runs one operation and reports whether it was a duplicate.
func (w *worker) op(ctx context.Context) (bool, error) {
	lo := int(w.retired.Load())
	lo += (w.o.Keys - lo) / 100 // keep clear of the keys GC is retiring
	// Duplicates repeat loaded keys, while GC has left some.
	if lo < w.o.Keys && mrand.Float64() < w.o.Duplicates {
		sc := scopeOf(lo + mrand.IntN(w.o.Keys-lo))
		res, err := w.store.Reserve(ctx, dedup.Claim{Scope: sc, Fingerprint: fingerprintOf(sc.Key)})
		if err != nil {
			return true, err
		}
		if res.Decision != dedup.Duplicate {
			return true, fmt.Errorf("a stored key came back %s", res.Decision)
		}
		return true, nil
	}
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	sc := dedup.Scope{
		Consumer: consumers[mrand.IntN(len(consumers))],
		Tenant:   fmt.Sprintf("tenant-%02d", mrand.IntN(tenants)),
		Key:      hex.EncodeToString(raw[:8]) + "-" + hex.EncodeToString(raw[8:]),
	}
	res, err := w.store.Reserve(ctx, dedup.Claim{Scope: sc, Fingerprint: fingerprintOf(sc.Key)})
	if err != nil {
		return false, err
	}
	if res.Decision != dedup.Acquired {
		return false, fmt.Errorf("a new key came back %s", res.Decision)
	}
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return false, errors.Join(fmt.Errorf("begin: %w", err), w.store.Release(context.WithoutCancel(ctx), res.Lease, "retried"))
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// As the consumer does: the relays are woken after the commit, not by a
	// NOTIFY in the transaction, which would make the commits wait in line.
	ctx = outbox.WakeAfterCommit(ctx)
	if err := w.ob.Enqueue(ctx, tx, outbox.Message{Exchange: "ledger", RoutingKey: "payment.settled",
		Body: body, ContentType: "application/json", MessageID: sc.Key}); err != nil {
		return false, err
	}
	if err := w.store.Complete(ctx, tx, res.Lease, dedup.Result{Outcome: dedup.OutcomeOK, Code: 200, Response: response}); err != nil {
		return false, err
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("commit: %w", err)
	}
	outbox.Wake(ctx)
	w.inserted.Add(1)
	return false, nil
}

// markPublished stands in for the relay: every interval it picks pending
// outbox rows and moves them into the record of published messages with
// the relay's own statement (outboxsql.MarkPublished), so that GC has
// published rows to retire. It runs alone, so it locks nothing, and each
// move commits on its own, at once: the rows are stamped published just
// before they become visible, as GC expects of a relay's quick commit. The
// broker is not part of this measurement.
func markPublished(ctx context.Context, pool *pgxpool.Pool, o Options) {
	pick := `SELECT id FROM ` + pgx.Identifier{o.Schema, "outbox"}.Sanitize() + `
WHERE published_at IS NULL AND parked_at IS NULL AND available_at <= now()
ORDER BY id LIMIT 1000`
	mark := outboxsql.MarkPublished(o.Schema)
	batch := func() (int, error) {
		rows, _ := pool.Query(ctx, pick)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil || len(ids) == 0 {
			return 0, err
		}
		_, err = pool.Exec(ctx, mark, ids)
		return len(ids), err
	}
	every(ctx, 100*time.Millisecond, func() {
		for {
			n, err := batch()
			if err != nil || n < 1000 {
				return
			}
		}
	})
}

// every runs fn every interval until ctx ends.
func every(ctx context.Context, interval time.Duration, fn func()) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			fn()
		}
	}
}

// followVacuum moves the recorder between phaseDelete and phaseVacuum while
// GC runs: every interval it looks for a VACUUM of a table of schema in
// pg_stat_progress_vacuum, until ctx ends.
func followVacuum(ctx context.Context, pool *pgxpool.Pool, schema string, rec *recorder) {
	const sql = `SELECT EXISTS (SELECT FROM pg_stat_progress_vacuum v
    JOIN pg_class c ON c.oid = v.relid JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = $1)`
	every(ctx, 50*time.Millisecond, func() {
		var on bool
		if err := pool.QueryRow(ctx, sql, schema).Scan(&on); err != nil {
			return
		}
		if on {
			rec.phase.CompareAndSwap(phaseDelete, phaseVacuum)
		} else {
			rec.phase.CompareAndSwap(phaseVacuum, phaseDelete)
		}
	})
}

// sampleLockWaits polls pg_locks for the longest wait of a worker statement
// still waiting, every interval, until ctx ends.
func sampleLockWaits(ctx context.Context, pool *pgxpool.Pool, rec *recorder) {
	const sql = `SELECT coalesce(extract(epoch FROM clock_timestamp() - l.waitstart), 0), l.locktype
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE NOT l.granted AND a.application_name = $1 AND l.waitstart IS NOT NULL
ORDER BY l.waitstart LIMIT 1`
	every(ctx, 50*time.Millisecond, func() {
		p := rec.phase.Load()
		var secs float64
		var kind string
		if err := pool.QueryRow(ctx, sql, appWorker).Scan(&secs, &kind); err == nil {
			rec.lockWait(p, time.Duration(secs*float64(time.Second)), kind)
		}
	})
}
