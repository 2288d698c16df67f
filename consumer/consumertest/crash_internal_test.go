package consumertest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// TestCrashIsACrash: in every mode, at each stage, a crash does to the
// worker what a process that dies does: its broker connection drops and
// the broker requeues both deliveries (none was acked, no copy published),
// the transactions it held open are abandoned (they end, nothing
// they wrote commits, a reservation in the group's transaction included),
// no outcome is reported, and the lease is neither released nor extended:
// it expires as it stood.
func TestCrashIsACrash(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 16)
	for _, mode := range Modes() {
		if mode.Separate() {
			continue // the handler runs steps: every mode leases its keys
		}
		for _, tc := range []struct {
			stage kit.Stage
			step  string
			// steps and handlers: the effects that committed before the
			// crash, alone (ModeSingle: the first delivery ran) and in a
			// group (both ran before the group's commit).
			steps, handlers, groupSteps, groupHandlers int
			// open: the transactions open at the crash, the step's and the
			// handler's.
			stepOpen, handlerOpen bool
			completed             bool
		}{
			{stage: kit.StageAfterReserve},
			{stage: kit.StageInStep, step: "charge", stepOpen: true, handlerOpen: true},
			{stage: kit.StageAfterStep, step: "charge", steps: 1, groupSteps: 1, handlerOpen: true},
			{stage: kit.StageBeforeCommit, steps: 1, groupSteps: 2, handlerOpen: true},
			{stage: kit.StageAfterCommit, steps: 1, handlers: 1, groupSteps: 2, groupHandlers: 2, completed: true},
		} {
			names := map[kit.Stage]string{kit.StageAfterReserve: "after-reserve", kit.StageInStep: "in-step", kit.StageAfterStep: "after-step",
				kit.StageBeforeCommit: "before-commit", kit.StageAfterCommit: "after-commit"}
			t.Run(string(mode)+"/"+names[tc.stage], func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				store := deduptest.Store(t, pool, nil)
				effects := pgx.Identifier{store.Config().Schema, "effects"}.Sanitize()
				if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (what text)"); err != nil {
					t.Fatal(err)
				}
				var (
					mu                  sync.Mutex
					stepTxs, handlerTxs []backendTx
				)
				backend := func(txs *[]backendTx, tx pgx.Tx) {
					b, err := serverTx(ctx, tx)
					if err != nil {
						t.Errorf("the transaction's backend: %v", err)
					}
					mu.Lock()
					defer mu.Unlock()
					*txs = append(*txs, b)
				}
				h := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
					backend(&handlerTxs, tx)
					err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
						backend(&stepTxs, tx)
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
				subject := Subject{Store: store, Handler: h, Mode: mode, Check: func(context.Context) error { return nil },
					Config: &consumer.Config{URL: testamqp.URL(), Lease: lease, Steps: true}}
				msgs := []amqp.Publishing{{MessageId: "order-1", Body: []byte("{}")}, {MessageId: "order-2", Body: []byte("{}")}}
				k, err := newPointRun(t, subject, msgs, crashPoint{name: "test", stage: tc.stage, step: tc.step})
				if err != nil {
					t.Fatal(err)
				}
				if err := k.open(); err != nil {
					t.Fatal(err)
				}
				defer k.close()
				if err := k.publishAll(); err != nil {
					t.Fatal(err)
				}
				w, err := k.start(workerOpts{})
				if err != nil {
					t.Fatal(err)
				}
				select {
				case <-w.dead:
				case <-w.ended:
					select {
					case <-w.dead: // it crashed, and its Run returned since
					default:
						t.Fatalf("the worker stopped: %v", w.err)
					}
				case <-time.After(crashWait):
					w.stop() //nolint:errcheck
					t.Fatal("no crash")
				}
				if err := w.stop(); err != nil {
					t.Fatalf("the crashed worker's Run: %v", err)
				}
				k.mu.Lock()
				outcomes, row := k.outcomes, k.row
				k.mu.Unlock()
				if outcomes != 0 || !row.Reached || len(row.TraceIDs) == 0 {
					t.Fatalf("%d outcomes reported, reached %v, traces %q", outcomes, row.Reached, row.TraceIDs)
				}
				// The broker got no ack and no copy: both deliveries are back.
				WaitFor(t, 30*time.Second, "both deliveries back in the queue", func() bool {
					n, err := k.queued()
					return err == nil && n == len(msgs)
				})
				// The abandoned transactions end: Postgres (or the pooler
				// between) saw their connections close and rolled them back.
				mu.Lock()
				var abandoned []backendTx
				if tc.stepOpen {
					abandoned = append(abandoned, stepTxs[len(stepTxs)-1])
				}
				if tc.handlerOpen {
					abandoned = append(abandoned, handlerTxs[len(handlerTxs)-1])
				}
				mu.Unlock()
				WaitFor(t, 30*time.Second, "the abandoned transactions to end", func() bool {
					for _, b := range abandoned {
						if open, err := b.open(ctx, pool); err != nil || open {
							return false
						}
					}
					return true
				})
				var steps, handlers int
				err = pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE what = 'step'), count(*) FILTER (WHERE what = 'handler') FROM "+effects).Scan(&steps, &handlers)
				if err != nil {
					t.Fatal(err)
				}
				wantSteps, wantHandlers := tc.steps, tc.handlers
				if mode != ModeSingle {
					wantSteps, wantHandlers = tc.groupSteps, tc.groupHandlers
				}
				if steps != wantSteps || handlers != wantHandlers {
					t.Fatalf("committed %d steps and %d handlers, want %d and %d", steps, handlers, wantSteps, wantHandlers)
				}
				rec, err := store.Inspect(ctx, dedup.Scope{Consumer: DefaultName, Key: "order-1"})
				switch {
				case errors.Is(err, dedup.ErrNotFound) && tc.stage == kit.StageAfterReserve:
					// A group reserves its keys in its transaction (until a
					// handler runs a step): the reservation died with it.
					return
				case err != nil:
					t.Fatal(err)
				case tc.completed:
					if rec.State != dedup.StateCompleted {
						t.Fatalf("state %s, want completed", rec.State)
					}
					return
				case rec.State != dedup.StateInProgress || !rec.LeaseValid || rec.Released:
					t.Fatalf("state %s, lease valid %v, released %v: want a held lease", rec.State, rec.LeaseValid, rec.Released)
				}
				// Nothing extends or releases the lease: it expires at the time
				// it had when the worker died.
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
}
