package conformance

import (
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
)

// Result is what a door's user sees of an operation, in the suite's one
// vocabulary. Processed, Rejected, Duplicate, KeyReuse, InvalidKey and
// DeadLettered end an operation; InProgress, Retried and LeaseLost are
// answers on the way (the door tries again with the same key).
type Result string

// The results.
const (
	Processed    Result = "processed"
	Rejected     Result = "rejected"
	Duplicate    Result = "duplicate"
	KeyReuse     Result = "key_reuse"
	InvalidKey   Result = "invalid_key"
	DeadLettered Result = "dead_lettered"
	InProgress   Result = "in_progress"
	Retried      Result = "retried"
	LeaseLost    Result = "lease_lost"
)

// The reasons of an InvalidKey answer.
const (
	ReasonKeyRequired   = "idempotency_key_required"
	ReasonKeyInvalid    = "idempotency_key_invalid"
	ReasonTenantInvalid = "tenant_invalid"
)

// Answer is how an operation ended, as its user sees it.
type Answer struct {
	Result Result
	// Code and Body are the operation's stored result as the user got it
	// (the HTTP response; the consumer's reply): for Processed, Rejected
	// and Duplicate.
	Code int
	Body []byte
	// Reason is why an InvalidKey or DeadLettered answer refused it.
	Reason string
	// History are the answers on the way, in order.
	History []Result
}

func (a Answer) String() string {
	return fmt.Sprintf("%s (code %d, body %q, reason %q, on the way %v)", a.Result, a.Code, a.Body, a.Reason, a.History)
}

// Op is one operation a scenario sends.
type Op struct {
	Key, Tenant string
	Body        []byte
	// LoseAnswer: the process dies after the operation's first attempt
	// committed, before its answer left (a door that cannot tell ignores
	// it; only doors without a CrashKit are asked).
	LoseAnswer bool
}

// Call is one call of the handler.
type Call struct {
	Tenant, Key string
	// Attempt is the door's attempt number: the consumer's
	// Delivery.Attempt, the HTTP client's try (5xx and cut connections
	// counted).
	Attempt int
	Body    []byte
	// Schema is the store's schema, where the effect rows go.
	Schema string
}

// ActKind is what a handler call does.
type ActKind int

// The acts.
const (
	// Succeed returns Code and Body as the operation's result.
	Succeed ActKind = iota
	// Reject is a business rejection: Code and Body stored and replayed.
	Reject
	// Fail is an infrastructure failure: nothing stored, the key released.
	Fail
	// Die is the handler's process dying after its effects, before the
	// commit (HTTP: the connection is cut).
	Die
)

// Act is what one handler call does.
type Act struct {
	Kind ActKind
	Code int
	Body []byte
}

// Handle is the suite's handler: every door calls it in the handler's
// transaction.
type Handle func(ctx context.Context, tx pgx.Tx, c Call) Act

// Features says how a door differs.
type Features struct {
	// HeldReservations: the keys are reserved in the handler's own
	// transaction, whose row lock is the lease: a second copy waits for the
	// first's commit (and is then a duplicate) instead of finding the key
	// busy, and there is no lease others can see, so none to lose.
	HeldReservations bool
	// BusyAtOnce: with HeldReservations, a second copy does not wait for
	// the first's commit: it finds the key busy at once (idemhttp's
	// advisory lock), though no row shows it in progress.
	BusyAtOnce bool
	// ReleaseForgets: a released key is deleted (idemhttp forgets a failed
	// attempt, so that a corrected request may reuse the key): the attempt
	// that succeeds after failures finds the key absent (attempts 1).
	ReleaseForgets bool
}

// Door is one way into the protocol.
type Door interface {
	Features() Features
	// Store is the key store the door claims keys in (a schema of its own).
	Store() *dedup.Store
	// Scope is the scope the door claims op's key in.
	Scope(tenant, key string) dedup.Scope
	// Fingerprint is the fingerprint the door claims op with.
	Fingerprint(op Op) dedup.Fingerprint
	// Send starts op and returns at once.
	Send(tb testing.TB, op Op) *Pending
}

// CrashKit is a door that crashes its own process at each stage boundary
// (the consumers, with consumertest.CrashPoints): ops are run through
// handle once per point, and check says whether the end state is right.
type CrashKit interface {
	CrashPoints(t *testing.T, handle Handle, check func(ctx context.Context, store *dedup.Store) error, ops []Op) []CrashRow
}

// CrashRow is one crash point's result.
type CrashRow struct {
	Point   string
	Reached bool
	Err     error
}

// NewDoor makes a door whose handler is handle, for the life of t.
type NewDoor func(t *testing.T, handle Handle) Door

// waitTimeout bounds every wait of a scenario.
const waitTimeout = 45 * time.Second

// Pending is an operation on its way.
type Pending struct {
	mu      sync.Mutex
	history []Result
	changed chan struct{}
	done    chan struct{}
	answer  Answer
}

func newPending() *Pending {
	return &Pending{changed: make(chan struct{}), done: make(chan struct{})}
}

// observe records an answer on the way.
func (p *Pending) observe(r Result) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.history = append(p.history, r)
	close(p.changed)
	p.changed = make(chan struct{})
}

// finish records the final answer; later calls are ignored.
func (p *Pending) finish(a Answer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.done:
		return
	default:
	}
	a.History = slices.Clone(p.history)
	p.answer = a
	close(p.done)
}

// Wait returns the final answer, failing tb after waitTimeout.
func (p *Pending) Wait(tb testing.TB) Answer {
	tb.Helper()
	select {
	case <-p.done:
	case <-time.After(waitTimeout):
		p.mu.Lock()
		h := slices.Clone(p.history)
		p.mu.Unlock()
		tb.Fatalf("no answer within %s (answers on the way: %v)", waitTimeout, h)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.answer
}

// WaitSeen waits until r was answered on the way, failing tb after
// waitTimeout or when the operation ends without it.
func (p *Pending) WaitSeen(tb testing.TB, r Result) {
	tb.Helper()
	deadline := time.After(waitTimeout)
	for {
		p.mu.Lock()
		seen, changed := slices.Contains(p.history, r), p.changed
		p.mu.Unlock()
		if seen {
			return
		}
		select {
		case <-changed:
		case <-p.done:
			tb.Fatalf("ended %s without a %s on the way", p.Wait(tb), r)
		case <-deadline:
			tb.Fatalf("no %s within %s", r, waitTimeout)
		}
	}
}

// effectsDDL creates the table the suite's handler writes its effects in.
const effectsDDL = `CREATE TABLE %s.conformance_effects (
	tenant text NOT NULL, key text NOT NULL, call int NOT NULL, attempt int NOT NULL)`

// createEffects creates the effects table in schema; every door calls it
// for each store it makes.
func createEffects(tb testing.TB, pool *pgxpool.Pool, schema string) {
	tb.Helper()
	if _, err := pool.Exec(context.Background(), fmt.Sprintf(effectsDDL, pgx.Identifier{schema}.Sanitize())); err != nil {
		tb.Fatalf("conformance: create the effects table: %v", err)
	}
}

// effects returns the calls (by call number) whose effects committed for
// the key.
func effects(ctx context.Context, store *dedup.Store, tenant, key string) ([]int, error) {
	rows, err := store.Pool().Query(ctx, fmt.Sprintf("SELECT call FROM %s.conformance_effects WHERE tenant = $1 AND key = $2 ORDER BY call",
		pgx.Identifier{store.Config().Schema}.Sanitize()), tenant, key)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

// doneBody is the result the default behaviour stores: it names the key
// and the call, so that a second run could not replay the first's bytes.
func doneBody(key string, call int) []byte {
	return fmt.Appendf(nil, `{"done":"%x","call":%d}`, sha256.Sum256([]byte(key)), call)
}
