package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
)

// guarded serves h behind a middleware of its own (Consumer consumer) over
// a's store.
func (a *api) guarded(consumer string, cfg idemhttp.Config, h http.HandlerFunc) string {
	a.t.Helper()
	cfg.Consumer = consumer
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	mw, err := idemhttp.New(a.store, &cfg)
	if err != nil {
		a.t.Fatal(err)
	}
	return newServer(a.t, mw.Require(h)).URL
}

// keys counts the key rows of consumer, in every tenant.
func (a *api) keys(consumer string) int {
	a.t.Helper()
	var n int
	if err := a.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+a.schema+`.keys WHERE consumer = $1`, consumer).Scan(&n); err != nil {
		a.t.Fatal(err)
	}
	return n
}

// An informational answer (103 Early Hints) reaches the client as it is
// written and is never taken for the handler's status: the 201 that follows
// is what the client gets, what is stored and what a retry replays.
func TestInformationalAnswerPassesThroughAndIsNotStored(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	var runs atomic.Int64
	url := a.guarded("hints", idemhttp.Config{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Add("Link", "</style.css>; rel=preload; as=style")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"order_id":7}`)
	})
	post := func() (reply, []int, []string) {
		var codes []int
		var links []string
		trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			codes = append(codes, code)
			links = append(links, h.Get("Link"))
			return nil
		}}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), "POST", url+"/orders", strings.NewReader(`{"amount":1}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set(idemhttp.DefaultHeader, "order-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}, codes, links
	}
	first, codes, links := post()
	if first.status != http.StatusCreated || first.body != `{"order_id":7}` || first.replayed() {
		t.Fatalf("first: %d %q (replayed %v), want 201 with the handler's body", first.status, first.body, first.replayed())
	}
	if len(codes) != 1 || codes[0] != http.StatusEarlyHints || links[0] != "</style.css>; rel=preload; as=style" {
		t.Fatalf("informational answers %v with Link %q, want one 103 with the handler's Link", codes, links)
	}
	again, codes, _ := post()
	if again.status != http.StatusCreated || again.body != first.body || !again.replayed() {
		t.Fatalf("replay: %d %q (replayed %v), want the 201 replayed", again.status, again.body, again.replayed())
	}
	if len(codes) != 0 {
		t.Fatalf("the replay sent informational answers %v: they are not stored", codes)
	}
	rec, err := a.store.Inspect(context.Background(), dedup.Scope{Consumer: "hints", Key: "order-1"})
	if err != nil || rec.Result.Code != http.StatusCreated {
		t.Fatalf("row %+v, %v: want the stored status 201", rec, err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
}

// 101 Switching Protocols cannot go through a guard (the answer is held
// until COMMIT; the connection cannot be handed over): the key is released,
// nothing is stored, and the client gets a 500 problem.
func TestSwitchingProtocolsIsNotStored(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	url := a.guarded("upgrade", idemhttp.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if _, err := idemhttp.Tx(r).Exec(r.Context(), `INSERT INTO `+a.schema+`.orders (amount) VALUES (1)`); err != nil {
			t.Error(err)
		}
		w.Header().Set("Upgrade", "websocket")
		w.WriteHeader(http.StatusSwitchingProtocols)
	})
	r, err := send(http.DefaultClient, url, "POST", "/", "up-1", "{}")
	if err != nil {
		t.Fatal(err)
	}
	if r.status != http.StatusInternalServerError || problemOf(t, r).Code != idemhttp.CodeHandlerPanic {
		t.Fatalf("101 under a guard: %d %s, want a 500 problem", r.status, r.body)
	}
	if _, err := a.store.Inspect(context.Background(), dedup.Scope{Consumer: "upgrade", Key: "up-1"}); !errors.Is(err, dedup.ErrNotFound) {
		t.Fatalf("key after a 101: %v, want none", err)
	}
	if n := a.orders(); n != 0 {
		t.Fatalf("%d orders, want the handler's write rolled back", n)
	}
}

// The Idempotency-Key draft makes the header an RFC 8941 sf-string: "k" is
// the key k, the same operation as the bare k that older clients send.
func TestQuotedKeyIsTheBareKey(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	first := a.do("POST", "/orders", `"order-1"`, `{"amount":4990}`)
	bare := a.do("POST", "/orders", "order-1", `{"amount":4990}`)
	quoted := a.do("POST", "/orders", `"order-1"`, `{"amount":4990}`)
	withParam := a.do("POST", "/orders", `"order-1";v=1; x`, `{"amount":4990}`)
	if first.status != 201 || first.replayed() {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	for name, r := range map[string]reply{"bare": bare, "quoted": quoted, "with parameters": withParam} {
		if r.status != first.status || r.body != first.body || !r.replayed() {
			t.Fatalf("%s retry: %d %s (replayed %v), want the first's answer replayed", name, r.status, r.body, r.replayed())
		}
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
	if _, err := a.keyRow("order-1"); err != nil {
		t.Fatalf("the row of key order-1 (unquoted): %v", err)
	}
}

// A header that starts like an sf-string but is not one is refused with a
// problem, and nothing runs.
func TestMalformedQuotedKeyIs400(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	for _, c := range []struct{ name, key, code string }{
		{"unterminated", `"order-1`, idemhttp.CodeKeyInvalid},
		{"bad escape", `"order\n1"`, idemhttp.CodeKeyInvalid},
		{"lone backslash at the end", `"order-1\`, idemhttp.CodeKeyInvalid},
		{"non-ASCII inside quotes", `"заказ-1"`, idemhttp.CodeKeyInvalid},
		{"tab inside quotes", "\"order\t1\"", idemhttp.CodeKeyInvalid},
		{"text after the string", `"order-1"x`, idemhttp.CodeKeyInvalid},
		{"a list", `"order-1", "order-2"`, idemhttp.CodeKeyInvalid},
		{"space before a parameter", `"order-1" ;a`, idemhttp.CodeKeyInvalid},
		{"parameter key in capitals", `"order-1";A=1`, idemhttp.CodeKeyInvalid},
		{"parameter without a value", `"order-1";a=`, idemhttp.CodeKeyInvalid},
		{"parameter with a bad string", `"order-1";a="x`, idemhttp.CodeKeyInvalid},
		{"256 bytes quoted", `"` + strings.Repeat("k", 256) + `"`, idemhttp.CodeKeyInvalid},
		{"empty string", `""`, idemhttp.CodeKeyRequired},
	} {
		r := a.do("POST", "/orders", c.key, `{"amount":4990}`)
		if r.status != http.StatusBadRequest {
			t.Fatalf("%s: %d %s, want 400", c.name, r.status, r.body)
		}
		if p := problemOf(t, r); p.Code != c.code {
			t.Fatalf("%s: problem %+v, want code %s", c.name, p, c.code)
		}
	}
	if r := a.do("POST", "/orders", `"`+strings.Repeat("k", 255)+`"`, `{"amount":4990}`); r.status != 201 {
		t.Fatalf("255-byte quoted key: %d %s", r.status, r.body)
	}
	if n := a.orders(); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

// A tenant that the consumer would refuse (dedup.ValidateTenant: longer
// than 255 bytes, not UTF-8, control characters) is refused at the door
// with a problem, before anything is reserved.
func TestInvalidTenantIs400(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	for _, tenant := range []string{strings.Repeat("t", 300), "acme\x00", "acme-\xff"} {
		var runs atomic.Int64
		url := a.guarded("tenants", idemhttp.Config{Tenant: func(*http.Request) (string, error) { return tenant, nil }},
			func(w http.ResponseWriter, r *http.Request) { runs.Add(1); w.WriteHeader(http.StatusAccepted) })
		r, err := send(http.DefaultClient, url, "POST", "/", "order-1", "{}")
		if err != nil {
			t.Fatal(err)
		}
		if r.status != http.StatusBadRequest {
			t.Fatalf("tenant of %d bytes: %d %s, want 400", len(tenant), r.status, r.body)
		}
		if p := problemOf(t, r); p.Code != idemhttp.CodeTenantInvalid {
			t.Fatalf("tenant of %d bytes: problem %+v, want code tenant_invalid", len(tenant), p)
		}
		if strings.Contains(r.body, tenant) {
			t.Fatalf("the problem repeats the tenant")
		}
		if runs.Load() != 0 {
			t.Fatalf("the handler ran for an invalid tenant")
		}
	}
	if n := a.keys("tenants"); n != 0 {
		t.Fatalf("%d key rows, want none", n)
	}
	// 255 bytes is a tenant.
	url := a.guarded("tenants", idemhttp.Config{Tenant: func(*http.Request) (string, error) { return strings.Repeat("t", 255), nil }},
		func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusAccepted) })
	if r, err := send(http.DefaultClient, url, "POST", "/", "order-1", "{}"); err != nil || r.status != http.StatusAccepted {
		t.Fatalf("255-byte tenant: %+v, %v", r, err)
	}
}
