package conformance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
)

// behaviour is what the handler does for one key, on its n-th call.
type behaviour func(ctx context.Context, tx pgx.Tx, c Call, n int) Act

// suite is one door under the scenarios, and its handler's memory.
type suite struct {
	door Door

	mu     sync.Mutex
	behave map[string]behaviour
	calls  map[string][]Call
}

func id(tenant, key string) string { return tenant + "\x00" + key }

// handle is the suite's handler: it records the call, writes one effect
// row in tx, and does what the key's behaviour says (by default: succeed
// with doneBody).
func (s *suite) handle(ctx context.Context, tx pgx.Tx, c Call) Act {
	s.mu.Lock()
	k := id(c.Tenant, c.Key)
	s.calls[k] = append(s.calls[k], c)
	n, b := len(s.calls[k]), s.behave[k]
	s.mu.Unlock()
	return act(ctx, tx, c, n, b)
}

// act writes the call's effect and runs b.
func act(ctx context.Context, tx pgx.Tx, c Call, n int, b behaviour) Act {
	if _, err := tx.Exec(ctx, fmt.Sprintf("INSERT INTO %s.conformance_effects (tenant, key, call, attempt) VALUES ($1, $2, $3, $4)",
		pgx.Identifier{c.Schema}.Sanitize()), c.Tenant, c.Key, n, c.Attempt); err != nil {
		return Act{Kind: Fail}
	}
	if b == nil {
		return Act{Kind: Succeed, Code: 201, Body: doneBody(c.Key, n)}
	}
	return b(ctx, tx, c, n)
}

// on sets the behaviour of a key.
func (s *suite) on(tenant, key string, b behaviour) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.behave[id(tenant, key)] = b
}

// callsOf returns the handler's calls for a key.
func (s *suite) callsOf(tenant, key string) []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls[id(tenant, key)])
}

// Run runs every scenario against the door newDoor makes, one after the
// other on one door (each scenario has keys of its own).
func Run(t *testing.T, newDoor NewDoor) {
	s := &suite{behave: map[string]behaviour{}, calls: map[string][]Call{}}
	s.door = newDoor(t, s.handle)
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			if sc.skip != nil {
				if why := sc.skip(s.door.Features()); why != "" {
					t.Skip("SKIPPED, not passed: " + why)
				}
			}
			sc.run(t, s, strings.ReplaceAll(sc.name, "_", "-"))
		})
	}
}

// scenario is one of the protocol's situations.
type scenario struct {
	name string
	// skip, when it returns a reason, skips the scenario for the door.
	skip func(Features) string
	run  func(t *testing.T, s *suite, prefix string)
}

var scenarios = []scenario{
	{name: "first_delivery", run: firstDelivery},
	{name: "duplicate_after_completion", run: duplicateAfterCompletion},
	{name: "duplicate_while_in_progress", run: duplicateWhileInProgress},
	{name: "key_reused_with_another_fingerprint", run: keyReuse},
	{name: "business_rejection_stored_and_replayed", run: rejection},
	{name: "infrastructure_failure_released_and_retried", run: infraFailure},
	{name: "lease_lost", run: leaseLost},
	{name: "expired_lease_taken_over", run: expiredLease},
	{name: "crash_at_each_stage_boundary", run: crash},
	{name: "tenant_isolation", run: tenantIsolation},
	{name: "key_and_tenant_limits", run: limits},
}

// --- assertions

func (s *suite) wantResult(t *testing.T, what string, a Answer, want Result) {
	t.Helper()
	if a.Result != want {
		t.Fatalf("%s: %s, want %s", what, a, want)
	}
}

// wantEffects checks that the key's committed effects are those of the
// calls listed (by call number).
func (s *suite) wantEffects(t *testing.T, tenant, key string, calls ...int) {
	t.Helper()
	got, err := effects(context.Background(), s.door.Store(), tenant, key)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, calls) && !(len(got) == 0 && len(calls) == 0) {
		t.Errorf("committed effects of calls %v, want of calls %v (handler calls: %d)", got, calls, len(s.callsOf(tenant, key)))
	}
}

// wantCalls checks that the handler ran n times for the key.
func (s *suite) wantCalls(t *testing.T, tenant, key string, n int) {
	t.Helper()
	if got := len(s.callsOf(tenant, key)); got != n {
		t.Errorf("handler ran %d times, want %d", got, n)
	}
}

// record reads the key's row.
func (s *suite) record(t *testing.T, tenant, key string) *dedup.Record {
	t.Helper()
	rec, err := s.door.Store().Inspect(context.Background(), s.door.Scope(tenant, key))
	if err != nil {
		t.Fatalf("inspect the key: %v", err)
	}
	return rec
}

// wantNoRecord checks that the key has no row.
func (s *suite) wantNoRecord(t *testing.T, tenant, key string) {
	t.Helper()
	if !utf8.ValidString(key) {
		return // a text column holds no such key
	}
	sc := s.door.Scope(tenant, key)
	var n int
	if err := s.door.Store().Pool().QueryRow(context.Background(), fmt.Sprintf("SELECT count(*) FROM %s.keys WHERE consumer = $1 AND tenant = $2 AND key = $3",
		pgx.Identifier{s.door.Store().Config().Schema}.Sanitize()), sc.Consumer, sc.Tenant, sc.Key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d key rows, want none", n)
	}
}

// wantCompleted checks that the key is completed with the outcome, code
// and body the user got.
func (s *suite) wantCompleted(t *testing.T, tenant, key string, outcome dedup.Outcome, a Answer) *dedup.Record {
	t.Helper()
	rec := s.record(t, tenant, key)
	if rec.State != dedup.StateCompleted || rec.Result == nil {
		t.Fatalf("key row state %s, want completed", rec.State)
	}
	if rec.Result.Outcome != outcome || rec.Result.Code != a.Code || !bytes.Equal(rec.Result.Response, a.Body) {
		t.Errorf("stored %s %d %q, the user got %d %q; want %s", rec.Result.Outcome, rec.Result.Code, rec.Result.Response, a.Code, a.Body, outcome)
	}
	return rec
}

// wantReplay checks that a duplicate got the first answer's bytes.
func wantReplay(t *testing.T, first, dup Answer) {
	t.Helper()
	if dup.Result != Duplicate {
		t.Fatalf("second copy: %s, want %s", dup, Duplicate)
	}
	if dup.Code != first.Code || !bytes.Equal(dup.Body, first.Body) {
		t.Errorf("replayed %d %q, the first got %d %q", dup.Code, dup.Body, first.Code, first.Body)
	}
}

func op(key string, body string) Op { return Op{Key: key, Body: []byte(body)} }

// --- scenarios

// deadLease is the lease a dead owner left: long enough that the
// operation sent after it surely finds it valid (and the key busy), even
// on a loaded machine.
const deadLease = 2 * time.Second

// firstDelivery: a new key runs the handler once, and its result is
// stored with the key, the effect committed with it.
func firstDelivery(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	a := s.door.Send(t, op(key, `{"amount":100}`)).Wait(t)
	s.wantResult(t, "first delivery", a, Processed)
	if a.Code != 201 || !bytes.Equal(a.Body, doneBody(key, 1)) {
		t.Errorf("answer %d %q, want 201 %q", a.Code, a.Body, doneBody(key, 1))
	}
	rec := s.wantCompleted(t, "", key, dedup.OutcomeOK, a)
	if rec.Attempts != 1 || rec.Fingerprint != s.door.Fingerprint(op(key, `{"amount":100}`)) {
		t.Errorf("key row: attempts %d, fingerprint %x; want 1 and the operation's", rec.Attempts, rec.Fingerprint)
	}
	s.wantCalls(t, "", key, 1)
	s.wantEffects(t, "", key, 1)
}

// duplicateAfterCompletion: a second copy after the first completed never
// reaches the handler and gets the stored result, byte for byte.
func duplicateAfterCompletion(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	o := op(key, `{"amount":100}`)
	first := s.door.Send(t, o).Wait(t)
	s.wantResult(t, "first copy", first, Processed)
	for i := range 2 {
		wantReplay(t, first, s.door.Send(t, o).Wait(t))
		_ = i
	}
	s.wantCalls(t, "", key, 1)
	s.wantEffects(t, "", key, 1)
	s.wantCompleted(t, "", key, dedup.OutcomeOK, first)
}

// blocker is a behaviour whose first call blocks until released (or its
// context ends, whose cause it keeps).
type blocker struct {
	entered chan struct{}
	release chan struct{}
	pid     uint32

	mu    sync.Mutex
	cause error
}

func newBlocker() *blocker {
	return &blocker{entered: make(chan struct{}), release: make(chan struct{})}
}

func (b *blocker) behaviour(ctx context.Context, tx pgx.Tx, c Call, n int) Act {
	if n > 1 {
		return Act{Kind: Succeed, Code: 201, Body: doneBody(c.Key, n)}
	}
	_ = tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&b.pid)
	close(b.entered)
	select {
	case <-b.release:
		return Act{Kind: Succeed, Code: 201, Body: doneBody(c.Key, n)}
	case <-ctx.Done():
		b.setCause(context.Cause(ctx))
		return Act{Kind: Fail}
	case <-time.After(waitTimeout):
		b.setCause(errors.New("never released"))
		return Act{Kind: Fail}
	}
}

func (b *blocker) setCause(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cause = err
}

func (b *blocker) causeOf() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cause
}

func (b *blocker) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-b.entered:
	case <-time.After(waitTimeout):
		t.Fatal("the handler was never called")
	}
}

// waitBlocked waits until another backend waits for the lock the blocked
// call's transaction holds.
func (s *suite) waitBlocked(t *testing.T, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		var n int
		if err := s.door.Store().Pool().QueryRow(context.Background(),
			"SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", pid).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the second copy never waited for the first's transaction")
		}
		time.Sleep(20 * time.Millisecond) // polling pg_stat_activity: nothing to wait on
	}
}

// duplicateWhileInProgress: a second copy while the first's handler runs
// never reaches the handler: it finds the key busy (held reservations:
// it waits for the first's commit), then gets the first's result.
func duplicateWhileInProgress(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	o := op(key, `{"amount":100}`)
	b := newBlocker()
	s.on("", key, b.behaviour)
	first := s.door.Send(t, o)
	b.waitEntered(t)
	second := s.door.Send(t, o)
	switch f := s.door.Features(); {
	case f.HeldReservations && f.BusyAtOnce:
		// Busy at once, though the key is in progress in no row yet.
		second.WaitSeen(t, InProgress)
		s.wantNoRecord(t, "", key)
	case f.HeldReservations:
		s.waitBlocked(t, b.pid)
	default:
		second.WaitSeen(t, InProgress)
		if rec := s.record(t, "", key); rec.State != dedup.StateInProgress || !rec.LeaseValid {
			t.Errorf("key row while the first runs: %s, lease valid %v; want in progress", rec.State, rec.LeaseValid)
		}
	}
	close(b.release)
	fa := first.Wait(t)
	s.wantResult(t, "first copy", fa, Processed)
	wantReplay(t, fa, second.Wait(t))
	s.wantCalls(t, "", key, 1)
	s.wantEffects(t, "", key, 1)
}

// keyReuse: the same key with another body is refused, and the key keeps
// the first operation's fingerprint and result.
func keyReuse(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	first := s.door.Send(t, op(key, `{"amount":100}`)).Wait(t)
	s.wantResult(t, "first operation", first, Processed)
	other := s.door.Send(t, op(key, `{"amount":999}`)).Wait(t)
	s.wantResult(t, "same key, other body", other, KeyReuse)
	if other.Code == first.Code && bytes.Equal(other.Body, first.Body) {
		t.Errorf("the reused key got the first operation's result")
	}
	rec := s.wantCompleted(t, "", key, dedup.OutcomeOK, first)
	if rec.Fingerprint != s.door.Fingerprint(op(key, `{"amount":100}`)) {
		t.Errorf("the key's fingerprint changed")
	}
	s.wantCalls(t, "", key, 1)
	s.wantEffects(t, "", key, 1)
}

// rejection: a business rejection is the operation's result: its effects
// commit, it is stored and replayed to duplicates.
func rejection(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	body := []byte(`{"error":"insufficient_funds"}`)
	s.on("", key, func(context.Context, pgx.Tx, Call, int) Act { return Act{Kind: Reject, Code: 402, Body: body} })
	o := op(key, `{"amount":99999}`)
	first := s.door.Send(t, o).Wait(t)
	s.wantResult(t, "rejected operation", first, Rejected)
	if first.Code != 402 || !bytes.Equal(first.Body, body) {
		t.Errorf("rejection %d %q, want 402 %q", first.Code, first.Body, body)
	}
	wantReplay(t, first, s.door.Send(t, o).Wait(t))
	s.wantCompleted(t, "", key, dedup.OutcomeRejected, first)
	s.wantCalls(t, "", key, 1)
	s.wantEffects(t, "", key, 1)
}

// infraFailure: an infrastructure failure rolls its effects back and
// releases the key; the retry with the same key runs again (twice here),
// and the third attempt's result is the one stored.
func infraFailure(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	s.on("", key, func(ctx context.Context, tx pgx.Tx, c Call, n int) Act {
		if c.Attempt < 3 {
			return Act{Kind: Fail}
		}
		return Act{Kind: Succeed, Code: 201, Body: doneBody(c.Key, n)}
	})
	a := s.door.Send(t, op(key, `{"amount":100}`)).Wait(t)
	s.wantResult(t, "after two failures", a, Processed)
	if n := countOf(a.History, Retried); n != 2 {
		t.Errorf("retried %d times (%v), want 2", n, a.History)
	}
	rec := s.wantCompleted(t, "", key, dedup.OutcomeOK, a)
	calls := s.callsOf("", key)
	var attempts []int
	for _, c := range calls {
		if !slices.Contains(attempts, c.Attempt) {
			attempts = append(attempts, c.Attempt)
		}
	}
	if !slices.Equal(attempts, []int{1, 2, 3}) {
		t.Errorf("the handler saw attempts %v, want [1 2 3]", attempts)
	}
	wantAttempts := 3
	if s.door.Features().ReleaseForgets {
		wantAttempts = 1 // each failure deleted the row
	}
	if rec.Attempts != wantAttempts {
		t.Errorf("key row attempts %d, want %d", rec.Attempts, wantAttempts)
	}
	// Only the last call's effect committed.
	s.wantEffects(t, "", key, len(calls))
}

// leaseLost: the key is taken from under a running handler (a new lease
// token, as a takeover writes): the handler's context ends with
// dedup.ErrLeaseLost, its effects never commit, and the operation runs
// again once the other owner's lease ended. Held reservations have no
// lease others can take: there the lock that is the lease is lost (the
// transaction's backend dies), and the handler cannot commit either.
func leaseLost(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	b := newBlocker()
	s.on("", key, b.behaviour)
	p := s.door.Send(t, op(key, `{"amount":100}`))
	b.waitEntered(t)
	held := s.door.Features().HeldReservations
	if held {
		var ok bool
		if err := s.door.Store().Pool().QueryRow(context.Background(), "SELECT pg_terminate_backend($1)", b.pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("terminate the holder's backend: %v %v", ok, err)
		}
		close(b.release)
	} else {
		sc := s.door.Scope("", key)
		tag, err := s.door.Store().Pool().Exec(context.Background(), fmt.Sprintf(
			"UPDATE %s.keys SET lease_token = gen_random_uuid() WHERE consumer = $1 AND tenant = $2 AND key = $3 AND state = 'in_progress'",
			pgx.Identifier{s.door.Store().Config().Schema}.Sanitize()), sc.Consumer, sc.Tenant, sc.Key)
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("take the lease: %v, %d rows", err, tag.RowsAffected())
		}
	}
	a := p.Wait(t)
	s.wantResult(t, "after the lease was lost", a, Processed)
	if !held {
		if cause := b.causeOf(); !errors.Is(cause, dedup.ErrLeaseLost) {
			t.Errorf("the handler's context ended with %v, want dedup.ErrLeaseLost", cause)
		}
		if !slices.Contains(a.History, LeaseLost) {
			t.Errorf("answers on the way %v, want a %s", a.History, LeaseLost)
		}
	} else if !slices.Contains(a.History, Retried) && !slices.Contains(a.History, LeaseLost) {
		t.Errorf("answers on the way %v, want a %s or %s", a.History, Retried, LeaseLost)
	}
	calls := s.callsOf("", key)
	if len(calls) < 2 {
		t.Fatalf("handler ran %d times, want the lost call and the one after", len(calls))
	}
	s.wantEffects(t, "", key, len(calls))
	s.wantCompleted(t, "", key, dedup.OutcomeOK, a)
}

// expiredLease: a worker died holding the key (its reservation is left,
// leased for deadLease): the operation finds the key busy, then takes it
// over once the lease expired (attempts 2), and the dead owner can no
// longer complete it.
func expiredLease(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	o := op(key, `{"amount":100}`)
	res, err := s.door.Store().Reserve(context.Background(), dedup.Claim{
		Scope: s.door.Scope("", key), Fingerprint: s.door.Fingerprint(o), Lease: deadLease})
	if err != nil || res.Decision != dedup.Acquired {
		t.Fatalf("the dead owner's reservation: %v %v", res.Decision, err)
	}
	a := s.door.Send(t, o).Wait(t)
	s.wantResult(t, "after the takeover", a, Processed)
	if !slices.Contains(a.History, InProgress) {
		t.Errorf("answers on the way %v, want a %s while the dead owner's lease held", a.History, InProgress)
	}
	rec := s.wantCompleted(t, "", key, dedup.OutcomeOK, a)
	if rec.Attempts != 2 {
		t.Errorf("key row attempts %d, want 2 (a takeover)", rec.Attempts)
	}
	s.wantCalls(t, "", key, 1)
	s.wantEffects(t, "", key, 1)
	// The dead owner comes back: fenced.
	tx, err := s.door.Store().Pool().Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // a no-op after the failed completion
	if err := s.door.Store().Complete(context.Background(), tx, res.Lease, dedup.Result{Outcome: dedup.OutcomeOK, Code: 500}); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Errorf("the dead owner's completion: %v, want dedup.ErrLeaseLost", err)
	}
}

// crash: the process dies at each boundary between the protocol's stages;
// whatever died, every operation ends with its effect committed once and
// its key completed with its result. Doors with a CrashKit crash their own
// process at each point (consumertest.CrashPoints); for the others the
// suite makes the deaths it can: a reservation left by a dead owner (after
// the reservation), a handler that dies after its effects (before the
// commit), an answer lost after the commit.
func crash(t *testing.T, s *suite, prefix string) {
	check := func(keys ...string) func(ctx context.Context, store *dedup.Store) error {
		return func(ctx context.Context, store *dedup.Store) error {
			for _, key := range keys {
				calls, err := effects(ctx, store, "", key)
				if err != nil {
					return err
				}
				if len(calls) != 1 {
					return fmt.Errorf("%s: %d effects committed, want 1", key, len(calls))
				}
			}
			return nil
		}
	}
	if kit, ok := s.door.(CrashKit); ok {
		ops := []Op{op(prefix+"-a", `{"amount":1}`), op(prefix+"-b", `{"amount":2}`)}
		// Each point is a fresh store: its calls are counted by the effect
		// rows alone, the default behaviour stores the first call's body.
		handle := func(ctx context.Context, tx pgx.Tx, c Call) Act { return act(ctx, tx, c, 1, nil) }
		rows := kit.CrashPoints(t, handle, check(prefix+"-a", prefix+"-b"), ops)
		for _, r := range rows {
			t.Run(r.Point, func(t *testing.T) {
				if !r.Reached {
					t.Errorf("no delivery reached the point")
				}
				if r.Err != nil {
					t.Error(r.Err)
				}
			})
		}
		return
	}
	t.Run("after the reservation", func(t *testing.T) { expiredLease(t, s, prefix+"-reserved") })
	t.Run("after the handler, before COMMIT", func(t *testing.T) {
		key := prefix + "-before-commit"
		s.on("", key, func(ctx context.Context, tx pgx.Tx, c Call, n int) Act {
			if n == 1 {
				return Act{Kind: Die}
			}
			return Act{Kind: Succeed, Code: 201, Body: doneBody(c.Key, n)}
		})
		a := s.door.Send(t, op(key, `{"amount":1}`)).Wait(t)
		s.wantResult(t, "after the death", a, Processed)
		s.wantCalls(t, "", key, 2)
		s.wantEffects(t, "", key, 2)
		s.wantCompleted(t, "", key, dedup.OutcomeOK, a)
	})
	t.Run("after COMMIT, before the answer", func(t *testing.T) {
		key := prefix + "-after-commit"
		o := op(key, `{"amount":1}`)
		o.LoseAnswer = true
		a := s.door.Send(t, o).Wait(t)
		s.wantResult(t, "the retry of a lost answer", a, Duplicate)
		if !slices.Contains(a.History, Retried) {
			t.Errorf("answers on the way %v: the first answer was not lost", a.History)
		}
		if a.Code != 201 || !bytes.Equal(a.Body, doneBody(key, 1)) {
			t.Errorf("replayed %d %q, want the committed 201 %q", a.Code, a.Body, doneBody(key, 1))
		}
		s.wantCalls(t, "", key, 1)
		s.wantEffects(t, "", key, 1)
		s.wantCompleted(t, "", key, dedup.OutcomeOK, a)
	})
}

// tenantIsolation: one key in two tenants is two operations (another body
// is no key reuse); each tenant's duplicate gets its own result, and a
// third tenant has no row.
func tenantIsolation(t *testing.T, s *suite, prefix string) {
	key := prefix + "-1"
	acme, globex := Op{Key: key, Tenant: "acme", Body: []byte(`{"amount":1}`)}, Op{Key: key, Tenant: "globex", Body: []byte(`{"amount":2}`)}
	a := s.door.Send(t, acme).Wait(t)
	g := s.door.Send(t, globex).Wait(t)
	s.wantResult(t, "tenant acme", a, Processed)
	s.wantResult(t, "tenant globex", g, Processed)
	wantReplay(t, a, s.door.Send(t, acme).Wait(t))
	wantReplay(t, g, s.door.Send(t, globex).Wait(t))
	for _, tenant := range []string{"acme", "globex"} {
		s.wantCalls(t, tenant, key, 1)
		s.wantEffects(t, tenant, key, 1)
	}
	s.wantCompleted(t, "acme", key, dedup.OutcomeOK, a)
	s.wantCompleted(t, "globex", key, dedup.OutcomeOK, g)
	s.wantNoRecord(t, "", key)
	s.wantNoRecord(t, "initech", key)
	s.wantEffects(t, "", key)
}

// limits: a key or a tenant at the limit (255 bytes) is an operation; one
// over it, a missing key and a key that is not UTF-8 are refused before
// anything is reserved.
func limits(t *testing.T, s *suite, prefix string) {
	long := func(n int) string { return prefix + strings.Repeat("k", n-len(prefix)) }
	for _, c := range []struct {
		name   string
		op     Op
		reason string // "" when it is processed
	}{
		{"key of 255 bytes", Op{Key: long(255)}, ""},
		{"key of 256 bytes", Op{Key: long(256)}, ReasonKeyInvalid},
		{"no key", Op{}, ReasonKeyRequired},
		{"key not UTF-8", Op{Key: prefix + "-\xff\xfe"}, ReasonKeyInvalid},
		{"tenant of 255 bytes", Op{Key: prefix + "-t255", Tenant: strings.Repeat("t", 255)}, ""},
		{"tenant of 256 bytes", Op{Key: prefix + "-t256", Tenant: strings.Repeat("t", 256)}, ReasonTenantInvalid},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.op.Body = []byte(`{"amount":1}`)
			a := s.door.Send(t, c.op).Wait(t)
			if c.reason == "" {
				s.wantResult(t, c.name, a, Processed)
				s.wantCalls(t, c.op.Tenant, c.op.Key, 1)
				s.wantEffects(t, c.op.Tenant, c.op.Key, 1)
				s.wantCompleted(t, c.op.Tenant, c.op.Key, dedup.OutcomeOK, a)
				return
			}
			s.wantResult(t, c.name, a, InvalidKey)
			if a.Reason != c.reason {
				t.Errorf("refused for %q, want %q", a.Reason, c.reason)
			}
			s.wantCalls(t, c.op.Tenant, c.op.Key, 0)
			if c.op.Key != "" {
				s.wantNoRecord(t, c.op.Tenant, c.op.Key)
			}
		})
	}
}

func countOf(rs []Result, r Result) int {
	n := 0
	for _, x := range rs {
		if x == r {
			n++
		}
	}
	return n
}
