package conformance

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/dedup/idemhttp"
)

// The HTTP door's names.
const (
	httpConsumer = "conformance-http"
	httpPath     = "/ops"
	// tenantHeader carries the tenant to the door's Config.Tenant: the
	// suite's client is the authenticated principal.
	tenantHeader  = "X-Conformance-Tenant"
	attemptHeader = "X-Conformance-Attempt"
	opHeader      = "X-Conformance-Op"
	// httpTries bounds the client's tries after failures (5xx, a cut
	// connection), like the consumers' MaxAttempts.
	httpTries = 3
	// httpRetryPause is the client's pause before it tries again: a
	// client's backoff, not a wait for an event.
	httpRetryPause = 100 * time.Millisecond
)

// httpDoor is idemhttp's middleware around the suite's handler, on a real
// server, and a client that retries as the Idempotency-Key draft asks.
type httpDoor struct {
	store *dedup.Store
	srv   *httptest.Server

	// separate: the keys are reserved by a commit of their own.
	separate bool

	mu   sync.Mutex
	lose map[string]bool // op id → the first answer is to be lost
	next int
}

// NewHTTPDoor is the HTTP door: idemhttp.Middleware.Require around handle,
// on httptest.NewServer, over a store on a fresh schema of pool; separate
// sets idemhttp.Config.SeparateReservations. Its keys are leased for 1s,
// so that a dead server's key is taken over quickly.
func NewHTTPDoor(pool *pgxpool.Pool, separate bool) NewDoor {
	return func(t *testing.T, handle Handle) Door {
		store := deduptest.Store(t, pool, &dedup.Config{Lease: time.Second})
		createEffects(t, pool, store.Config().Schema)
		d := &httpDoor{store: store, lose: map[string]bool{}, separate: separate}
		mw, err := idemhttp.New(store, &idemhttp.Config{
			Consumer:             httpConsumer,
			Tenant:               func(r *http.Request) (string, error) { return r.Header.Get(tenantHeader), nil },
			SeparateReservations: separate,
			Lease:                time.Second,
			Logger:               slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		if err != nil {
			t.Fatal(err)
		}
		schema := store.Config().Schema
		mux := http.NewServeMux()
		mux.HandleFunc("POST "+httpPath, func(w http.ResponseWriter, r *http.Request) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			attempt, _ := strconv.Atoi(r.Header.Get(attemptHeader))
			act := handle(r.Context(), idemhttp.Tx(r), Call{
				Tenant: r.Header.Get(tenantHeader), Key: idemhttp.Key(r), Attempt: attempt, Body: body, Schema: schema,
			})
			switch act.Kind {
			case Succeed:
				w.WriteHeader(act.Code)
				_, _ = w.Write(act.Body)
			case Reject:
				// 402: a business rejection that DefaultStored keeps.
				w.WriteHeader(http.StatusPaymentRequired)
				_, _ = w.Write(act.Body)
			case Fail:
				http.Error(w, "infrastructure failure", http.StatusServiceUnavailable)
			case Die:
				panic(http.ErrAbortHandler)
			}
		})
		guarded := mw.Require(mux)
		d.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if d.takeLose(r.Header.Get(opHeader)) {
				// The process dies after the commit, before the answer
				// leaves: the first status written cuts the connection.
				w = &loseWriter{ResponseWriter: w}
			}
			guarded.ServeHTTP(w, r)
		}))
		t.Cleanup(d.srv.Close)
		return d
	}
}

// loseWriter cuts the connection when the middleware sends its answer.
type loseWriter struct{ http.ResponseWriter }

func (w *loseWriter) WriteHeader(int)           { panic(http.ErrAbortHandler) }
func (w *loseWriter) Write([]byte) (int, error) { panic(http.ErrAbortHandler) }

func (d *httpDoor) takeLose(op string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lose[op] {
		delete(d.lose, op)
		return true
	}
	return false
}

func (d *httpDoor) Features() Features {
	return Features{ReleaseForgets: true, HeldReservations: !d.separate, BusyAtOnce: !d.separate}
}

func (d *httpDoor) Store() *dedup.Store { return d.store }

func (d *httpDoor) Scope(tenant, key string) dedup.Scope {
	return dedup.Scope{Consumer: httpConsumer, Tenant: tenant, Key: key}
}

func (d *httpDoor) Fingerprint(op Op) dedup.Fingerprint {
	r := httptest.NewRequest(http.MethodPost, httpPath, nil)
	fp, _ := idemhttp.RequestFingerprint(r, op.Body)
	return fp
}

// Send posts op, and again with the same key after a 5xx (at most
// httpTries tries), a 409 or a cut connection.
func (d *httpDoor) Send(tb testing.TB, op Op) *Pending {
	p := newPending()
	d.mu.Lock()
	d.next++
	id := strconv.Itoa(d.next)
	if op.LoseAnswer {
		d.lose[id] = true
	}
	d.mu.Unlock()
	go func() {
		deadline := time.Now().Add(waitTimeout)
		for attempt := 1; ; {
			res, a, err := d.post(op, id, attempt)
			switch {
			case err != nil && time.Now().After(deadline):
				p.finish(Answer{Result: DeadLettered, Reason: err.Error()})
				return
			case err != nil:
			case res == Retried || res == InProgress || res == LeaseLost:
			default:
				p.finish(a)
				return
			}
			if err != nil || res == Retried {
				p.observe(Retried)
				if attempt++; attempt > httpTries {
					p.finish(Answer{Result: DeadLettered, Reason: "max_attempts_exceeded"})
					return
				}
			} else {
				p.observe(res)
			}
			if time.Now().After(deadline) {
				p.finish(Answer{Result: DeadLettered, Reason: "gave up"})
				return
			}
			time.Sleep(httpRetryPause) // the client's backoff
		}
	}()
	return p
}

// post sends op once; a cut connection is an error.
func (d *httpDoor) post(op Op, id string, attempt int) (Result, Answer, error) {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, d.srv.URL+httpPath, bytes.NewReader(op.Body))
	if err != nil {
		return "", Answer{}, err
	}
	// net/http's transport would send a request with an Idempotency-Key
	// again by itself when its connection is cut: without GetBody it
	// cannot, and this client's retries are the ones the suite sees.
	req.GetBody = nil
	if op.Key != "" {
		req.Header.Set(idemhttp.DefaultHeader, op.Key)
	}
	req.Header.Set(tenantHeader, op.Tenant)
	req.Header.Set(attemptHeader, strconv.Itoa(attempt))
	req.Header.Set(opHeader, id)
	resp, err := d.srv.Client().Do(req)
	if err != nil {
		return "", Answer{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", Answer{}, err
	}
	a := Answer{Code: resp.StatusCode, Body: body}
	replayed := resp.Header.Get(idemhttp.ReplayedHeader) == "true"
	var problem idemhttp.Problem
	if resp.Header.Get("Content-Type") == "application/problem+json" {
		_ = json.Unmarshal(body, &problem)
	}
	switch {
	case replayed:
		a.Result = Duplicate
	case resp.StatusCode < 300:
		a.Result = Processed
	case resp.StatusCode == http.StatusPaymentRequired:
		a.Result = Rejected
	case problem.Code == idemhttp.CodeKeyInProgress:
		a.Result = InProgress
	case problem.Code == idemhttp.CodeLeaseLost:
		a.Result = LeaseLost
	case problem.Code == idemhttp.CodeKeyReuse:
		a.Result = KeyReuse
	case problem.Code == idemhttp.CodeKeyRequired, problem.Code == idemhttp.CodeKeyInvalid, problem.Code == idemhttp.CodeTenantInvalid:
		a.Result, a.Reason = InvalidKey, problem.Code
	case resp.StatusCode >= 500:
		a.Result = Retried
	default:
		return "", Answer{}, errors.New("unexpected answer " + resp.Status + ": " + string(body))
	}
	return a.Result, a, nil
}
