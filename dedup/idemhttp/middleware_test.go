package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/consumertest"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
)

// The seeds' first check: the same request twice changes the data once and
// returns the same response, the second time marked as replayed.
func TestSameRequestTwiceChangesDataOnce(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	first := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	second := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %s (replayed %v), want 201 not replayed", first.status, first.body, first.replayed())
	}
	if second.status != first.status || second.body != first.body || !second.replayed() {
		t.Fatalf("second: %d %s (replayed %v), want the first's %d %s replayed", second.status, second.body, second.replayed(), first.status, first.body)
	}
	for _, h := range []string{"Location", "Content-Type"} {
		if second.header.Get(h) != first.header.Get(h) {
			t.Errorf("replayed %s = %q, want %q", h, second.header.Get(h), first.header.Get(h))
		}
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// Same key, changed body: 422, never the old response.
func TestChangedBodyIsKeyReuse(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{DocURL: "https://api.example.com/docs/idempotency"}, nil)
	a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	for _, changed := range []struct{ method, path, body string }{
		{"POST", "/orders", `{"amount":9800}`},
		{"POST", "/orders?express=1", `{"amount":4990}`},
	} {
		r := a.do(changed.method, changed.path, "order-1", changed.body)
		if r.status != http.StatusUnprocessableEntity {
			t.Fatalf("%s %s %s: %d %s, want 422", changed.method, changed.path, changed.body, r.status, r.body)
		}
		if p := problemOf(t, r); p.Code != idemhttp.CodeKeyReuse || p.Type != "https://api.example.com/docs/idempotency#"+idemhttp.CodeKeyReuse {
			t.Fatalf("problem %+v", p)
		}
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// With a fingerprint of named fields, a changed comment is a legal retry.
func TestFieldsFingerprintIgnoresOtherFields(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{Fingerprint: idemhttp.FieldsFingerprint("amount")}, nil)
	first := a.do("POST", "/orders", "order-1", `{"amount":4990,"note":"first"}`)
	retry := a.do("POST", "/orders", "order-1", `{"note":"retry", "amount":4990}`)
	other := a.do("POST", "/orders", "order-1", `{"amount":9800,"note":"first"}`)
	if first.status != 201 || retry.status != 201 || !retry.replayed() || other.status != 422 {
		t.Fatalf("statuses %d, %d (replayed %v), %d: want 201, 201 replayed, 422", first.status, retry.status, retry.replayed(), other.status)
	}
	if notJSON := a.do("POST", "/orders", "order-2", `amount=1`); notJSON.status != 400 {
		t.Fatalf("a body that is not JSON: %d, want 400", notJSON.status)
	}
}

// Two identical requests in parallel run once: the second, sent while the
// first runs, gets 409 with Retry-After; its retry replays the first's answer.
func TestTwoParallelRequestsRunOnce(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{RetryAfter: 1500 * time.Millisecond}, nil)
	entered, proceed := make(chan struct{}), make(chan struct{})
	a.before = func(http.ResponseWriter, *http.Request) bool {
		close(entered)
		<-proceed
		return true
	}
	first := make(chan reply, 1)
	go func() {
		r, _ := send(a.srv.Client(), a.srv.URL, "POST", "/orders", "order-1", `{"amount":4990}`)
		first <- r
	}()
	<-entered
	busy := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	if busy.status != http.StatusConflict || busy.header.Get("Retry-After") != "2" {
		t.Fatalf("while the first runs: %d, Retry-After %q, want 409 with Retry-After 2", busy.status, busy.header.Get("Retry-After"))
	}
	if p := problemOf(t, busy); p.Code != idemhttp.CodeKeyInProgress || p.Type != "about:blank" {
		t.Fatalf("problem %+v", p)
	}
	close(proceed)
	got := <-first
	retry := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	if got.status != 201 || retry.status != 201 || retry.body != got.body || !retry.replayed() {
		t.Fatalf("first %d %s, retry %d %s (replayed %v)", got.status, got.body, retry.status, retry.body, retry.replayed())
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// The seeds' concurrency check: 20 copies of one key at once give exactly
// one 2xx and 19 × 409, in 100 rounds out of 100. The first copy's handler
// holds on until the 19 others have their answer, so that none of them can
// arrive after it completed (that one would be a replay, also correct).
func TestTwentyConcurrentCopiesOneRuns(t *testing.T) {
	t.Parallel()
	const copies, rounds = 20, 100
	a := newAPI(t, idemhttp.Config{}, nil)
	var (
		conflicts atomic.Int64
		allBusy   chan struct{}
		runs      atomic.Int64
	)
	a.before = func(http.ResponseWriter, *http.Request) bool {
		runs.Add(1)
		select {
		case <-allBusy:
		case <-time.After(20 * time.Second):
		}
		return true
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: copies}}
	defer client.CloseIdleConnections()
	for round := range rounds {
		conflicts.Store(0)
		allBusy = make(chan struct{})
		key := fmt.Sprintf("order-%d", round)
		codes := make([]int, copies)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range copies {
			wg.Go(func() {
				<-start
				r, err := send(client, a.srv.URL, "POST", "/orders", key, `{"amount":4990}`)
				if err != nil {
					t.Error(err)
					return
				}
				codes[i] = r.status
				if r.status == http.StatusConflict && conflicts.Add(1) == copies-1 {
					close(allBusy)
				}
			})
		}
		close(start)
		wg.Wait()
		counts := map[int]int{}
		for _, c := range codes {
			counts[c]++
		}
		if counts[http.StatusCreated] != 1 || counts[http.StatusConflict] != copies-1 {
			t.Fatalf("round %d: statuses %v, want one 201 and %d × 409", round, counts, copies-1)
		}
	}
	if n, r := a.orders(), runs.Load(); n != rounds || r != rounds {
		t.Fatalf("%d orders from %d handler runs, want %d", n, r, rounds)
	}
}

// A DELETE, guarded where the API says so, repeated after its success
// replays the 204 instead of answering 404; the order is deleted once. An
// unguarded DELETE is the handler's own business.
func TestDeleteRepeatedAfterSuccess(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{Methods: []string{"POST", "PATCH", "DELETE"}}, nil)
	created := a.do("POST", "/orders", "create-1", `{"amount":4990}`)
	loc := created.header.Get("Location")
	first := a.do("DELETE", loc, "delete-1", "")
	again := a.do("DELETE", loc, "delete-1", "")
	if first.status != http.StatusNoContent || again.status != http.StatusNoContent || !again.replayed() {
		t.Fatalf("DELETE twice: %d then %d (replayed %v), want 204 then 204 replayed", first.status, again.status, again.replayed())
	}
	// Another key is another operation: the order is gone, 404, not stored.
	other := a.do("DELETE", loc, "delete-2", "")
	if other.status != http.StatusNotFound || other.replayed() {
		t.Fatalf("DELETE with another key: %d, want 404", other.status)
	}
	if _, err := a.keyRow("delete-2"); !errors.Is(err, dedup.ErrNotFound) {
		t.Fatalf("the 404's key: %v, want it forgotten", err)
	}
	if n := a.orders(); n != 0 {
		t.Fatalf("%d orders, want 0", n)
	}

	plain := newAPI(t, idemhttp.Config{}, nil)
	plain.do("POST", "/orders", "create-1", `{"amount":4990}`)
	if r := plain.do("DELETE", "/orders/1", "", ""); r.status != http.StatusNoContent {
		t.Fatalf("unguarded DELETE: %d", r.status)
	}
	if r := plain.do("DELETE", "/orders/1", "", ""); r.status != http.StatusNotFound {
		t.Fatalf("unguarded DELETE again: %d, want the handler's 404", r.status)
	}
	if r := plain.do("GET", "/orders", "", ""); r.status != 200 || r.body != "0" {
		t.Fatalf("GET (unguarded, no transaction): %d %s", r.status, r.body)
	}
}

// A retry after the key's retention is a new request: GC deleted the key,
// so the operation runs again. This is the documented limit of the window
// (dedup.Config.Retention, default 24h).
func TestRetryAfterRetentionIsNew(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	first := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	consumertest.WaitFor(t, 5*time.Second, "the completion to age", func() bool {
		res, err := a.store.GC(context.Background(), dedup.GCOptions{Retention: time.Microsecond})
		if err != nil {
			t.Fatal(err)
		}
		return res.Completed == 1
	})
	late := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	if late.status != 201 || late.replayed() || late.body == first.body {
		t.Fatalf("retry after retention: %d %s (replayed %v), want a new 201", late.status, late.body, late.replayed())
	}
	if n := a.orders(); n != 2 {
		t.Fatalf("%d orders, want 2", n)
	}
}

// One key in two tenants is two operations: no 422, no replay of the other
// tenant's answer. The tenant comes from the authenticated principal.
func TestKeyAcrossTenantsDoesNotCollide(t *testing.T) {
	t.Parallel()
	tokens := map[string]string{"Bearer t-alice": "alice", "Bearer t-bob": "bob"}
	a := newAPI(t, idemhttp.Config{Tenant: func(r *http.Request) (string, error) {
		tenant, ok := tokens[r.Header.Get("Authorization")]
		if !ok {
			return "", errors.New("unknown token")
		}
		return tenant, nil
	}}, nil)
	alice := a.do("POST", "/orders", "order-1", `{"amount":4990}`, "Authorization", "Bearer t-alice")
	bob := a.do("POST", "/orders", "order-1", `{"amount":100}`, "Authorization", "Bearer t-bob")
	if alice.status != 201 || bob.status != 201 || bob.replayed() || bob.body == alice.body {
		t.Fatalf("alice %d %s, bob %d %s (replayed %v): want two new orders", alice.status, alice.body, bob.status, bob.body, bob.replayed())
	}
	if again := a.do("POST", "/orders", "order-1", `{"amount":100}`, "Authorization", "Bearer t-bob"); again.body != bob.body || !again.replayed() {
		t.Fatalf("bob's retry: %d %s, want bob's answer replayed", again.status, again.body)
	}
	if anon := a.do("POST", "/orders", "order-1", `{"amount":100}`); anon.status != http.StatusUnauthorized {
		t.Fatalf("no principal: %d, want 401", anon.status)
	}
	if n := a.orders(); n != 2 {
		t.Fatalf("%d orders, want 2", n)
	}
}

// Missing and malformed keys get 400 with a problem body, and nothing runs.
func TestBadKeysAre400(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{DocURL: "https://api.example.com/docs/idempotency"}, nil)
	for _, c := range []struct {
		name    string
		key     string
		headers []string
		code    string
	}{
		{"missing", "", nil, idemhttp.CodeKeyRequired},
		{"257 bytes", strings.Repeat("k", 257), nil, idemhttp.CodeKeyInvalid},
		{"tab", "order\t1", nil, idemhttp.CodeKeyInvalid},
		{"C1 control character", "order\u00851", nil, idemhttp.CodeKeyInvalid},
		{"not UTF-8", "order-\xff", nil, idemhttp.CodeKeyInvalid},
		{"twice", "order-1", []string{idemhttp.DefaultHeader, "order-2"}, idemhttp.CodeKeyInvalid},
	} {
		r := a.do("POST", "/orders", c.key, `{"amount":4990}`, c.headers...)
		if r.status != http.StatusBadRequest {
			t.Fatalf("%s: %d %s, want 400", c.name, r.status, r.body)
		}
		p := problemOf(t, r)
		if p.Code != c.code || p.Type != "https://api.example.com/docs/idempotency#"+c.code || p.Title != "Bad Request" {
			t.Fatalf("%s: problem %+v", c.name, p)
		}
		if strings.Contains(r.body, c.key) && c.key != "" {
			t.Fatalf("%s: the problem repeats the key", c.name)
		}
	}
	// ASCII control characters other than tab never reach the middleware:
	// net/http's server refuses the request with 400 itself.
	for _, ctl := range []string{"\x01", "\x7f", "\x1b"} {
		req := "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: order" + ctl + "1\r\nContent-Length: 15\r\nConnection: close\r\n\r\n{\"amount\":4990}"
		if line := sendRaw(t, a.srv.URL, req); !strings.HasPrefix(line, "HTTP/1.1 400") {
			t.Fatalf("key with %q: %s, want 400", ctl, line)
		}
	}
	// 255 bytes is a key.
	if r := a.do("POST", "/orders", strings.Repeat("k", 255), `{"amount":4990}`); r.status != 201 {
		t.Fatalf("255-byte key: %d", r.status)
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// Optional lets a request without a key through unguarded (no
// transaction), and guards one that has a key.
func TestOptionalKey(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	mw, err := idemhttp.New(a.store, &idemhttp.Config{Consumer: "optional"})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	srv := newServer(t, mw.Optional(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		fmt.Fprintf(w, "tx=%v", idemhttp.Tx(r) != nil)
	})))
	for _, c := range []struct {
		key, want string
		status    int
	}{{"", "tx=false", 200}, {"", "tx=false", 200}, {"k-1", "tx=true", 200}, {"k-1", "tx=true", 200}, {"bad\t1", "", 400}} {
		r, err := send(srv.Client(), srv.URL, "POST", "/", c.key, "{}")
		if err != nil {
			t.Fatal(err)
		}
		if r.status != c.status || (c.want != "" && r.body != c.want) {
			t.Fatalf("key %q: %d %s, want %d %s", c.key, r.status, r.body, c.status, c.want)
		}
	}
	if n := runs.Load(); n != 3 {
		t.Fatalf("%d runs, want 3 (two without a key, one with)", n)
	}
}
