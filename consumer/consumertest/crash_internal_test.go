package consumertest

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testdb"
)

// TestCrashIsACrash: at each stage, a crash does to the attempt what a
// process that dies does: its open transactions are abandoned (their
// backends end, nothing they wrote commits), nothing is acked or
// published, no outcome is reported, and the lease is neither released nor
// extended: it expires as it stood.
func TestCrashIsACrash(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 8)
	for _, tc := range []struct {
		stage kit.Stage
		step  string
		// committed: the effects that committed before the crash.
		committed []string
		completed bool
	}{
		{stage: kit.StageAfterReserve},
		{stage: kit.StageInStep, step: "charge"},
		{stage: kit.StageAfterStep, step: "charge", committed: []string{"step"}},
		{stage: kit.StageBeforeCommit, committed: []string{"step"}},
		{stage: kit.StageAfterCommit, committed: []string{"step", "handler"}, completed: true},
	} {
		t.Run(fmt.Sprint(tc.stage, tc.step), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			store := deduptest.Store(t, pool, nil)
			effects := pgx.Identifier{store.Config().Schema, "effects"}.Sanitize()
			if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (what text)"); err != nil {
				t.Fatal(err)
			}
			var (
				mu   sync.Mutex
				pids []uint32
			)
			backend := func(tx pgx.Tx) {
				mu.Lock()
				defer mu.Unlock()
				pids = append(pids, tx.Conn().PgConn().PID())
			}
			h := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
				backend(tx)
				err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
					backend(tx)
					_, err := tx.Exec(ctx, "INSERT INTO "+effects+" VALUES ('step')")
					return err
				})
				if err != nil {
					return consumer.Response{}, err
				}
				_, err = tx.Exec(ctx, "INSERT INTO "+effects+" VALUES ('handler')")
				return consumer.Response{}, err
			}
			const lease = 3 * time.Second
			r := NewRunner(store, h, &consumer.Config{Lease: lease})
			var stages []kit.Stage
			at := func(_ context.Context, stage kit.Stage, step string) bool {
				stages = append(stages, stage)
				return stage == tc.stage && step == tc.step
			}
			a, err := r.attempt(t, amqp.Publishing{MessageId: "order-1", Body: []byte("{}")}, attemptOpts{at: at})
			if err != nil {
				t.Fatal(err)
			}
			if !a.run.Crashed || a.run.Stage != tc.stage || stages[len(stages)-1] != tc.stage {
				t.Fatalf("crashed %v at %v, want %v (stages %v)", a.run.Crashed, a.run.Stage, tc.stage, stages)
			}
			if a.Acked || a.Requeued || len(a.run.Published) > 0 || a.Outcome != "" {
				t.Fatalf("acked %v, requeued %v, published %d, outcome %q", a.Acked, a.Requeued, len(a.run.Published), a.Outcome)
			}
			rec := a.Record
			switch {
			case rec == nil:
				t.Fatal("no key row")
			case tc.completed && rec.State != dedup.StateCompleted:
				t.Fatalf("state %s, want completed", rec.State)
			case !tc.completed && (rec.State != dedup.StateInProgress || !rec.LeaseValid || rec.Released):
				t.Fatalf("state %s, lease valid %v, released %v: want a held lease", rec.State, rec.LeaseValid, rec.Released)
			}
			// The abandoned transactions' backends end: Postgres saw their
			// connections close and rolled them back.
			mu.Lock()
			open := slices.Clone(pids)
			mu.Unlock()
			if tc.stage == kit.StageAfterStep || tc.stage == kit.StageBeforeCommit {
				open = open[:1] // the step's transaction committed
			} else if tc.stage == kit.StageAfterCommit {
				open = nil
			}
			WaitFor(t, 30*time.Second, "the abandoned backends to end", func() bool {
				var n int
				err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)", open).Scan(&n)
				return err == nil && n == 0
			})
			rows, err := pool.Query(ctx, "SELECT what FROM "+effects+" ORDER BY what DESC")
			if err != nil {
				t.Fatal(err)
			}
			got, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tc.committed) {
				t.Fatalf("committed %q, want %q", got, tc.committed)
			}
			if tc.completed {
				return
			}
			// Nothing extends or releases the lease: it expires at the time
			// it had when the attempt crashed.
			WaitFor(t, lease+30*time.Second, "the lease to expire", func() bool {
				now, err := store.Inspect(ctx, rec.Scope)
				if err != nil {
					t.Fatal(err)
				}
				if !now.LockedUntil.Equal(*rec.LockedUntil) || now.Released {
					t.Fatalf("locked until %v, released %v: was %v", now.LockedUntil, now.Released, rec.LockedUntil)
				}
				return !now.LeaseValid
			})
		})
	}
}
