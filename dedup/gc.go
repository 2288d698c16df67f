package dedup

import (
	"context"
	"fmt"
	"time"
)

// gcLock is the advisory lock that keeps GC to one instance at a time.
const gcLock = int64(0x1de3_0002)

// GCResult counts what one GC run deleted.
type GCResult struct {
	// Completed is the number of completed keys older than the retention.
	Completed int64
	// Abandoned is the number of in-progress keys whose lease expired more
	// than the retention ago (workers that died and were never redelivered).
	Abandoned int64
	// Skipped reports that another instance held the GC lock, so nothing ran.
	Skipped bool
}

// GC deletes completed keys older than the retention and leases abandoned
// for longer than the retention, in batches of GCBatchSize rows, each its own
// short statement, so that no long lock is held. Only one instance works at a
// time (an advisory lock); the others return Skipped. A positive retention
// overrides the store's.
func (s *Store) GC(ctx context.Context, retention time.Duration) (GCResult, error) {
	if retention <= 0 {
		retention = s.cfg.Retention
	}
	var res GCResult
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return res, fmt.Errorf("gc: acquire connection: %w", err)
	}
	defer conn.Release()
	var locked bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", gcLock).Scan(&locked); err != nil {
		return res, fmt.Errorf("gc: lock: %w", err)
	}
	if !locked {
		res.Skipped = true
		return res, nil
	}
	defer func() {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", gcLock)
	}()
	for _, step := range []struct {
		sql   string
		count *int64
	}{{s.sql.gcCompleted, &res.Completed}, {s.sql.gcAbandoned, &res.Abandoned}} {
		for {
			tag, err := conn.Exec(ctx, step.sql, retention.Microseconds(), s.cfg.GCBatchSize)
			if err != nil {
				return res, interpretError("gc: delete", err)
			}
			*step.count += tag.RowsAffected()
			if tag.RowsAffected() < int64(s.cfg.GCBatchSize) {
				break
			}
		}
	}
	return res, nil
}
