package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
)

// A business rejection (402) is the operation's result: stored, replayed.
func TestBusinessRejectionIsStored(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	first := a.do("POST", "/orders", "order-1", `{"amount":99999}`)
	again := a.do("POST", "/orders", "order-1", `{"amount":99999}`)
	if first.status != 402 || again.status != 402 || !again.replayed() || again.body != first.body {
		t.Fatalf("402 twice: %d %s, %d %s (replayed %v)", first.status, first.body, again.status, again.body, again.replayed())
	}
	rec, err := a.keyRow("order-1")
	if err != nil || rec.Result.Outcome != dedup.OutcomeRejected || rec.Result.Reason != "Payment Required" {
		t.Fatalf("row %+v, %v: want a rejection", rec, err)
	}
}

// A request refused before the operation ran (400) stores nothing: the
// corrected request, another body with the same key, runs.
func TestValidationFailureIsNotStored(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	bad := a.do("POST", "/orders", "order-1", `{"amount":-1}`)
	if bad.status != 400 {
		t.Fatalf("bad amount: %d", bad.status)
	}
	if _, err := a.keyRow("order-1"); !errors.Is(err, dedup.ErrNotFound) {
		t.Fatalf("key after a 400: %v, want none", err)
	}
	if fixed := a.do("POST", "/orders", "order-1", `{"amount":4990}`); fixed.status != 201 || fixed.replayed() {
		t.Fatalf("corrected request: %d %s", fixed.status, fixed.body)
	}
}

// A 5xx, a panic and a timeout store nothing and roll the handler's writes
// back; the retry runs again and succeeds.
func TestFailuresReleaseTheKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		fail   func(w http.ResponseWriter, r *http.Request)
		status int
	}{
		{"5xx", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "gateway down", http.StatusBadGateway) }, http.StatusBadGateway},
		{"panic", func(http.ResponseWriter, *http.Request) { panic("boom") }, http.StatusInternalServerError},
		{"timeout", func(w http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
			w.WriteHeader(http.StatusCreated) // too late: discarded
		}, http.StatusServiceUnavailable},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a := newAPI(t, idemhttp.Config{Timeout: 200 * time.Millisecond}, nil)
			var calls atomic.Int64
			a.before = func(w http.ResponseWriter, r *http.Request) bool {
				if calls.Add(1) > 1 {
					return true
				}
				// A write that must roll back.
				if _, err := idemhttp.Tx(r).Exec(r.Context(), `INSERT INTO `+a.schema+`.orders (amount) VALUES (1)`); err != nil {
					t.Error(err)
				}
				c.fail(w, r)
				return false
			}
			failed := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
			if failed.status != c.status || failed.replayed() {
				t.Fatalf("failed attempt: %d %s, want %d", failed.status, failed.body, c.status)
			}
			if n := a.orders(); n != 0 {
				t.Fatalf("%d orders after the failure, want 0 (rolled back)", n)
			}
			retry := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
			if retry.status != 201 || retry.replayed() {
				t.Fatalf("retry: %d %s", retry.status, retry.body)
			}
			if n := a.orders(); n != 1 {
				t.Fatalf("%d orders, want 1", n)
			}
		})
	}
}

// Keep and Discard overrule the status.
func TestKeepAndDiscard(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	var calls atomic.Int64
	a.before = func(w http.ResponseWriter, r *http.Request) bool {
		n := calls.Add(1)
		switch r.URL.Query().Get("mode") {
		case "keep":
			idemhttp.Keep(r)
			w.WriteHeader(http.StatusConflict)
			fmt.Fprintf(w, "already shipped %d", n)
		case "discard":
			idemhttp.Discard(r)
			fmt.Fprintf(w, "failed softly %d", n)
		}
		return false
	}
	k1, k2 := a.do("POST", "/orders?mode=keep", "k", "{}"), a.do("POST", "/orders?mode=keep", "k", "{}")
	if k1.status != 409 || k2.body != k1.body || !k2.replayed() {
		t.Fatalf("keep: %d %s, then %d %s", k1.status, k1.body, k2.status, k2.body)
	}
	d1, d2 := a.do("POST", "/orders?mode=discard", "d", "{}"), a.do("POST", "/orders?mode=discard", "d", "{}")
	if d1.status != 200 || d2.body == d1.body || d2.replayed() {
		t.Fatalf("discard: %d %s, then %d %s", d1.status, d1.body, d2.status, d2.body)
	}
}

// A handler slower than its lease keeps the key: the heartbeat extends it,
// and a copy sent after the lease would have expired still gets 409.
func TestHeartbeatKeepsASlowRequest(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, &dedup.Config{Lease: time.Second})
	entered, proceed := make(chan struct{}), make(chan struct{})
	a.before = func(http.ResponseWriter, *http.Request) bool {
		close(entered)
		<-proceed
		return true
	}
	done := make(chan reply, 1)
	go func() {
		r, _ := send(a.srv.Client(), a.srv.URL, "POST", "/orders", "slow", `{"amount":1}`)
		done <- r
	}()
	<-entered
	start := time.Now()
	consumertest.WaitFor(t, 10*time.Second, "a second lease period", func() bool { return time.Since(start) > 2500*time.Millisecond })
	if r := a.do("POST", "/orders", "slow", `{"amount":1}`); r.status != http.StatusConflict {
		t.Fatalf("copy after 2.5 leases: %d, want 409 (the heartbeat keeps the lease)", r.status)
	}
	close(proceed)
	if r := <-done; r.status != 201 {
		t.Fatalf("slow request: %d %s", r.status, r.body)
	}
}

// A request whose lease was taken over (SeparateReservations) cannot commit: the heartbeat finds
// the lease lost and ends the handler's context; nothing it wrote commits,
// and the client gets 409.
func TestLostLeaseCannotCommit(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{SeparateReservations: true}, &dedup.Config{Lease: time.Second})
	entered := make(chan struct{})
	a.before = func(w http.ResponseWriter, r *http.Request) bool {
		if _, err := idemhttp.Tx(r).Exec(r.Context(), `INSERT INTO `+a.schema+`.orders (amount) VALUES (1)`); err != nil {
			t.Error(err)
		}
		close(entered)
		<-r.Context().Done()
		return true
	}
	done := make(chan reply, 1)
	go func() {
		r, _ := send(a.srv.Client(), a.srv.URL, "POST", "/orders", "taken", `{"amount":1}`)
		done <- r
	}()
	<-entered
	// Another server took the key over (a new lease token).
	if _, err := a.pool.Exec(context.Background(), `UPDATE `+a.schema+`.keys SET lease_token = gen_random_uuid() WHERE key = 'taken'`); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.status != http.StatusConflict || problemOf(t, r).Code != idemhttp.CodeLeaseLost {
		t.Fatalf("request that lost its lease: %d %s, want 409 %s", r.status, r.body, idemhttp.CodeLeaseLost)
	}
	if n := a.orders(); n != 0 {
		t.Fatalf("%d orders, want 0", n)
	}
}

// A body over MaxBody is 413 and runs nothing.
func TestBodyTooLarge(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{MaxBody: 16}, nil)
	if r := a.do("POST", "/orders", "big", `{"amount":4990,"note":"a long note"}`); r.status != http.StatusRequestEntityTooLarge || problemOf(t, r).Code != idemhttp.CodeBodyTooLarge {
		t.Fatalf("large body: %d %s", r.status, r.body)
	}
	if _, err := a.keyRow("big"); !errors.Is(err, dedup.ErrNotFound) {
		t.Fatalf("key of a refused body: %v", err)
	}
}

// The endless spinner: the client gives up while the operation runs; the
// operation still completes, its retry gets 409 until then and the stored
// answer after, and the data changes once.
func TestClientThatGaveUpGetsTheResultOnRetry(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	proceed := make(chan struct{})
	a.before = func(http.ResponseWriter, *http.Request) bool {
		<-proceed
		return true
	}
	impatient := &http.Client{Timeout: 200 * time.Millisecond}
	if _, err := send(impatient, a.srv.URL, "POST", "/orders", "spinner", `{"amount":4990}`); err == nil {
		t.Fatal("the impatient client got an answer")
	}
	if r := a.do("POST", "/orders", "spinner", `{"amount":4990}`); r.status != http.StatusConflict {
		t.Fatalf("retry while the first runs: %d", r.status)
	}
	close(proceed)
	consumertest.WaitFor(t, 10*time.Second, "the abandoned request to complete", func() bool {
		rec, err := a.keyRow("spinner")
		return err == nil && rec.State == dedup.StateCompleted
	})
	if r := a.do("POST", "/orders", "spinner", `{"amount":4990}`); r.status != 201 || !r.replayed() {
		t.Fatalf("retry after: %d (replayed %v)", r.status, r.replayed())
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// The handler cannot end the request's transaction: its writes commit only
// with the key's completion. A savepoint works.
func TestHandlerCannotCommitTheTransaction(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	a.before = func(w http.ResponseWriter, r *http.Request) bool {
		tx := idemhttp.Tx(r)
		sp, err := tx.Begin(r.Context())
		if err != nil {
			t.Error(err)
		} else if err := sp.Commit(r.Context()); err != nil {
			t.Errorf("savepoint: %v", err)
		}
		if err := tx.Commit(r.Context()); !errors.Is(err, idemhttp.ErrTxOwned) {
			t.Errorf("commit: %v, want ErrTxOwned", err)
		}
		if err := tx.Rollback(r.Context()); !errors.Is(err, idemhttp.ErrTxOwned) {
			t.Errorf("rollback: %v, want ErrTxOwned", err)
		}
		return true
	}
	if r := a.do("POST", "/orders", "k", `{"amount":1}`); r.status != 201 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders", n)
	}
}

// A handler that aborts (panic(http.ErrAbortHandler)) drops the connection,
// as net/http does, and leaves its key free for the retry.
func TestAbortReleasesTheKey(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	var calls atomic.Int64
	a.before = func(http.ResponseWriter, *http.Request) bool {
		if calls.Add(1) == 1 {
			panic(http.ErrAbortHandler)
		}
		return true
	}
	if _, err := send(a.srv.Client(), a.srv.URL, "POST", "/orders", "k", `{"amount":1}`); err == nil {
		t.Fatal("an aborted request got an answer")
	}
	if r := a.do("POST", "/orders", "k", `{"amount":1}`); r.status != 201 || r.replayed() {
		t.Fatalf("retry after abort: %d %s", r.status, r.body)
	}
}
