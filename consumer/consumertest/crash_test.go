package consumertest_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// The kit's own tests: for each crash point a handler built with the bug
// that point exists to catch, and the report's failing rows, exactly.

var crashOrders = []string{"order-1", "order-2"}

func crashMessages() []amqp.Publishing {
	var msgs []amqp.Publishing
	for _, o := range crashOrders {
		msgs = append(msgs, amqp.Publishing{MessageId: o, Body: []byte(`{"amount":4200}`)})
	}
	return msgs
}

// crashWorld is one Subject's shop plus what a handler's bug may need: the
// store (to read the key's row) and a log of notifications.
type crashWorld struct {
	*shop
	store *dedup.Store

	mu       sync.Mutex
	notified map[string]int
}

func (w *crashWorld) notify(order string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.notified[order]++
}

// checkNotified: the shop's check, and one notification per order.
func (w *crashWorld) checkNotified(orders ...string) func(ctx context.Context) error {
	check := w.check(orders...)
	return func(ctx context.Context) error {
		if err := check(ctx); err != nil {
			return err
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, o := range orders {
			if n := w.notified[o]; n != 1 {
				return fmt.Errorf("%s notified %d times", o, n)
			}
		}
		return nil
	}
}

// forEachMode runs test once per mode that holds its keys in the group's
// transaction unless told otherwise (Steps, which most handlers here run,
// makes them leases: the separate modes would run the same), as parallel
// subtests.
func forEachMode(t *testing.T, test func(t *testing.T, mode consumertest.Mode)) {
	for _, mode := range consumertest.Modes() {
		if mode.Separate() {
			continue
		}
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			test(t, mode)
		})
	}
}

// crashSetup returns a setup whose Subject runs, in mode, the handler
// build makes for a fresh world, declaring Steps; subject may change the
// Subject (its Config, Check).
func crashSetup(t *testing.T, mode consumertest.Mode, build func(w *crashWorld) consumer.Handler, subject func(w *crashWorld, s *consumertest.Subject)) func(testing.TB) consumertest.Subject {
	pool := testdb.Pool(t, 64)
	return func(tb testing.TB) consumertest.Subject {
		store := deduptest.Store(tb, pool, nil)
		ledger := pgx.Identifier{store.Config().Schema, "ledger"}.Sanitize()
		if _, err := pool.Exec(context.Background(), "CREATE TABLE "+ledger+" (order_id text, charge_id text)"); err != nil {
			tb.Fatal(err)
		}
		w := &crashWorld{shop: &shop{pool: pool, ledger: ledger, processor: newCardProcessor()}, store: store, notified: map[string]int{}}
		s := consumertest.Subject{Store: store, Handler: build(w), Mode: mode, Check: w.check(crashOrders...),
			Config: &consumer.Config{URL: testamqp.URL(), Steps: true}}
		if subject != nil {
			subject(w, &s)
		}
		return s
	}
}

// wantFailed fails t unless the report's failing rows are exactly those
// of want, each reached and failing with the error want gives it.
func wantFailed(t *testing.T, rep *consumertest.CrashReport, want map[string]string) {
	t.Helper()
	t.Logf("report (mode %s):\n%s", rep.Mode, rep)
	for _, row := range rep.Rows {
		wantErr, fails := want[row.Point]
		switch {
		case row.Err == nil && fails:
			t.Errorf("%s: passed, want %q", row.Point, wantErr)
		case row.Err != nil && !fails:
			t.Errorf("%s: %v, want a pass", row.Point, row.Err)
		case row.Err != nil && row.Err.Error() != wantErr:
			t.Errorf("%s: %v, want %q", row.Point, row.Err, wantErr)
		}
	}
	for p := range want {
		if row := rep.Row(p); row == nil || !row.Reached {
			t.Errorf("%s: not reached", p)
		}
	}
}

// wantRows fails t unless the report's points are want, in order, and
// every one was reached.
func wantRows(t *testing.T, rep *consumertest.CrashReport, want []string) {
	t.Helper()
	var got []string
	for _, row := range rep.Rows {
		got = append(got, row.Point)
		if !row.Reached {
			t.Errorf("%s: not reached", row.Point)
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("points %q, want %q", got, want)
	}
}

// TestCrashPointsPassTheRightHandler: the card charge done right passes at
// every point, and the report has every point, the step's included.
func TestCrashPointsPassTheRightHandler(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, func(w *crashWorld) consumer.Handler { return chargeRight(w.shop) }, nil), crashMessages()...)
		wantFailed(t, rep, nil)
		want := []string{
			consumertest.PointNone, consumertest.PointAfterReserve,
			consumertest.PointInStep("charge"), consumertest.PointAfterStep("charge"),
			consumertest.PointBeforeCommit, consumertest.PointAfterCommit,
			consumertest.ScenarioDuplicateDuring, consumertest.ScenarioDuplicateAfter, consumertest.ScenarioLeaseExpired,
		}
		wantRows(t, rep, want)
		if rep.Err() != nil {
			t.Fatal(rep.Err())
		}
	})
}

// TestCrashAfterReserve catches a handler that takes a takeover for the
// resumption of an attempt that charged: it looks the charge up instead of
// making it, and the attempt that crashed after the reservation made none.
//
// In the group modes a crash kills the whole group, so the delivery that
// did not reach the point dies after its reservation too: its takeover
// finds no charge wherever its group-mate crashed before it ran (in the
// step, after it); and in the modes that call one handler after the other,
// the group-mate of a slow handler runs only after the second copy took
// its key over (the lease scenario), and that copy made no charge either.
func TestCrashAfterReserve(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler {
			return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
				rec, err := w.store.Inspect(ctx, dedup.Scope{Consumer: consumertest.DefaultName, Tenant: d.Tenant, Key: d.Key})
				if errors.Is(err, dedup.ErrNotFound) {
					// Held by the group's transaction, invisible until it
					// commits: this transaction reserved it first.
					rec, err = &dedup.Record{Attempts: 1}, nil
				}
				if err != nil {
					return consumer.Response{}, err
				}
				err = d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
					var charge string
					if rec.Attempts > 1 {
						charge = w.processor.Lookup(d.DerivedKey("charge")) // the bug
					} else {
						charge = w.processor.Charge(d.DerivedKey("charge"), d.Key, 4200)
					}
					return w.book(ctx, tx, d.Key, charge)
				})
				return consumer.Response{}, err
			}
		}
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, nil), crashMessages()...)
		// (The handler runs steps, so its keys are leases from the first
		// delivery on: the crash after the reservation leaves one, which the
		// redelivery takes over, and the point catches the bug in every
		// mode.)
		want := map[string]string{consumertest.PointAfterReserve: "a delivery never charged"}
		if row := rep.Row(consumertest.PointAfterReserve); row.Err != nil && strings.HasSuffix(row.Err.Error(), " never charged") {
			want[consumertest.PointAfterReserve] = row.Err.Error()
		}
		if mode != consumertest.ModeSingle {
			want[consumertest.PointInStep("charge")] = "order-2 never charged"
			want[consumertest.PointAfterStep("charge")] = "order-2 never charged"
		}
		switch mode {
		case consumertest.ModeGroup:
			want[consumertest.ScenarioLeaseExpired] = "order-2 never charged"
		case consumertest.ModeOptimistic:
			// Whether the slow handler's group-mate runs before or after
			// the second copy took its key over depends on when its group
			// runs again with savepoints: the scenario may catch it or not.
			if row := rep.Row(consumertest.ScenarioLeaseExpired); row.Err != nil && row.Err.Error() == "order-2 never charged" {
				want[consumertest.ScenarioLeaseExpired] = "order-2 never charged"
			}
		}
		wantFailed(t, rep, want)
	})
}

// TestCrashInStep catches a step that calls the processor with a fresh
// request id instead of DerivedKey: the crash after the charge, before the
// step's commit, runs the step again and charges again.
//
// In the modes that call one handler after the other, the slow handler's
// group-mate comes to its step after its lease expired: a step whose lease
// ran out does not start (dedup.Store.Step), so the lease scenario
// passes. It used to fail there ("order-2 charged twice"): the step's
// function charged, then its commit found the lease lost and the copy that
// took the key over charged again. The window is narrowed, not closed: a
// lease that runs out while the function runs still charges twice without
// DerivedKey, so a failure with those words is accepted.
func TestCrashInStep(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler {
			return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
				err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
					charge := w.processor.Charge(rand.Text(), d.Key, 4200) // the bug
					return w.book(ctx, tx, d.Key, charge)
				})
				return consumer.Response{}, err
			}
		}
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, nil), crashMessages()...)
		want := map[string]string{consumertest.PointInStep("charge"): "order-1 charged twice"}
		if row := rep.Row(consumertest.ScenarioLeaseExpired); row.Err != nil && mode != consumertest.ModeSingle &&
			(row.Err.Error() == "order-2 charged twice" || row.Err.Error() == "order-2 charged 3 times") {
			want[consumertest.ScenarioLeaseExpired] = row.Err.Error()
		}
		wantFailed(t, rep, want)
	})
}

// TestCrashAfterStep catches a notification sent outside the step, only
// when this attempt ran the step: the crash right after the step committed
// loses it, and the retry, which skips the step, never sends it.
func TestCrashAfterStep(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler {
			return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
				ranBefore := d.StepDone("charge")
				err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
					return w.book(ctx, tx, d.Key, w.processor.Charge(d.DerivedKey("charge"), d.Key, 4200))
				})
				if err != nil {
					return consumer.Response{}, err
				}
				if !ranBefore {
					w.notify(d.Key) // the bug: not in the step (its outbox), and only once it ran
				}
				return consumer.Response{}, nil
			}
		}
		subject := func(w *crashWorld, s *consumertest.Subject) { s.Check = w.checkNotified(crashOrders...) }
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, subject), crashMessages()...)
		wantFailed(t, rep, map[string]string{consumertest.PointAfterStep("charge"): "order-1 notified 0 times"})
	})
}

// TestCrashBeforeCommit catches the charge made in the handler without a
// step or a derived key: a crash after it, before COMMIT, charges again on
// the redelivery; so does the takeover of a slow handler's key.
func TestCrashBeforeCommit(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		// chargeWrong runs no step: its keys are held as the mode holds them.
		noSteps := func(w *crashWorld, s *consumertest.Subject) { s.Config.Steps = false }
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, func(w *crashWorld) consumer.Handler { return chargeWrong(w.shop) }, noSteps), crashMessages()...)
		wantFailed(t, rep, map[string]string{consumertest.PointBeforeCommit: "order-1 charged twice", consumertest.ScenarioLeaseExpired: "order-1 charged twice"})
	})
}

// TestCrashAfterCommit catches a receipt sent from OnOutcome, after the
// commit, instead of through the outbox in the handler's transaction: the
// crash after COMMIT loses it, and the redelivery is a duplicate.
func TestCrashAfterCommit(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler { return chargeRight(w.shop) }
		// The bug: the receipt is sent from OnOutcome.
		subject := onOutcome(consumer.OutcomeProcessed, func(receipts int) error {
			if receipts != len(crashOrders) {
				return fmt.Errorf("%d receipts for %d orders", receipts, len(crashOrders))
			}
			return nil
		})
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, subject), crashMessages()...)
		wantFailed(t, rep, map[string]string{consumertest.PointAfterCommit: "0 receipts for 2 orders"})
	})
}

// TestCrashDuplicates catches a consumer whose key function does not
// identify the operation (a new key per delivery): a second copy, during
// or after the first, is handled as a new operation, and so is every
// redelivery after a crash.
func TestCrashDuplicates(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler {
			return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
				// chargeRight, for the order the message names.
				err := d.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) error {
					return w.book(ctx, tx, d.MessageID, w.processor.Charge(d.DerivedKey("charge"), d.MessageID, 4200))
				})
				return consumer.Response{}, err
			}
		}
		subject := func(w *crashWorld, s *consumertest.Subject) {
			var mu sync.Mutex
			n := 0
			s.Config.KeyFunc = func(d *amqp.Delivery) string {
				mu.Lock()
				defer mu.Unlock()
				n++
				return d.MessageId + "/" + strconv.Itoa(n) // the bug
			}
		}
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, subject), crashMessages()...)
		// In the group modes a crash in the step kills the group-mate too,
		// which crashes there in turn: the first order comes a third time,
		// with a third key.
		inStep := "order-1 charged twice"
		if mode != consumertest.ModeSingle {
			inStep = "order-1 charged 3 times"
		}
		const twice = "order-1 charged twice"
		wantFailed(t, rep, map[string]string{
			consumertest.PointInStep("charge"): inStep, consumertest.PointAfterStep("charge"): inStep,
			consumertest.PointBeforeCommit: twice, consumertest.PointAfterCommit: twice,
			consumertest.ScenarioDuplicateDuring: twice, consumertest.ScenarioDuplicateAfter: twice,
			consumertest.ScenarioLeaseExpired: twice,
		})
	})
}

// TestCrashReportTable: a failing report's table (a row per point, the
// traces when there are some) and its error.
func TestCrashReportTable(t *testing.T) {
	t.Parallel()
	rep := &consumertest.CrashReport{Rows: []consumertest.CrashRow{
		{Point: consumertest.PointNone, Reached: true},
		{Point: consumertest.PointAfterReserve, Reached: true, Err: errors.New("order-1 charged twice"), TraceIDs: []string{"4bf92f3577b34da6a3ce929d0e0e4736"}},
		{Point: consumertest.PointAfterCommit},
	}}
	lines := strings.Split(rep.String(), "\n")
	want := [][]string{
		{"point", "result", "trace"},
		{"no crash", "passed", "-"},
		{"after the reservation", "FAILED: order-1 charged twice", "4bf92f3577b34da6a3ce929d0e0e4736"},
		{"after COMMIT, before the ack", "not reached", "-"},
	}
	if len(lines) != len(want) {
		t.Fatalf("table:\n%s", rep)
	}
	for i, cells := range want {
		if got := strings.Split(regexp.MustCompile(`\s{2,}`).ReplaceAllString(lines[i], "|"), "|"); !slices.Equal(got, cells) {
			t.Errorf("row %d: %q, want %q", i, got, cells)
		}
	}
	if !rep.Failed() || rep.Err() == nil || !strings.Contains(rep.Err().Error(), "after the reservation") {
		t.Fatalf("Failed %v, Err %v", rep.Failed(), rep.Err())
	}
	if rep.Row(consumertest.PointAfterCommit).Reached || rep.Row("nowhere") != nil {
		t.Fatal("Row")
	}
	passed := &consumertest.CrashReport{Rows: rep.Rows[:1]}
	if passed.Failed() || passed.Err() != nil || strings.Contains(passed.String(), "trace") {
		t.Fatalf("a passing report: %v\n%s", passed.Err(), passed)
	}
}

// TestCrashReportTraces: with a TracerProvider that records, each row has
// the traces of the attempts that crashed (in a scenario, of the first
// copies), and the table shows them.
func TestCrashReportTraces(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		tp := sdktrace.NewTracerProvider()
		t.Cleanup(func() { tp.Shutdown(context.Background()) }) //nolint:errcheck
		subject := func(w *crashWorld, s *consumertest.Subject) { s.Config.TracerProvider = tp }
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, func(w *crashWorld) consumer.Handler { return chargeRight(w.shop) }, subject), crashMessages()...)
		wantFailed(t, rep, nil)
		for _, row := range rep.Rows[1:] {
			if len(row.TraceIDs) != len(crashOrders) {
				t.Errorf("%s: traces %q, want one per message", row.Point, row.TraceIDs)
			}
			for _, id := range row.TraceIDs {
				if tid, err := trace.TraceIDFromHex(id); err != nil || !tid.IsValid() {
					t.Errorf("%s: trace id %q", row.Point, id)
				}
			}
		}
		if head, _, _ := strings.Cut(rep.String(), "\n"); !strings.HasSuffix(head, "trace") {
			t.Fatalf("table without traces:\n%s", rep)
		}
	})
}

// onOutcome is a Subject whose OnOutcome counts the deliveries that got
// outcome (to act on them after the processing, outside its transaction:
// the bug), and whose check gives the count to check once the shop's
// check passed.
func onOutcome(outcome consumer.Outcome, check func(n int) error) func(w *crashWorld, s *consumertest.Subject) {
	return func(w *crashWorld, s *consumertest.Subject) {
		var mu sync.Mutex
		n := 0
		s.Config.OnOutcome = func(e consumer.Event) {
			if e.Outcome == outcome {
				mu.Lock()
				n++
				mu.Unlock()
			}
		}
		shop := s.Check
		s.Check = func(ctx context.Context) error {
			if err := shop(ctx); err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			return check(n)
		}
	}
}

// compensating is a Subject whose OnOutcome compensates (refunds the
// order) on outcome, which is the bug: the delivery is not lost, another
// attempt or copy completes it; and whose check wants no refund.
func compensating(outcome consumer.Outcome) func(w *crashWorld, s *consumertest.Subject) {
	return onOutcome(outcome, func(refunds int) error {
		if refunds > 0 {
			return errors.New("charged orders refunded")
		}
		return nil
	})
}

// TestCrashDuplicateDuring catches a consumer that gives up on a message
// whose key another copy holds (it refunds on in_progress): the second
// copy during the first is not a failure, it comes back later and is a
// duplicate. The redelivery after a crash before the commit finds the key
// held too (by the dead worker's lease, until it expires), and comes back
// later to take it over: the bug shows at those points as well. A lease of
// 5s makes sure the broker's redelivery comes while the lease holds.
func TestCrashDuplicateDuring(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler { return chargeRight(w.shop) }
		subject := func(w *crashWorld, s *consumertest.Subject) {
			compensating(consumer.OutcomeInProgress)(w, s)
			s.Config.Lease = 5 * time.Second
		}
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, subject), crashMessages()...)
		const refunded = "charged orders refunded"
		want := map[string]string{
			consumertest.ScenarioDuplicateDuring:  refunded,
			consumertest.PointInStep("charge"):    refunded,
			consumertest.PointAfterStep("charge"): refunded,
			consumertest.PointBeforeCommit:        refunded,
		}
		// (The handler runs steps: its keys are leases from the first
		// delivery on, and the crash after the reservation leaves one held,
		// which the redelivery finds busy.)
		want[consumertest.PointAfterReserve] = refunded
		wantFailed(t, rep, want)
	})
}

// TestCrashLeaseExpired catches a consumer that compensates an attempt
// that lost its lease (it refunds on lease_lost): the attempt that took the
// key over completed the charge.
func TestCrashLeaseExpired(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode consumertest.Mode) {
		build := func(w *crashWorld) consumer.Handler { return chargeRight(w.shop) }
		rep := consumertest.CrashPoints(t, crashSetup(t, mode, build, compensating(consumer.OutcomeLeaseLost)), crashMessages()...)
		wantFailed(t, rep, map[string]string{consumertest.ScenarioLeaseExpired: "charged orders refunded"})
	})
}
