package dedup

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/sweep"
)

// instrumentation is the name of the store's meter.
const instrumentation = "github.com/idemq/idemq/dedup"

// Store is the Postgres key store. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
	cfg  Config
	sql  statements
	// inTx are the reservations that run in a caller's transaction: never
	// asynchronous, whatever DurableReservations says, since a setting
	// made in the caller's transaction would last until its COMMIT.
	inTx statements

	gcMetrics *sweep.Metrics
}

// NewStore returns a store over pool. A nil cfg means defaults. The tables
// must exist: run schema.Migrate first (or `idemq migrate`); NewStore does
// not look at the database, Check does (consumer.Run calls it).
func NewStore(pool *pgxpool.Pool, cfg *Config) (*Store, error) {
	if pool == nil {
		return nil, errors.New("dedup: nil pool")
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	m, err := sweep.NewMetrics(c.MeterProvider, instrumentation, c.Schema, "keys")
	if err != nil {
		return nil, fmt.Errorf("dedup: metrics: %w", err)
	}
	schema := pgx.Identifier{c.Schema}.Sanitize()
	return &Store{pool: pool, cfg: c, sql: newStatements(schema, c.DurableReservations), inTx: newStatements(schema, true), gcMetrics: m}, nil
}

// Config returns the store's configuration with defaults filled in.
func (s *Store) Config() Config { return s.cfg }

// Check reports whether the store's schema is migrated as far as this build
// needs. A schema never migrated, or one an older idemq left behind, is an
// error wrapping ErrNotMigrated that says to run `idemq migrate` (or
// schema.Migrate); a schema a later idemq migrated further is accepted.
// NewStore takes no context and does not look at the database: consumer.Run
// calls Check before it connects to the broker, and so may anyone who uses
// the store on its own.
func (s *Store) Check(ctx context.Context) error {
	if err := schema.Check(ctx, s.pool, s.cfg.Schema); err != nil {
		return fmt.Errorf("dedup: %w", err)
	}
	return nil
}

// Pool returns the pool the store runs its own statements on.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Claim is what a reservation is asked for.
type Claim struct {
	// Scope is the key to reserve, in its scope.
	Scope
	// Fingerprint identifies the operation's significant content.
	Fingerprint Fingerprint
	// TraceID and SpanID (hex) identify the processing span, stored so that a
	// duplicate can link to the processing it duplicated. Optional.
	TraceID, SpanID string
	// Lease overrides the store's lease duration when positive.
	Lease time.Duration
}

// Decision is how a reservation ended.
type Decision int

// The decisions of Reserve.
const (
	// Acquired: the caller holds the lease and must Complete or Release it.
	Acquired Decision = iota + 1
	// Duplicate: the key is completed with the same fingerprint; the stored
	// result is in Reservation.Record.
	Duplicate
	// Busy: another worker holds a valid lease; try again later.
	Busy
	// KeyReuse: the key belongs to an operation with another fingerprint.
	KeyReuse
)

func (d Decision) String() string {
	switch d {
	case Acquired:
		return "acquired"
	case Duplicate:
		return "duplicate"
	case Busy:
		return "busy"
	case KeyReuse:
		return "key_reuse"
	}
	return fmt.Sprintf("Decision(%d)", int(d))
}

// Reservation is the answer of Reserve.
type Reservation struct {
	Decision Decision
	// Lease is set when Decision is Acquired.
	Lease *Lease
	// Record is the existing row when the key was not acquired.
	Record *Record
}

// Err returns nil for Acquired, else ErrDuplicate, ErrBusy or ErrKeyReuse.
func (r Reservation) Err() error {
	switch r.Decision {
	case Acquired:
		return nil
	case Duplicate:
		return ErrDuplicate
	case Busy:
		return ErrBusy
	case KeyReuse:
		return ErrKeyReuse
	}
	return fmt.Errorf("dedup: unknown decision %d", r.Decision)
}

// Lease is a held reservation. Its Token fences every later write: once the
// key is taken over, Complete, Release, Extend and Step fail with ErrLeaseLost.
type Lease struct {
	// Scope is the key held, as it was claimed.
	Scope
	// Token is the fencing token written by this reservation.
	Token [16]byte
	// Attempts counts reservations of this key, this one included.
	Attempts int
	// LockedUntil is when the lease expires unless extended.
	LockedUntil time.Time
	// TakenOver reports that an earlier lease on the key expired or was released.
	TakenOver bool
	// RecoveryPoint is the last step committed by an earlier attempt ("" if none).
	RecoveryPoint string
	// RecoveryData is the data committed with the recovery point.
	RecoveryData []byte
	// Steps are the names of the steps committed by earlier attempts.
	Steps []string

	// stored is the key as the table holds it (see Store.storedKey).
	stored string
	// held: reserved in the caller's transaction (ReserveTx), which holds
	// the row, written completed, until it ends.
	held bool
	// unwritten: held by the key's advisory lock in the caller's
	// transaction, with no row yet (TryReserveTx found the key absent): the
	// completion writes the row, once, with the result.
	unwritten *unwrittenRow
}

// unwrittenRow is what the row of an unwritten lease is written with.
type unwrittenRow struct {
	fingerprint     Fingerprint
	traceID, spanID string
}

// HeldByTransaction reports that the lease was reserved inside a caller's
// transaction (ReserveTx, ReserveBatchTx): that transaction's row lock is
// the lease, so it has no expiry to extend, and it cannot be released (a
// rollback gives it up) nor carry steps.
func (l *Lease) HeldByTransaction() bool { return l.held }

// Result is what Complete stores and what duplicates receive.
type Result struct {
	Outcome Outcome
	Code    int
	// Reason is the reason a business rejection gave ("insufficient
	// funds"), kept with the code and the response; "" for OutcomeOK.
	Reason string
	// Headers are the headers of the response, for protocols whose answer
	// has them (an HTTP response: see package idemhttp), stored as a JSON
	// object and given back as they were; nil for none.
	Headers  map[string][]string
	Response []byte
}

// State is a key row's state.
type State string

// The states a row can be in; an absent row is the third state.
const (
	StateInProgress State = "in_progress"
	StateCompleted  State = "completed"
)

// Record is a snapshot of a key's row.
type Record struct {
	// Scope is the key's scope, with the key as it was asked for.
	Scope
	State       State
	Fingerprint Fingerprint
	// LeaseValid reports an in-progress row whose lease has not expired.
	LeaseValid    bool
	LockedUntil   *time.Time
	Attempts      int
	RecoveryPoint string
	RecoveryData  []byte
	Steps         []string
	// Released reports an in-progress row whose holder gave it up
	// (Release): no worker holds it, and the next reservation takes it over.
	// A lease that merely expired (its worker died) is not released.
	Released bool
	// ReleaseReason is the reason the holder gave when it released the row
	// (the consumer's words: permanent_error, max_attempts_exceeded,
	// retried); "" unless Released.
	ReleaseReason string
	// Result is set for completed rows.
	Result *Result
	// TraceID and SpanID identify the processing that holds or completed the key.
	TraceID, SpanID string
	CreatedAt       time.Time
	UpdatedAt       time.Time
	CompletedAt     *time.Time
}

// Reserve claims the key with ONE atomic statement: it creates the row, or
// takes over an expired lease of the same operation (attempts+1, fresh
// token), or returns nothing, in which case the row is read and classified
// (Duplicate, Busy, KeyReuse). A row that vanishes between the two (GC) or a
// lease that expires in between starts a new round, a bounded number of times.
func (s *Store) Reserve(ctx context.Context, c Claim) (Reservation, error) {
	return s.reserve(ctx, s.pool, c)
}

// ReserveTx is Reserve inside the caller's transaction: the new row (or
// the takeover) is visible to others only once tx commits, and until then
// its row lock makes any other reservation of the key wait for tx's end.
// The row is written as it will be after a Complete with the default
// result (completed, ok, no response), so that a successful operation
// writes it once; Complete then records any other result. Commit only after
// Complete, as always: a transaction that commits without it leaves the key
// completed with the default result. The lease is HeldByTransaction: it
// needs no heartbeat, and a rollback gives it up. See ReserveBatchTx.
func (s *keys) ReserveTx(ctx context.Context, tx pgx.Tx, c Claim) (Reservation, error) {
	return s.store().reserve(ctx, tx, c)
}

func (s *Store) reserve(ctx context.Context, q querier, c Claim) (Reservation, error) {
	if err := checkClaim(c); err != nil {
		return Reservation{}, err
	}
	return s.reserveRounds(ctx, q, c)
}

// checkClaim refuses a claim no reservation may make.
func checkClaim(c Claim) error {
	if err := ValidateKey(c.Key); err != nil {
		return fmt.Errorf("reserve key: %w", err)
	}
	if err := ValidateTenant(c.Tenant); err != nil {
		return fmt.Errorf("reserve key: %w", err)
	}
	if c.Consumer == "" {
		return errors.New("reserve key: empty consumer name")
	}
	return nil
}

// claimRow runs the reservation statement of q (reserveStatement) for c
// and returns the lease it wrote; pgx.ErrNoRows when it wrote none.
func (s *Store) claimRow(ctx context.Context, q querier, c Claim) (*Lease, error) {
	lease := c.Lease
	if lease <= 0 {
		lease = s.cfg.Lease
	}
	key := s.storedKey(c.Key)
	var token [16]byte
	if _, err := rand.Read(token[:]); err != nil {
		return nil, fmt.Errorf("token: %w", err)
	}
	l := &Lease{Scope: c.Scope, Token: token, stored: key, held: isTx(q)}
	var (
		inserted bool
		until    *time.Time
	)
	if err := q.QueryRow(ctx, s.reserveStatement(q),
		c.Consumer, c.Tenant, key, c.Fingerprint[:], token, lease.Microseconds(), nullable(c.TraceID), nullable(c.SpanID),
	).Scan(&l.Attempts, &until, &l.RecoveryPoint, &l.RecoveryData, &l.Steps, &inserted); err != nil {
		return nil, err
	}
	l.TakenOver = !inserted
	if until != nil {
		l.LockedUntil = *until
	}
	return l, nil
}

// reserveRounds reserves c's key, reading the row when the statement
// wrote none, for a bounded number of rounds.
func (s *Store) reserveRounds(ctx context.Context, q querier, c Claim) (Reservation, error) {
	for range maxReserveRounds {
		l, err := s.claimRow(ctx, q, c)
		if err == nil {
			return Reservation{Decision: Acquired, Lease: l}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Reservation{}, interpretError("reserve key", err)
		}
		rec, err := s.inspect(ctx, q, c.Scope)
		if errors.Is(err, ErrNotFound) {
			continue // deleted between the statements: reserve again
		}
		if err != nil {
			return Reservation{}, fmt.Errorf("reserve key: %w", err)
		}
		if r, ok := refusal(rec, c); ok {
			return r, nil
		}
		// The lease expired between the upsert and the read: reserve again.
	}
	return Reservation{}, fmt.Errorf("reserve key: no decision after %d rounds", maxReserveRounds)
}

// refusal is the answer to c of a reservation that finds rec: KeyReuse,
// Duplicate or Busy; ok false when rec does not refuse it (an expired
// lease of the same operation, which c may take over).
func refusal(rec *Record, c Claim) (r Reservation, ok bool) {
	switch {
	case rec.Fingerprint != c.Fingerprint:
		return Reservation{Decision: KeyReuse, Record: rec}, true
	case rec.State == StateCompleted:
		return Reservation{Decision: Duplicate, Record: rec}, true
	case rec.LeaseValid:
		return Reservation{Decision: Busy, Record: rec}, true
	}
	return Reservation{}, false
}

// Refusal is the answer a reservation of c gets from the key's committed
// row, without reserving it, for a caller that knows another transaction
// holds the key: Duplicate or KeyReuse when the row is completed (or names
// another operation), else Busy. It reads in tx, the caller's transaction.
func (s *keys) Refusal(ctx context.Context, tx pgx.Tx, c Claim) (Reservation, error) {
	rec, err := s.store().inspect(ctx, tx, c.Scope)
	return refusalWhileHeld(rec, err, c)
}

// refusalWhileHeld is Refusal's answer from what reading the key's row
// found (rec, or err from inspect).
func refusalWhileHeld(rec *Record, err error, c Claim) (Reservation, error) {
	if errors.Is(err, ErrNotFound) {
		return Reservation{Decision: Busy}, nil
	}
	if err != nil {
		return Reservation{}, fmt.Errorf("read key: %w", err)
	}
	if r, ok := refusal(rec, c); ok {
		return r, nil
	}
	return Reservation{Decision: Busy, Record: rec}, nil
}

// Complete marks the key completed with result, inside the caller's
// transaction, fenced by the lease token. Call it last, just before COMMIT:
// the business writes, the outbox rows and the completion then commit
// together or not at all. If the lease was taken over or released it returns
// ErrLeaseLost and the caller must roll back.
func (s *Store) Complete(ctx context.Context, tx pgx.Tx, l *Lease, r Result) error {
	sql, args, err := s.completion(l, r)
	if err != nil || sql == "" {
		return err
	}
	tag, err := tx.Exec(ctx, sql, args...)
	if err != nil {
		return interpretError("complete key", err)
	}
	return completedOrLost(tag)
}

// completion is the statement that completes l's key with r and its
// arguments; "" when there is nothing to write (a held lease whose result
// is the one its reservation presumed).
func (s *Store) completion(l *Lease, r Result) (string, []any, error) {
	if err := checkOutcome(r); err != nil {
		return "", nil, err
	}
	hdr, err := encodeHeaders(r.Headers)
	if err != nil {
		return "", nil, err
	}
	if w := l.unwritten; w != nil {
		return s.sql.insertCompleted, []any{l.Consumer, l.Tenant, l.stored, w.fingerprint[:], nullable(w.traceID), nullable(w.spanID),
			string(r.Outcome), r.Code, r.Response, nullable(r.Reason), hdr}, nil
	}
	if l.held {
		if presumed(r) {
			return "", nil, nil // the reservation wrote this result already
		}
		return s.sql.completeHeld, []any{l.Consumer, l.Tenant, l.stored, string(r.Outcome), r.Code, r.Response, nullable(r.Reason), hdr}, nil
	}
	return s.sql.complete, []any{l.Consumer, l.Tenant, l.stored, l.Token, string(r.Outcome), r.Code, r.Response, r.Reason, hdr}, nil
}

// presumed reports whether r is the result a held reservation writes.
func presumed(r Result) bool {
	return r.Outcome == OutcomeOK && r.Code == 0 && r.Response == nil && r.Reason == "" && len(r.Headers) == 0
}

// checkOutcome refuses a result that is neither ok nor rejected.
func checkOutcome(r Result) error {
	if !r.Outcome.Stored() {
		return fmt.Errorf("complete key: outcome %q is not one a result stores (ok, rejected)", r.Outcome)
	}
	return nil
}

// completedOrLost reads a completion's command tag: no row means the lease
// was lost (fenced out).
func completedOrLost(tag pgconn.CommandTag) error {
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("complete key: %w", ErrLeaseLost)
	}
	return nil
}

// QueueComplete queues the completion of l's key on b, for a caller that
// pipelines it with other statements of its transaction (one round trip for
// all of them). The queued statement reports ErrLeaseLost, through the batch
// results, when the lease was lost; b must be sent on the transaction that
// holds the handler's effects (pgx.Tx.SendBatch).
func (s *keys) QueueComplete(b *pgx.Batch, l *Lease, r Result) error {
	sql, args, err := s.store().completion(l, r)
	if err != nil || sql == "" {
		return err
	}
	b.Queue(sql, args...).Exec(completedOrLost)
	return nil
}

// Release gives the key up after a failure: the lease expires now,
// attempts and created_at are kept, and the next delivery takes the key
// over. The row reads as released (Record.Released) with reason, the word
// that says why it was given up (the consumer's: permanent_error,
// max_attempts_exceeded, retried), until it is taken over. Fenced: a lease
// already lost gives ErrLeaseLost.
func (s *Store) Release(ctx context.Context, l *Lease, reason string) error {
	if l.held {
		return errHeld("release key")
	}
	tag, err := s.pool.Exec(ctx, s.sql.release, l.Consumer, l.Tenant, l.stored, l.Token, nullable(reason))
	if err != nil {
		return interpretError("release key", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("release key: %w", ErrLeaseLost)
	}
	return nil
}

// Forget gives the key up and forgets it: the row is deleted, so the key is
// absent again and the next reservation starts afresh, also for another
// fingerprint. It is for a protocol in which a failed attempt leaves
// nothing behind (an HTTP request refused before its operation ran, which
// the client may correct and send again with the same key); a message
// consumer releases instead. Fenced: a lease already lost gives
// ErrLeaseLost.
func (s *Store) Forget(ctx context.Context, l *Lease) error {
	if l.held {
		return errHeld("forget key")
	}
	tag, err := s.pool.Exec(ctx, s.sql.forget, l.Consumer, l.Tenant, l.stored, l.Token)
	if err != nil {
		return interpretError("forget key", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("forget key: %w", ErrLeaseLost)
	}
	return nil
}

// Extend is the heartbeat: it pushes the lease's expiry to now + the lease
// duration (the store's, or d when positive) and updates l.LockedUntil.
// Fenced: a lease already lost gives ErrLeaseLost.
func (s *Store) Extend(ctx context.Context, l *Lease, d time.Duration) error {
	if l.held {
		return errHeld("extend lease")
	}
	if d <= 0 {
		d = s.cfg.Lease
	}
	var until time.Time
	err := s.pool.QueryRow(ctx, s.sql.extend, l.Consumer, l.Tenant, l.stored, l.Token, d.Microseconds()).Scan(&until)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("extend lease: %w", ErrLeaseLost)
	}
	if err != nil {
		return interpretError("extend lease", err)
	}
	l.LockedUntil = until
	return nil
}

// Inspect returns the row of a key (given raw, as the publisher sent it), or
// an error wrapping ErrNotFound.
func (s *Store) Inspect(ctx context.Context, sc Scope) (*Record, error) {
	rec, err := s.inspect(ctx, s.pool, sc)
	if err != nil {
		return nil, fmt.Errorf("inspect key: %w", err)
	}
	return rec, nil
}

// querier is what the pool and a transaction share.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// isTx reports whether q is a caller's transaction rather than the pool.
func isTx(q querier) bool {
	_, ok := q.(pgx.Tx)
	return ok
}

// reserveStatement is the single-key reservation for q: held by the
// caller's transaction (durable, presumed completed), or autocommit.
func (s *Store) reserveStatement(q querier) string {
	if isTx(q) {
		return s.inTx.reserveHeld
	}
	return s.sql.reserve
}

// errHeld refuses what a lease held by a transaction cannot do.
func errHeld(what string) error {
	return fmt.Errorf("%s: the lease is held by the transaction that reserved it (ReserveTx): it has no expiry to extend and is given up by a rollback", what)
}

// inspect reads the row of sc (its key raw).
func (s *Store) inspect(ctx context.Context, q querier, sc Scope) (*Record, error) {
	rec, _, err := scanRecord(q.QueryRow(ctx, s.sql.inspect, sc.Consumer, sc.Tenant, s.storedKey(sc.Key)))
	if err != nil {
		return nil, interpretError("read key", err)
	}
	rec.Key = sc.Key
	return rec, nil
}

// scanRecord reads a row of the inspect column list. The record's Key is
// left to the caller, who knows the raw key; stored is the key as the row
// holds it.
func scanRecord(row pgx.Row) (rec *Record, stored string, err error) {
	rec = &Record{}
	var (
		fp              []byte
		outcome         *string
		code            *int
		response        []byte
		recoveryPoint   *string
		traceID, spanID *string
		reason, release *string
		headers         []byte
	)
	err = row.Scan(
		&rec.Consumer, &rec.Tenant, &stored, &rec.State, &fp, &rec.LeaseValid, &rec.LockedUntil,
		&rec.Attempts, &recoveryPoint, &rec.RecoveryData, &rec.Steps, &outcome, &code, &response,
		&traceID, &spanID, &rec.CreatedAt, &rec.UpdatedAt, &rec.CompletedAt, &reason,
		&rec.Released, &release, &headers,
	)
	if err != nil {
		return nil, "", err
	}
	copy(rec.Fingerprint[:], fp)
	rec.RecoveryPoint = deref(recoveryPoint)
	rec.TraceID, rec.SpanID = deref(traceID), deref(spanID)
	rec.ReleaseReason = deref(release)
	if outcome != nil {
		rec.Result = &Result{Outcome: Outcome(*outcome), Reason: deref(reason), Response: response}
		if err := decodeHeaders(headers, &rec.Result.Headers); err != nil {
			return nil, "", err
		}
		if code != nil {
			rec.Result.Code = *code
		}
	}
	return rec, stored, nil
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
