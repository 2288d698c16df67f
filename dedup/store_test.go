package dedup_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/testdb"
)

func TestReserveConcurrentCopiesOneAcquires(t *testing.T) {
	t.Parallel()
	const copies, rounds = 20, 100
	store, pool := newStore(t, copies+1, nil)
	ctx := context.Background()

	// Hold 20 connections open so that each goroutine reserves on its own.
	conns := make([]*pgxpool.Conn, 0, copies)
	for range copies {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}

	for round := range rounds {
		key := fmt.Sprintf("order-%d-%s", round, testdb.RandomHex(4))
		var (
			start  = make(chan struct{})
			wg     sync.WaitGroup
			mu     sync.Mutex
			counts = map[dedup.Decision]int{}
			errs   []error
		)
		for range copies {
			wg.Go(func() {
				<-start
				r, err := store.Reserve(ctx, claim(key, `{"amount":100}`))
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
					return
				}
				counts[r.Decision]++
			})
		}
		close(start)
		wg.Wait()
		if len(errs) > 0 {
			t.Fatalf("round %d: %d reserve errors, first: %v", round, len(errs), errs[0])
		}
		if counts[dedup.Acquired] != 1 || counts[dedup.Busy] != copies-1 {
			t.Fatalf("round %d: decisions %v, want 1 acquired and %d busy", round, counts, copies-1)
		}
	}
}

func TestCompletedKeyIsDuplicateWithStoredResult(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	c := claim("pay-1", `{"amount":100}`)
	c.TraceID, c.SpanID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	r := mustReserve(t, store, c, dedup.Acquired)
	if r.Lease.Attempts != 1 || r.Lease.TakenOver {
		t.Fatalf("fresh lease: attempts %d, taken over %v", r.Lease.Attempts, r.Lease.TakenOver)
	}
	want := dedup.Result{Outcome: dedup.OutcomeOK, Code: 201, Response: []byte(`{"charge":"ch_1"}`)}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return store.Complete(ctx, tx, r.Lease, want) }); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		d := mustReserve(t, store, claim("pay-1", `{"amount":100}`), dedup.Duplicate)
		if !errors.Is(d.Err(), dedup.ErrDuplicate) {
			t.Fatalf("Err() = %v", d.Err())
		}
		got := d.Record.Result
		if got == nil || got.Outcome != want.Outcome || got.Code != want.Code || !bytes.Equal(got.Response, want.Response) {
			t.Fatalf("stored result = %+v, want %+v", got, want)
		}
		if d.Record.TraceID != c.TraceID || d.Record.SpanID != c.SpanID {
			t.Fatalf("first processing = %s/%s, want %s/%s", d.Record.TraceID, d.Record.SpanID, c.TraceID, c.SpanID)
		}
	}
}

func TestRejectedResultIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	r := mustReserve(t, store, claim("pay-2", "x"), dedup.Acquired)
	rej := dedup.Result{Outcome: dedup.OutcomeRejected, Code: 402, Response: []byte("insufficient funds")}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return store.Complete(ctx, tx, r.Lease, rej) }); err != nil {
		t.Fatal(err)
	}
	d := mustReserve(t, store, claim("pay-2", "x"), dedup.Duplicate)
	if d.Record.Result.Outcome != dedup.OutcomeRejected || string(d.Record.Result.Response) != "insufficient funds" {
		t.Fatalf("replayed %+v", d.Record.Result)
	}
}

func TestKeyReuseAndFieldFingerprints(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	fields := dedup.JSONFieldsFingerprint("amount", "payer.account")
	fp := func(body string) dedup.Fingerprint {
		f, err := fields([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	c := dedup.Claim{Scope: dedup.Scope{Consumer: "payments", Key: "pay-3"}, Fingerprint: fp(`{"amount":100,"payer":{"account":"A1"},"comment":"first"}`)}
	r := mustReserve(t, store, c, dedup.Acquired)
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, r.Lease, dedup.Result{Outcome: dedup.OutcomeOK})
	}); err != nil {
		t.Fatal(err)
	}
	// A changed comment and reordered fields: the same operation.
	c.Fingerprint = fp(`{ "comment":"retry", "payer":{"account":"A1"}, "amount":100 }`)
	mustReserve(t, store, c, dedup.Duplicate)
	// A changed amount under the same key: key reuse.
	c.Fingerprint = fp(`{"amount":200,"payer":{"account":"A1"}}`)
	reuse := mustReserve(t, store, c, dedup.KeyReuse)
	if !errors.Is(reuse.Err(), dedup.ErrKeyReuse) {
		t.Fatalf("Err() = %v", reuse.Err())
	}
	// Whole-body fingerprints see the comment.
	mustReserve(t, store, claim("pay-4", `{"amount":1,"comment":"a"}`), dedup.Acquired)
	mustReserve(t, store, claim("pay-4", `{"amount":1,"comment":"b"}`), dedup.KeyReuse)
}

func TestExpiredLeaseTakenOverAndOldOwnerCannotCommit(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+store.Config().Schema+".ledger (key text PRIMARY KEY, owner text)"); err != nil {
		t.Fatal(err)
	}
	short := claim("pay-5", "body")
	short.Lease = 200 * time.Millisecond
	a := mustReserve(t, store, short, dedup.Acquired).Lease
	mustReserve(t, store, claim("pay-5", "body"), dedup.Busy)

	waitFor(t, 5*time.Second, "lease to expire", func() bool {
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "pay-5"})
		return err == nil && !rec.LeaseValid
	})
	// Expired, not yet taken over: A does not start a step either, since
	// another worker may take the key over while the step runs.
	early := false
	if err := store.Step(ctx, a, "authorize", func(context.Context, pgx.Tx) error { early = true; return nil }); !errors.Is(err, dedup.ErrLeaseLost) || early {
		t.Fatalf("step of an expired lease: %v, its function ran: %v; want ErrLeaseLost before it runs", err, early)
	}
	b := mustReserve(t, store, claim("pay-5", "body"), dedup.Acquired).Lease
	if !b.TakenOver || b.Attempts != 2 || b.Token == a.Token {
		t.Fatalf("takeover: taken over %v, attempts %d, token changed %v", b.TakenOver, b.Attempts, b.Token != a.Token)
	}

	// A, the slow owner, writes its effect and tries to complete.
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+store.Config().Schema+".ledger VALUES ('pay-5', 'A')"); err != nil {
			return err
		}
		return store.Complete(ctx, tx, a, dedup.Result{Outcome: dedup.OutcomeOK})
	})
	if !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("old owner complete: %v, want ErrLeaseLost", err)
	}
	if err := store.Extend(ctx, a, 0); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("old owner extend: %v, want ErrLeaseLost", err)
	}
	if err := store.Release(ctx, a, "retried"); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("old owner release: %v, want ErrLeaseLost", err)
	}
	// Nor does it start a step: a step's work may reach another system
	// (a card network) that the transaction's rollback cannot undo.
	ran := false
	if err := store.Step(ctx, a, "charge", func(context.Context, pgx.Tx) error { ran = true; return nil }); !errors.Is(err, dedup.ErrLeaseLost) || ran {
		t.Fatalf("old owner step: %v, its function ran: %v; want ErrLeaseLost before it runs", err, ran)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+store.Config().Schema+".ledger").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("old owner's effect committed: %d ledger rows", n)
	}
	// B completes normally.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+store.Config().Schema+".ledger VALUES ('pay-5', 'B')"); err != nil {
			return err
		}
		return store.Complete(ctx, tx, b, dedup.Result{Outcome: dedup.OutcomeOK})
	}); err != nil {
		t.Fatal(err)
	}
}

func TestExtendKeepsLeaseValid(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	ctx := context.Background()
	c := claim("pay-6", "b")
	c.Lease = time.Second
	l := mustReserve(t, store, c, dedup.Acquired).Lease
	before := l.LockedUntil
	if err := store.Extend(ctx, l, time.Hour); err != nil {
		t.Fatal(err)
	}
	if !l.LockedUntil.After(before.Add(50 * time.Minute)) {
		t.Fatalf("locked until %s, want about an hour after %s", l.LockedUntil, before)
	}
	rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "pay-6"})
	if err != nil || !rec.LeaseValid {
		t.Fatalf("inspect after extend: %+v, %v", rec, err)
	}
}

func TestReleaseLetsNextReserveTakeOver(t *testing.T) {
	t.Parallel()
	store, _ := newStore(t, 4, nil)
	ctx := context.Background()
	l := mustReserve(t, store, claim("pay-7", "b"), dedup.Acquired).Lease
	if err := store.Release(ctx, l, "retried"); err != nil {
		t.Fatal(err)
	}
	rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "pay-7"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != dedup.StateInProgress || rec.LeaseValid || rec.Attempts != 1 {
		t.Fatalf("released row: %+v", rec)
	}
	next := mustReserve(t, store, claim("pay-7", "b"), dedup.Acquired).Lease
	if next.Attempts != 2 || !next.TakenOver {
		t.Fatalf("after release: attempts %d, taken over %v; want 2, true", next.Attempts, next.TakenOver)
	}
	rec2, _ := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "pay-7"})
	if !rec2.CreatedAt.Equal(rec.CreatedAt) {
		t.Fatalf("created_at changed on takeover: %s → %s", rec.CreatedAt, rec2.CreatedAt)
	}
}

func TestStepsResumeAfterCrash(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	ledger := store.Config().Schema + ".effects"
	if _, err := pool.Exec(ctx, "CREATE TABLE "+ledger+" (step text, derived_key text)"); err != nil {
		t.Fatal(err)
	}
	steps := []string{"authorize", "capture", "notify"}
	run := func(l *dedup.Lease, crashAfter string) error {
		for _, name := range steps {
			err := store.Step(ctx, l, name, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" VALUES ($1, $2)", name, l.DerivedKey(name))
				return err
			})
			if err != nil {
				return err
			}
			if name == crashAfter {
				return errors.New("crash")
			}
		}
		return nil
	}
	c := claim("pay-8", "b")
	c.Lease = 200 * time.Millisecond
	first := mustReserve(t, store, c, dedup.Acquired).Lease
	if err := run(first, "authorize"); err == nil {
		t.Fatal("want the simulated crash")
	}
	// The worker is gone; its lease expires and another takes over.
	waitFor(t, 5*time.Second, "lease to expire", func() bool {
		rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: "pay-8"})
		return err == nil && !rec.LeaseValid
	})
	second := mustReserve(t, store, claim("pay-8", "b"), dedup.Acquired).Lease
	if second.RecoveryPoint != "authorize" || !second.StepDone("authorize") || second.StepDone("capture") {
		t.Fatalf("takeover recovery point %q, steps %v", second.RecoveryPoint, second.Steps)
	}
	// The old owner cannot commit a step any more.
	if err := store.Step(ctx, first, "capture", func(context.Context, pgx.Tx) error { return nil }); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("old owner step: %v, want ErrLeaseLost", err)
	}
	if err := run(second, ""); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, "SELECT step, count(*), min(derived_key) FROM "+ledger+" GROUP BY step ORDER BY step")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for rows.Next() {
		var step, dk string
		var n int
		if err := rows.Scan(&step, &n, &dk); err != nil {
			t.Fatal(err)
		}
		if dk != second.DerivedKey(step) || dk != first.DerivedKey(step) {
			t.Fatalf("derived key of %s not deterministic", step)
		}
		got[step] = n
	}
	if got["authorize"] != 1 || got["capture"] != 1 || got["notify"] != 1 {
		t.Fatalf("effects per step: %v, want each once", got)
	}
}

func TestTenantsAreIndependent(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	a, b := claim("shared-key", "body"), claim("shared-key", "body")
	a.Tenant, b.Tenant = "tenant-a", "tenant-b"
	la := mustReserve(t, store, a, dedup.Acquired).Lease
	lb := mustReserve(t, store, b, dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, la, dedup.Result{Outcome: dedup.OutcomeOK, Response: []byte("secret of a")})
	}); err != nil {
		t.Fatal(err)
	}
	// Tenant b's key is still its own lease; it never sees a's response.
	busy := mustReserve(t, store, b, dedup.Busy)
	if busy.Record.Result != nil || busy.Record.Tenant != "tenant-b" {
		t.Fatalf("tenant b read %+v", busy.Record)
	}
	// b's lease token cannot complete a's key (and a's cannot complete b's).
	forged := *la
	forged.Tenant = "tenant-b"
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return store.Complete(ctx, tx, &forged, dedup.Result{Outcome: dedup.OutcomeOK}) })
	if !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("cross-tenant complete: %v, want ErrLeaseLost", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, lb, dedup.Result{Outcome: dedup.OutcomeOK, Response: []byte("secret of b")})
	}); err != nil {
		t.Fatal(err)
	}
	da := mustReserve(t, store, a, dedup.Duplicate)
	db := mustReserve(t, store, b, dedup.Duplicate)
	if string(da.Record.Result.Response) != "secret of a" || string(db.Record.Result.Response) != "secret of b" {
		t.Fatalf("responses crossed tenants: %q %q", da.Record.Result.Response, db.Record.Result.Response)
	}
}

func TestHashedKeysKeepRawKeysOutOfTheTable(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, &dedup.Config{HashKeys: true})
	ctx := context.Background()
	raw := "alice@example.com/order-9"
	l := mustReserve(t, store, claim(raw, "b"), dedup.Acquired).Lease
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, l, dedup.Result{Outcome: dedup.OutcomeOK})
	}); err != nil {
		t.Fatal(err)
	}
	mustReserve(t, store, claim(raw, "b"), dedup.Duplicate)
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+store.Config().Schema+".keys WHERE key LIKE '%alice%'").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatal("raw key stored despite HashKeys")
	}
	rec, err := store.Inspect(ctx, dedup.Scope{Consumer: "payments", Key: raw})
	if err != nil || rec.State != dedup.StateCompleted {
		t.Fatalf("inspect by raw key: %+v, %v", rec, err)
	}
	// The scope keeps the raw key: a derived key is the same whether the
	// store hashes keys or not.
	if l.Key != raw || rec.Key != raw || l.DerivedKey("s") != (dedup.Scope{Consumer: "payments", Key: raw}).DerivedKey("s") {
		t.Fatalf("scope of the lease %+v, of the record %+v: want the raw key", l.Scope, rec.Scope)
	}
}

func TestGCDeletesOnlyOldRowsInBatches(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, &dedup.Config{GCBatchSize: 3})
	ctx := context.Background()
	table := store.Config().Schema + ".keys"
	complete := func(key string) {
		l := mustReserve(t, store, claim(key, "b"), dedup.Acquired).Lease
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return store.Complete(ctx, tx, l, dedup.Result{Outcome: dedup.OutcomeOK})
		}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 10 {
		complete(fmt.Sprintf("old-%d", i))
	}
	for i := range 4 {
		complete(fmt.Sprintf("new-%d", i))
	}
	for i := range 5 {
		mustReserve(t, store, claim(fmt.Sprintf("abandoned-%d", i), "b"), dedup.Acquired)
	}
	mustReserve(t, store, claim("running", "b"), dedup.Acquired)
	// Age the rows: 10 completed 25h ago, 5 leases expired 25h ago.
	if _, err := pool.Exec(ctx, "UPDATE "+table+" SET completed_at = now() - interval '25 hours', created_at = now() - interval '26 hours' WHERE key LIKE 'old-%'"); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "UPDATE "+table+" SET locked_until = now() - interval '25 hours', created_at = now() - interval '26 hours' WHERE key LIKE 'abandoned-%'"); err != nil {
		t.Fatal(err)
	}
	// Created long ago but completed just now (a key retried for a day): kept.
	if _, err := pool.Exec(ctx, "UPDATE "+table+" SET created_at = now() - interval '30 hours' WHERE key = 'new-0'"); err != nil {
		t.Fatal(err)
	}
	res, err := store.GC(ctx, dedup.GCOptions{Retention: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if res.Completed != 10 || res.Abandoned != 5 || res.Skipped {
		t.Fatalf("gc = %+v, want 10 completed and 5 abandoned", res)
	}
	var left []string
	rows, _ := pool.Query(ctx, "SELECT key FROM "+table+" ORDER BY key")
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"new-0", "new-1", "new-2", "new-3", "running"}
	if fmt.Sprint(left) != fmt.Sprint(want) {
		t.Fatalf("left after gc: %v, want %v", left, want)
	}
	again, err := store.GC(ctx, dedup.GCOptions{Retention: 24 * time.Hour})
	if err != nil || again.Completed != 0 || again.Abandoned != 0 {
		t.Fatalf("second gc = %+v, %v", again, err)
	}
}

func TestDurableReservations(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, &dedup.Config{DurableReservations: true})
	ctx := context.Background()
	l := mustReserve(t, store, claim("durable-1", "b"), dedup.Acquired).Lease
	if err := store.Extend(ctx, l, 0); err != nil {
		t.Fatal(err)
	}
	if err := store.Release(ctx, l, "retried"); err != nil {
		t.Fatal(err)
	}
	res, err := keystore.Of(store).ReserveBatch(ctx, []dedup.Claim{claim("durable-1", "b"), claim("durable-2", "b")})
	if err != nil || res[0].Decision != dedup.Acquired || res[0].Lease.Attempts != 2 || res[1].Decision != dedup.Acquired {
		t.Fatalf("batch after release: %+v %v", res, err)
	}
	if lost, err := keystore.Of(store).ExtendBatch(ctx, []*dedup.Lease{res[0].Lease, res[1].Lease}, 0); err != nil || len(lost) != 0 {
		t.Fatalf("extend batch: %v %v", lost, err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return store.Complete(ctx, tx, res[1].Lease, dedup.Result{Outcome: dedup.OutcomeOK})
	}); err != nil {
		t.Fatal(err)
	}
	mustReserve(t, store, claim("durable-2", "b"), dedup.Duplicate)
}
