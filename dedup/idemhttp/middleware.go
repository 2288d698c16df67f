package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/internal/duptrace"
	"github.com/idemq/idemq/internal/keystore"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// finishTimeout bounds the completion, the commit and the release of a
// request once its handler returned, whatever became of the client.
const finishTimeout = 10 * time.Second

// Middleware applies the key store to HTTP requests. It is safe for
// concurrent use; one Middleware serves any number of routes.
type Middleware struct {
	store         *dedup.Store
	cfg           Config
	omitted       map[string]struct{}
	storedHeaders map[string]struct{}
	tel           telemetry
}

// New returns a middleware over store's keys. A nil cfg is not enough:
// Config.Consumer is required.
func New(store *dedup.Store, cfg *Config) (*Middleware, error) {
	if store == nil {
		return nil, errors.New("idemhttp: nil store")
	}
	c, err := cfg.withDefaults(store)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: %w", err)
	}
	tel, err := newTelemetry(c)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: %w", err)
	}
	m := &Middleware{store: store, cfg: c, omitted: set(DefaultOmittedHeaders), tel: tel}
	if c.StoredHeaders != nil {
		m.storedHeaders = set(c.StoredHeaders)
		// The replay marker is the middleware's, never the handler's.
		delete(m.storedHeaders, ReplayedHeader)
	}
	return m, nil
}

func set(names []string) map[string]struct{} {
	out := make(map[string]struct{}, len(names))
	for _, n := range names {
		out[http.CanonicalHeaderKey(n)] = struct{}{}
	}
	return out
}

// Config returns the middleware's configuration with defaults filled in.
func (m *Middleware) Config() Config { return m.cfg }

// Require guards next: a request with a guarded method must carry a valid
// key, else it gets 400. It is the middleware, as func(http.Handler)
// http.Handler.
func (m *Middleware) Require(next http.Handler) http.Handler {
	return m.handler(next, false)
}

// Optional guards next where the key is optional: a request that carries a
// key is guarded as under Require (an invalid one gets 400), one without a
// key runs unguarded, with no transaction (Tx returns nil).
func (m *Middleware) Optional(next http.Handler) http.Handler {
	return m.handler(next, true)
}

func (m *Middleware) handler(next http.Handler, optional bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !slices.Contains(m.cfg.Methods, r.Method) {
			next.ServeHTTP(w, r)
			return
		}
		values := r.Header.Values(m.cfg.Header)
		if len(values) == 0 && optional {
			next.ServeHTTP(w, r)
			return
		}
		o, r, end := m.observe(w, r)
		defer end()
		w = o
		if len(values) > 1 {
			m.problem(w, http.StatusBadRequest, CodeKeyInvalid, "the "+m.cfg.Header+" header appears more than once", 0)
			return
		}
		key := ""
		if len(values) == 1 {
			k, err := parseKey(values[0])
			if err != nil {
				m.problem(w, http.StatusBadRequest, CodeKeyInvalid, "the "+m.cfg.Header+" header starts with a double quote but is not an RFC 8941 string: "+err.Error(), 0)
				return
			}
			key = k
		}
		if err := dedup.ValidateKey(key); err != nil {
			if errors.Is(err, dedup.ErrKeyRequired) {
				m.problem(w, http.StatusBadRequest, CodeKeyRequired, "this request needs an "+m.cfg.Header+" header: a unique key per operation, the same on every retry", 0)
				return
			}
			m.problem(w, http.StatusBadRequest, CodeKeyInvalid, "the "+m.cfg.Header+" header must be 1 to 255 bytes of UTF-8 without control characters", 0)
			return
		}
		m.serve(w, r, next, key)
	})
}

// serve runs a guarded request whose key is valid.
func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler, key string) {
	tenant, err := m.cfg.Tenant(r)
	if err != nil {
		m.problem(w, http.StatusUnauthorized, CodeUnauthenticated, "the request's principal is unknown", 0)
		return
	}
	// The consumer's rule, so that what the door accepts a worker accepts.
	if err := dedup.ValidateTenant(tenant); err != nil {
		m.problem(w, http.StatusBadRequest, CodeTenantInvalid, "the request's tenant must be at most 255 bytes of UTF-8 without control characters", 0)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxBody))
	if err != nil {
		if errors.As(err, new(*http.MaxBytesError)) {
			m.problem(w, http.StatusRequestEntityTooLarge, CodeBodyTooLarge, fmt.Sprintf("the body is longer than %d bytes", m.cfg.MaxBody), 0)
			return
		}
		m.problem(w, http.StatusBadRequest, CodeBodyUnreadable, "the body could not be read", 0)
		return
	}
	fp, err := m.cfg.Fingerprint(r, body)
	if err != nil {
		m.problem(w, http.StatusBadRequest, CodeBodyUnreadable, "the operation's significant content could not be read from the body", 0)
		return
	}
	scope := dedup.Scope{Consumer: m.cfg.Consumer, Tenant: tenant, Key: key}
	keyed(w, scope)
	c := dedup.Claim{Scope: scope, Fingerprint: fp, Lease: m.cfg.Lease}
	if sc := trace.SpanContextFromContext(r.Context()); sc.IsValid() {
		c.TraceID, c.SpanID = sc.TraceID().String(), sc.SpanID().String()
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	if !m.cfg.SeparateReservations {
		m.run(w, r, next, c, nil)
		return
	}
	res, err := m.store.Reserve(r.Context(), c)
	if err != nil {
		m.log(r.Context(), scope, "reserve key", err)
		m.problem(w, http.StatusServiceUnavailable, CodeUnavailable, "the key could not be reserved; retry with the same key", m.cfg.RetryAfter)
		return
	}
	if m.answered(w, r, res) {
		return
	}
	m.run(w, r, next, c, res.Lease)
}

// answered answers a reservation that did not acquire the key (a
// duplicate, a key in progress, a key reused) and reports whether it did.
func (m *Middleware) answered(w http.ResponseWriter, r *http.Request, res dedup.Reservation) bool {
	switch res.Decision {
	case dedup.Duplicate:
		duptrace.Mark(trace.SpanFromContext(r.Context()), res.Record)
		settled(w, OutcomeDuplicate)
		stored := res.Record.Result
		send(w, stored.Headers, stored.Code, stored.Response, true)
	case dedup.Busy:
		m.busy(w)
	case dedup.KeyReuse:
		m.problem(w, http.StatusUnprocessableEntity, CodeKeyReuse, "this key was first used for another request; use a new key for a new operation", 0)
	default:
		return false
	}
	return true
}

func (m *Middleware) busy(w http.ResponseWriter) {
	m.problem(w, http.StatusConflict, CodeKeyInProgress, "a request with this key is in progress; retry with the same key later", m.cfg.RetryAfter)
}

// run runs the handler in a transaction and answers. With a lease (the
// key reserved by a commit of its own, Config.SeparateReservations) the
// handler runs under its heartbeat; without one, the key is reserved in
// the transaction itself (reserveHeld), which holds it until it ends.
func (m *Middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, c dedup.Claim, lease *dedup.Lease) {
	// The operation does not end when the client goes away (a client that
	// timed out retries, and gets 409 until this one finishes, then its
	// answer): only the timeout, or a lost lease, ends it.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(r.Context()))
	defer cancel(nil)
	ctx, stop := context.WithTimeoutCause(ctx, m.cfg.Timeout, errTimeout)
	defer stop()
	finish, endFinish := context.WithTimeout(context.WithoutCancel(r.Context()), finishTimeout)
	defer endFinish()

	// The connection is the middleware's own, not the pool's transaction:
	// the completion and the COMMIT go in one round trip at the end
	// (keystore.Keys.CompleteCommit), after which the transaction must not
	// be ended again, only its connection released.
	conn, err := m.store.Pool().Acquire(ctx)
	var tx pgx.Tx
	if err == nil {
		defer conn.Release()
		tx, err = conn.Begin(ctx)
	}
	if err != nil {
		m.log(ctx, c.Scope, "begin", err)
		m.release(finish, nil, lease, "unavailable")
		m.problem(w, http.StatusServiceUnavailable, CodeUnavailable, "the request could not start; retry with the same key", m.cfg.RetryAfter)
		return
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback(finish) // a no-op after an explicit one
		}
	}()

	stopBeat := func() {}
	if lease == nil {
		res, err := m.reserveHeld(ctx, tx, c)
		if err != nil {
			_ = tx.Rollback(finish)
			m.log(ctx, c.Scope, "reserve key", err)
			m.problem(w, http.StatusServiceUnavailable, CodeUnavailable, "the key could not be reserved; retry with the same key", m.cfg.RetryAfter)
			return
		}
		if res.Decision != dedup.Acquired {
			_ = tx.Rollback(finish)
			m.answered(w, r, res)
			return
		}
		lease = res.Lease
	} else {
		beatCtx := ctx // the closure below must not see ctx change
		stopBeat = dedup.Heartbeat(beatCtx, m.store, []dedup.Held{{Lease: lease, Cancel: cancel}}, dedup.HeartbeatOptions{
			Lease:   m.cfg.Lease,
			OnError: func(err error) { m.log(beatCtx, lease.Scope, "lease heartbeat", err) },
		})
	}
	st := &state{tx: requestTx{tx}, key: lease.Key}
	ctx = context.WithValue(ctx, stateKey{}, st)
	ctx = outbox.NewContext(ctx, m.cfg.Outbox)
	// The handler's outbox messages wake the relays after the commit
	// below (outbox.Wake), not with a NOTIFY in the transaction, which
	// would make the commits of all requests wait in line for Postgres'
	// notify lock.
	ctx = outbox.WakeAfterCommit(ctx)
	ctx = claim.With(ctx, lease.Scope)
	rec := newCapture(w)
	panicked, abort := m.call(next, rec, r.WithContext(ctx))
	stopBeat()

	status := rec.code()
	switch {
	case abort != nil:
		// http.ErrAbortHandler: the handler asked to drop the connection.
		m.release(finish, tx, lease, "abort")
		panic(abort)
	case panicked:
		m.release(finish, tx, lease, "panic")
		m.problem(w, http.StatusInternalServerError, CodeHandlerPanic, "the request failed; retry with the same key", 0)
		return
	case errors.Is(context.Cause(ctx), dedup.ErrLeaseLost):
		// Another request took the key over: it is the one that runs now.
		m.problem(w, http.StatusConflict, CodeLeaseLost, "the request took too long and another request with this key took over; retry with the same key later", m.cfg.RetryAfter)
		return
	case ctx.Err() != nil:
		// A timeout: whatever the handler did rolls back, and the retry
		// runs it again.
		m.release(finish, tx, lease, "timeout")
		m.problem(w, http.StatusServiceUnavailable, CodeTimeout, "the request did not finish in time; retry with the same key", m.cfg.RetryAfter)
		return
	case status == http.StatusSwitchingProtocols:
		// The answer is held until COMMIT and the connection is never
		// handed over: a guarded request cannot switch protocols. It is
		// the handler's mistake, not a result.
		m.release(finish, tx, lease, "http_101")
		m.cfg.Logger.ErrorContext(ctx, "guarded handler answered 101 Switching Protocols", "consumer", m.cfg.Consumer, "key_hash", lease.KeyHash())
		m.problem(w, http.StatusInternalServerError, CodeHandlerPanic, "the handler switched protocols, which a request guarded by an idempotency key cannot", 0)
		return
	}
	if !st.decide(m.cfg.Stored(status)) {
		m.release(finish, tx, lease, fmt.Sprintf("http_%d", status))
		settled(w, OutcomeNotStored)
		send(w, rec.header, status, rec.body.Bytes(), false)
		return
	}
	result := dedup.Result{Outcome: dedup.OutcomeOK, Code: status, Headers: m.stored(rec.header), Response: rec.body.Bytes()}
	if status >= 400 {
		result.Outcome, result.Reason = dedup.OutcomeRejected, http.StatusText(status)
	}
	err = keystore.Of(m.store).CompleteCommit(finish, tx, lease, result)
	committed = err == nil
	switch {
	case errors.Is(err, dedup.ErrLeaseLost):
		m.problem(w, http.StatusConflict, CodeLeaseLost, "another request with this key took over; retry with the same key later", m.cfg.RetryAfter)
		return
	case err != nil:
		// Rolled back (or, rarely, committed with the answer lost): the
		// retry runs again, or replays what did commit.
		m.log(ctx, lease.Scope, "commit", err)
		m.release(finish, tx, lease, "unavailable")
		m.problem(w, http.StatusServiceUnavailable, CodeUnavailable, "the request could not commit; retry with the same key", m.cfg.RetryAfter)
		return
	}
	outbox.Wake(ctx)
	if result.Outcome == dedup.OutcomeRejected {
		settled(w, OutcomeRejected)
	} else {
		settled(w, OutcomeProcessed)
	}
	send(w, rec.header, status, rec.body.Bytes(), false)
}

var errTimeout = errors.New("the request timed out")

// call runs the handler and reports whether it panicked. A panic with
// http.ErrAbortHandler is returned as abort, for run to pass on once the
// key is released.
func (m *Middleware) call(next http.Handler, w http.ResponseWriter, r *http.Request) (panicked bool, abort any) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler { //nolint:errorlint // the sentinel is compared, as net/http does
				abort = v
				return
			}
			m.cfg.Logger.ErrorContext(r.Context(), "handler panicked", "consumer", m.cfg.Consumer, "key_hash", keyHash(r), "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			panicked = true
		}
	}()
	next.ServeHTTP(w, r)
	return false, nil
}

func keyHash(r *http.Request) string {
	if sc, _, ok := claim.From(r.Context()); ok {
		return sc.KeyHash()
	}
	return ""
}

// release rolls the request's transaction back (tx may be nil) and gives
// the key up, leaving nothing of the attempt behind: the key is absent
// again, so that the retry runs the request again, and so does a corrected
// request (another fingerprint) with the same key. A key the transaction
// held goes with the rollback; a separate reservation is forgotten
// (dedup.Store.Forget). why says what ended the attempt, for the log.
func (m *Middleware) release(ctx context.Context, tx pgx.Tx, lease *dedup.Lease, why string) {
	if tx != nil {
		_ = tx.Rollback(ctx) // a broken connection rolls it back as well
	}
	if lease == nil || lease.HeldByTransaction() {
		return
	}
	if err := m.store.Forget(ctx, lease); err != nil && !errors.Is(err, dedup.ErrLeaseLost) {
		// The lease expires by itself: a retry waits for it at most.
		m.log(ctx, lease.Scope, "release key after "+why, err)
	}
}

func (m *Middleware) log(ctx context.Context, sc dedup.Scope, what string, err error) {
	m.cfg.Logger.WarnContext(ctx, "idempotency: "+what, "consumer", sc.Consumer, "key_hash", sc.KeyHash(), "err", redact.Error(err))
}

// ErrTxOwned is what Commit and Rollback of the transaction Tx returns
// give: the middleware ends it, with the key's completion.
var ErrTxOwned = errors.New("idemhttp: the request's transaction is committed by the middleware, with the key's completion")

// requestTx is the handler's view of the request's transaction: everything
// but ending it (savepoints from Begin may be committed and rolled back).
type requestTx struct{ pgx.Tx }

func (requestTx) Commit(context.Context) error   { return ErrTxOwned }
func (requestTx) Rollback(context.Context) error { return ErrTxOwned }

// state is what a guarded request's context carries: its transaction and
// the handler's own decision to store its response or not.
type state struct {
	tx pgx.Tx
	// key is the request's key, parsed from its header.
	key string
	// keep is 0 (Config.Stored decides), +1 (Keep) or -1 (Discard).
	keep int
}

func (s *state) decide(byStatus bool) bool {
	switch s.keep {
	case 1:
		return true
	case -1:
		return false
	}
	return byStatus
}

type stateKey struct{}

func stateOf(r *http.Request) *state {
	st, _ := r.Context().Value(stateKey{}).(*state)
	return st
}

// Tx returns the transaction of a guarded request: the handler's writes and
// outbox messages go into it, and the middleware commits it together with
// the key's completion, before the response leaves (or rolls it back when
// the response is not stored). Outbox messages enqueued with the request's
// context wake the relays after that commit (outbox.WakeAfterCommit): a
// handler that enqueues with it on a transaction of its own calls
// outbox.Wake(r.Context()) after committing that one, or leaves the rows
// to the relays' poll. Its Commit and Rollback return ErrTxOwned;
// savepoints (Begin) work as usual. It is nil where the request is not guarded (a
// method the middleware does not guard, or Optional without a key).
func Tx(r *http.Request) pgx.Tx {
	if st := stateOf(r); st != nil {
		return st.tx
	}
	return nil
}

// Key returns the idempotency key of a guarded request as the middleware
// read it from the header: the content of an RFC 8941 sf-string ("k" is
// k), or the bare value a client that predates the draft sends. It is the
// key the request is deduplicated by; a handler that passes the key on (as
// a message's message_id) takes it from here, not from the header. It is ""
// where the request is not guarded.
func Key(r *http.Request) string {
	if st := stateOf(r); st != nil {
		return st.key
	}
	return ""
}

// Keep marks the response of a guarded request as the operation's result,
// stored and replayed whatever its status (a 409 "order already shipped"
// that a retry would not change). Outside a guarded request it does nothing.
func Keep(r *http.Request) {
	if st := stateOf(r); st != nil {
		st.keep = 1
	}
}

// Discard marks the response of a guarded request as no result: the
// transaction rolls back, the key is released, and a retry runs again,
// whatever its status (a 200 that reports a failure in its body). Outside a
// guarded request it does nothing.
func Discard(r *http.Request) {
	if st := stateOf(r); st != nil {
		st.keep = -1
	}
}

// reserveHeld reserves c's key in tx, held by tx until it ends: the key's
// row is written once, by the completion, with the handler's effects and the
// result (one commit per request). A concurrent request with the same key
// must not wait for that commit: each first takes an advisory lock of the
// key in its transaction, and one that does not get it answers 409 at once,
// as a separate reservation's busy key would. A key reserved by a commit of
// its own (a server with SeparateReservations, during a rolling change) is
// found busy, or taken over once its lease expired.
func (m *Middleware) reserveHeld(ctx context.Context, tx pgx.Tx, c dedup.Claim) (dedup.Reservation, error) {
	return keystore.Of(m.store).TryReserveTx(ctx, tx, c)
}
