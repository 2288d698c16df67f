package dedup

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// gcLease is how long a GC run's hold on its schema lasts unless renewed:
// the run renews it every gcLease/3, and a run whose process died frees the
// schema for the next after at most gcLease.
const gcLease = 30 * time.Second

// errGCLeaseLost is why a run stops that could not renew its lease in time:
// another run may hold the schema by now.
var errGCLeaseLost = errors.New("gc: the run's lease on the schema expired")

// holdGC takes the lease of the schema's GC run (the gc_runs row "keys",
// migration 013) for this run, unless another run holds it (held false).
// The returned context ends when the lease is lost; release gives the
// lease back and stops its renewal.
func (s *Store) holdGC(ctx context.Context) (_ context.Context, release func(), held bool, err error) {
	var b [12]byte
	_, _ = rand.Read(b[:])
	holder := hex.EncodeToString(b[:])
	var got string
	err = s.pool.QueryRow(ctx, s.sql.gcTake, holder, gcLease.Microseconds()).Scan(&got)
	if errors.Is(err, pgx.ErrNoRows) {
		return ctx, nil, false, nil
	}
	if err != nil {
		return ctx, nil, false, fmt.Errorf("take the run's lease: %w", err)
	}
	runCtx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		renewed := time.Now()
		t := time.NewTicker(gcLease / 3)
		defer t.Stop()
		for {
			select {
			case <-runCtx.Done():
				return
			case <-t.C:
			}
			tag, err := s.pool.Exec(runCtx, s.sql.gcRenew, holder, gcLease.Microseconds())
			switch {
			case err == nil && tag.RowsAffected() == 1:
				renewed = time.Now()
			case err == nil, time.Since(renewed) > gcLease*2/3:
				// Taken over, or too close to its end to go on safely.
				cancel(errGCLeaseLost)
				return
			}
		}
	}()
	return runCtx, func() {
		cancel(context.Canceled)
		<-done
		gctx, stop := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer stop()
		_, _ = s.pool.Exec(gctx, s.sql.gcGive, holder)
	}, true, nil
}
