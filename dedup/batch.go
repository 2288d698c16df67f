package dedup

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// ReserveBatch reserves many keys with ONE atomic statement (arrays and
// unnest), with the same semantics and fencing as Reserve: each row is
// created, or its expired lease taken over, or it is classified as Duplicate,
// Busy or KeyReuse. The answers are in the order of claims. The claims must
// name distinct (consumer, tenant, key) scopes: a statement cannot claim one
// row twice, so callers hold back the repeats of a batch.
//
// The statement is prepared once per connection: its plan has no join to
// choose (the arrays feed the insert, the primary key arbitrates), so the
// generic plan Postgres settles on is as good as a fresh one and saves the
// planning of every batch. The batch statements that join the arrays to the
// table (complete, inspect, extend) run unnamed instead
// (pgx.QueryExecModeCacheDescribe), planned anew for the actual arrays at
// every execution: a cached generic plan made while the table was small can
// be a sequential scan that stays as the table grows.
func (s *keys) ReserveBatch(ctx context.Context, claims []Claim) ([]Reservation, error) {
	return s.store().reserveBatch(ctx, s.pool, claims)
}

// ReserveBatchTx is ReserveBatch inside the caller's transaction, so that a
// group's reservations, its effects and its keys' completion commit with
// one COMMIT. Until tx ends, the reserved rows are visible to no one else,
// and their row locks make any other reservation of those keys wait for
// tx's end: it then finds them completed (a duplicate) or absent (tx rolled
// back). No lease needs extending meanwhile: the lock is the lease, and a
// worker that dies takes its reservations with it. A Step, which commits
// in a transaction of its own, cannot see such a reservation.
func (s *keys) ReserveBatchTx(ctx context.Context, tx pgx.Tx, claims []Claim) ([]Reservation, error) {
	return s.store().reserveBatch(ctx, tx, claims)
}

func (s *Store) reserveBatch(ctx context.Context, q querier, claims []Claim) ([]Reservation, error) {
	out := make([]Reservation, len(claims))
	if len(claims) == 0 {
		return out, nil
	}
	n := len(claims)
	// Claim rows in one global order (the statement sorts too): two batches
	// that share keys then never wait on each other in a cycle.
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(claims[a].Consumer, claims[b].Consumer), cmp.Compare(claims[a].Tenant, claims[b].Tenant), cmp.Compare(claims[a].Key, claims[b].Key))
	})
	sorted := make([]Claim, n)
	for i, j := range order {
		sorted[i] = claims[j]
	}
	res, err := s.reserveSorted(ctx, q, sorted)
	if err != nil {
		return nil, err
	}
	for i, j := range order {
		out[j] = res[i]
	}
	return out, nil
}

func (s *Store) reserveSorted(ctx context.Context, q querier, claims []Claim) ([]Reservation, error) {
	out := make([]Reservation, len(claims))
	n := len(claims)
	var (
		consumers, tenants, keys, traceIDs, spanIDs = make([]string, n), make([]string, n), make([]string, n), make([]*string, n), make([]*string, n)
		fps                                         = make([][]byte, n)
		tokens                                      = make([][16]byte, n)
		leases                                      = make([]int64, n)
		// index finds a claim by its row: its scope with the key as stored.
		index = make(map[Scope]int, n)
	)
	tokenBytes := make([]byte, 16*n)
	if _, err := rand.Read(tokenBytes); err != nil {
		return nil, fmt.Errorf("reserve keys: token: %w", err)
	}
	for i, c := range claims {
		if err := ValidateKey(c.Key); err != nil {
			return nil, fmt.Errorf("reserve keys: claim %d: %w", i, err)
		}
		if err := ValidateTenant(c.Tenant); err != nil {
			return nil, fmt.Errorf("reserve keys: claim %d: %w", i, err)
		}
		if c.Consumer == "" {
			return nil, fmt.Errorf("reserve keys: claim %d: empty consumer name", i)
		}
		row := Scope{c.Consumer, c.Tenant, s.storedKey(c.Key)}
		if _, dup := index[row]; dup {
			return nil, fmt.Errorf("reserve keys: claim %d repeats an earlier claim's key", i)
		}
		index[row] = i
		consumers[i], tenants[i], keys[i] = row.Consumer, row.Tenant, row.Key
		fps[i] = c.Fingerprint[:]
		copy(tokens[i][:], tokenBytes[16*i:])
		traceIDs[i], spanIDs[i] = nullable(c.TraceID), nullable(c.SpanID)
		lease := c.Lease
		if lease <= 0 {
			lease = s.cfg.Lease
		}
		leases[i] = lease.Microseconds()
	}
	stmt := s.sql.reserveBatch
	if isTx(q) {
		stmt = s.inTx.reserveBatchHeld
	}
	rows, err := q.Query(ctx, stmt,
		consumers, tenants, keys, fps, tokens, leases, traceIDs, spanIDs)
	if err != nil {
		return nil, interpretError("reserve keys", err)
	}
	decided := 0
	slab := make([]Lease, n) // the batch's leases, in one allocation
	for rows.Next() {
		if decided == n {
			rows.Close()
			return nil, errors.New("reserve keys: the statement returned more rows than keys claimed")
		}
		var (
			row      Scope
			l        = &slab[decided]
			inserted bool
			token    *[16]byte
			until    *time.Time
		)
		l.held = isTx(q)
		if err := rows.Scan(&row.Consumer, &row.Tenant, &row.Key, &token, &l.Attempts, &until, &l.RecoveryPoint, &l.RecoveryData, &l.Steps, &inserted); err != nil {
			rows.Close()
			return nil, interpretError("reserve keys", err)
		}
		i, ok := index[row]
		if !ok {
			rows.Close()
			return nil, errors.New("reserve keys: the statement returned a key that was not claimed")
		}
		l.Scope, l.stored, l.TakenOver, l.Token = claims[i].Scope, row.Key, !inserted, tokens[i]
		if until != nil {
			l.LockedUntil = *until
		}
		if !l.held && (token == nil || *token != tokens[i]) {
			rows.Close()
			return nil, errors.New("reserve keys: the statement returned another lease token")
		}
		out[i] = Reservation{Decision: Acquired, Lease: l}
		decided++
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("reserve keys", err)
	}
	if decided == n {
		return out, nil
	}
	// Classify the rest with one read; a row that vanished or whose lease
	// expired in between goes through the single-key path.
	var pending []int
	for i := range out {
		if out[i].Decision == 0 {
			pending = append(pending, i)
		}
	}
	pc, pt, pk := make([]string, len(pending)), make([]string, len(pending)), make([]string, len(pending))
	for j, i := range pending {
		pc[j], pt[j], pk[j] = consumers[i], tenants[i], keys[i]
	}
	recs, err := s.inspectBatch(ctx, q, pc, pt, pk)
	if err != nil {
		return nil, err
	}
	for _, i := range pending {
		rec, ok := recs[Scope{consumers[i], tenants[i], keys[i]}]
		if ok {
			rec.Key = claims[i].Key
		}
		switch {
		case !ok, rec.Fingerprint == claims[i].Fingerprint && rec.State == StateInProgress && !rec.LeaseValid:
			r, err := s.reserve(ctx, q, claims[i])
			if err != nil {
				return nil, err
			}
			out[i] = r
		case rec.Fingerprint != claims[i].Fingerprint:
			out[i] = Reservation{Decision: KeyReuse, Record: rec}
		case rec.State == StateCompleted:
			out[i] = Reservation{Decision: Duplicate, Record: rec}
		default:
			out[i] = Reservation{Decision: Busy, Record: rec}
		}
	}
	return out, nil
}

// inspectBatch reads the rows of the given scopes (keys as stored), keyed by
// scope with the key as stored; the records' Key is left to the caller.
func (s *Store) inspectBatch(ctx context.Context, q querier, consumers, tenants, keys []string) (map[Scope]*Record, error) {
	rows, err := q.Query(ctx, s.sql.inspectBatch, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys)
	if err != nil {
		return nil, interpretError("read keys", err)
	}
	defer rows.Close()
	out := make(map[Scope]*Record, len(keys))
	for rows.Next() {
		rec, stored, err := scanRecord(rows)
		if err != nil {
			return nil, interpretError("read keys", err)
		}
		out[Scope{rec.Consumer, rec.Tenant, stored}] = rec
	}
	return out, interpretError("read keys", rows.Err())
}

// ExtendBatch extends many leases with one statement and returns the ones
// that were lost (their tokens no longer match). A lease whose row another
// transaction holds locked at that moment (in a group, the group's own
// transaction completing the key) is left as it is this time, neither
// extended nor lost: waiting for the lock could deadlock with that transaction.
func (s *keys) ExtendBatch(ctx context.Context, leases []*Lease, d time.Duration) (lost []*Lease, err error) {
	if anyHeld(leases) {
		return nil, errHeld("extend leases")
	}
	if d <= 0 {
		d = s.cfg.Lease
	}
	n := len(leases)
	consumers, tenants, keys, tokens := make([]string, n), make([]string, n), make([]string, n), make([][16]byte, n)
	byToken := make(map[[16]byte]*Lease, n)
	for i, l := range leases {
		consumers[i], tenants[i], keys[i], tokens[i] = l.Consumer, l.Tenant, l.stored, l.Token
		byToken[l.Token] = l
	}
	rows, err := s.pool.Query(ctx, s.sql.extendBatch, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys, tokens, d.Microseconds())
	if err != nil {
		return nil, interpretError("extend leases", err)
	}
	defer rows.Close()
	for rows.Next() {
		var token [16]byte
		var until *time.Time
		if err := rows.Scan(&token, &until); err != nil {
			return nil, interpretError("extend leases", err)
		}
		if l, ok := byToken[token]; ok {
			if until != nil {
				l.LockedUntil = *until
			}
			delete(byToken, token)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("extend leases", err)
	}
	for _, l := range leases {
		if _, ok := byToken[l.Token]; ok {
			lost = append(lost, l)
		}
	}
	return lost, nil
}

// ReleaseBatch releases many keys with one statement, with the semantics
// and fencing of Release, and returns the leases that were already lost.
// reasons[i] is the reason of leases[i] (see Release).
func (s *keys) ReleaseBatch(ctx context.Context, leases []*Lease, reasons []string) (lost []*Lease, err error) {
	if len(leases) != len(reasons) {
		return nil, fmt.Errorf("release keys: %d leases, %d reasons", len(leases), len(reasons))
	}
	if len(leases) == 0 {
		return nil, nil
	}
	if anyHeld(leases) {
		return nil, errHeld("release keys")
	}
	n := len(leases)
	consumers, tenants, keys, tokens, why := make([]string, n), make([]string, n), make([]string, n), make([][16]byte, n), make([]*string, n)
	pending := make(map[[16]byte]*Lease, n)
	for i, l := range leases {
		consumers[i], tenants[i], keys[i], tokens[i], why[i] = l.Consumer, l.Tenant, l.stored, l.Token, nullable(reasons[i])
		pending[l.Token] = l
	}
	rows, err := s.pool.Query(ctx, s.sql.releaseBatch, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys, tokens, why)
	if err != nil {
		return nil, interpretError("release keys", err)
	}
	defer rows.Close()
	for rows.Next() {
		var token [16]byte
		if err := rows.Scan(&token); err != nil {
			return nil, interpretError("release keys", err)
		}
		delete(pending, token)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("release keys", err)
	}
	for _, l := range leases {
		if _, ok := pending[l.Token]; ok {
			lost = append(lost, l)
		}
	}
	return lost, nil
}

// ReleaseTx gives up keys that tx holds (leases reserved with ReserveTx or
// ReserveBatchTx) after their operations failed, while the rest of tx goes
// on: once tx commits, each key reads as Release leaves it (in progress, no
// lease, released with reasons[i]) and the next delivery takes it over; if
// tx rolls back, the reservation goes with it anyway. Call it after rolling
// the failed operations' effects back (to a savepoint), before COMMIT.
func (s *keys) ReleaseTx(ctx context.Context, tx pgx.Tx, leases []*Lease, reasons []string) error {
	if len(leases) != len(reasons) {
		return fmt.Errorf("release keys: %d leases, %d reasons", len(leases), len(reasons))
	}
	if len(leases) == 0 {
		return nil
	}
	n := len(leases)
	consumers, tenants, keys, why := make([]string, n), make([]string, n), make([]string, n), make([]*string, n)
	for i, l := range leases {
		if !l.held {
			return fmt.Errorf("release keys: lease %d is not held by a transaction (use ReleaseBatch)", i)
		}
		if l.unwritten != nil {
			return errUnwritten("release keys", i)
		}
		consumers[i], tenants[i], keys[i], why[i] = l.Consumer, l.Tenant, l.stored, nullable(reasons[i])
	}
	tag, err := tx.Exec(ctx, s.sql.releaseBatchHeld, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys, why)
	if err != nil {
		return interpretError("release keys", err)
	}
	if int(tag.RowsAffected()) != n {
		return fmt.Errorf("release keys: %d of %d rows held by the transaction: %w", tag.RowsAffected(), n, ErrLeaseLost)
	}
	return nil
}

// LeaseTx turns keys that tx holds into leases that others can see, for
// operations that must go on outside tx (a step, which commits on its own):
// once tx commits, each key is in progress under the returned lease (a new
// token, expiring d from now, or the store's lease when d is 0), exactly as
// a separate Reserve leaves it, to be extended, completed or released as
// such; if tx rolls back, the returned leases are void (fenced out) and the
// reservation goes with it. Attempts are not counted again.
func (s *keys) LeaseTx(ctx context.Context, tx pgx.Tx, leases []*Lease, d time.Duration) ([]*Lease, error) {
	if len(leases) == 0 {
		return nil, nil
	}
	if d <= 0 {
		d = s.cfg.Lease
	}
	n := len(leases)
	consumers, tenants, keys, tokens := make([]string, n), make([]string, n), make([]string, n), make([][16]byte, n)
	tokenBytes := make([]byte, 16*n)
	if _, err := rand.Read(tokenBytes); err != nil {
		return nil, fmt.Errorf("lease keys: token: %w", err)
	}
	out := make([]*Lease, n)
	byToken := make(map[[16]byte]*Lease, n)
	for i, l := range leases {
		if !l.held {
			return nil, fmt.Errorf("lease keys: lease %d is not held by a transaction", i)
		}
		if l.unwritten != nil {
			return nil, errUnwritten("lease keys", i)
		}
		consumers[i], tenants[i], keys[i] = l.Consumer, l.Tenant, l.stored
		copy(tokens[i][:], tokenBytes[16*i:])
		nl := *l
		nl.held, nl.Token = false, tokens[i]
		out[i] = &nl
		byToken[tokens[i]] = &nl
	}
	rows, err := tx.Query(ctx, s.sql.leaseBatchHeld, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys, tokens, d.Microseconds())
	if err != nil {
		return nil, interpretError("lease keys", err)
	}
	defer rows.Close()
	got := 0
	for rows.Next() {
		var (
			token [16]byte
			until time.Time
		)
		if err := rows.Scan(&token, &until); err != nil {
			return nil, interpretError("lease keys", err)
		}
		if l, ok := byToken[token]; ok {
			l.LockedUntil = until
			got++
		}
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("lease keys", err)
	}
	if got != n {
		return nil, fmt.Errorf("lease keys: %d of %d rows held by the transaction: %w", got, n, ErrLeaseLost)
	}
	return out, nil
}

// CompleteBatch completes many keys inside the caller's transaction with
// one statement, each fenced by its own lease token. It returns the leases
// that were lost; if any were, the caller must roll back (or roll back to a
// savepoint and complete the others again), exactly as with Complete.
func (s *keys) CompleteBatch(ctx context.Context, tx pgx.Tx, leases []*Lease, results []Result) (lost []*Lease, err error) {
	if len(leases) != len(results) {
		return nil, fmt.Errorf("complete keys: %d leases, %d results", len(leases), len(results))
	}
	var leased []int // the leases that are not held by tx
	var held []int   // held ones whose result is not the presumed one
	for i, l := range leases {
		if err := checkOutcome(results[i]); err != nil {
			return nil, err
		}
		switch {
		case l.unwritten != nil:
			return nil, errUnwritten("complete keys", i)
		case !l.held:
			leased = append(leased, i)
		case !presumed(results[i]):
			held = append(held, i)
		}
	}
	if err := s.store().completeHeldBatch(ctx, tx, leases, results, held); err != nil {
		return nil, err
	}
	if len(leased) == 0 {
		return nil, nil
	}
	n := len(leased)
	consumers, tenants, keys, outcomes := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	tokens, codes, responses, reasons := make([][16]byte, n), make([]int32, n), make([][]byte, n), make([]*string, n)
	headers := make([]*string, n)
	pending := make(map[[16]byte]*Lease, n)
	for j, i := range leased {
		l, r := leases[i], results[i]
		consumers[j], tenants[j], keys[j], tokens[j] = l.Consumer, l.Tenant, l.stored, l.Token
		outcomes[j], codes[j], responses[j], reasons[j] = string(r.Outcome), int32(r.Code), r.Response, nullable(r.Reason)
		hdr, err := encodeHeaders(r.Headers)
		if err != nil {
			return nil, err
		}
		headers[j] = hdr
		pending[l.Token] = l
	}
	rows, err := tx.Query(ctx, s.sql.completeBatch, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys, tokens, outcomes, codes, responses, reasons, headers)
	if err != nil {
		return nil, interpretError("complete keys", err)
	}
	defer rows.Close()
	for rows.Next() {
		var token [16]byte
		if err := rows.Scan(&token); err != nil {
			return nil, interpretError("complete keys", err)
		}
		delete(pending, token)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("complete keys", err)
	}
	for _, i := range leased {
		if _, ok := pending[leases[i].Token]; ok {
			lost = append(lost, leases[i])
		}
	}
	return lost, nil
}

// completeHeldBatch records the results (at idx) of leases held by tx that
// differ from the presumed one, with one statement; the rows are tx's own.
func (s *Store) completeHeldBatch(ctx context.Context, tx pgx.Tx, leases []*Lease, results []Result, idx []int) error {
	if len(idx) == 0 {
		return nil
	}
	n := len(idx)
	consumers, tenants, keys, outcomes := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	codes, responses, reasons, headers := make([]int32, n), make([][]byte, n), make([]*string, n), make([]*string, n)
	for j, i := range idx {
		l, r := leases[i], results[i]
		consumers[j], tenants[j], keys[j] = l.Consumer, l.Tenant, l.stored
		outcomes[j], codes[j], responses[j], reasons[j] = string(r.Outcome), int32(r.Code), r.Response, nullable(r.Reason)
		hdr, err := encodeHeaders(r.Headers)
		if err != nil {
			return err
		}
		headers[j] = hdr
	}
	tag, err := tx.Exec(ctx, s.sql.completeBatchHeld, pgx.QueryExecModeCacheDescribe, consumers, tenants, keys, outcomes, codes, responses, reasons, headers)
	if err != nil {
		return interpretError("complete keys", err)
	}
	if int(tag.RowsAffected()) != n {
		return fmt.Errorf("complete keys: %d of %d rows held by the transaction: %w", tag.RowsAffected(), n, ErrLeaseLost)
	}
	return nil
}

// anyHeld reports whether any of the leases is held by a transaction.
func anyHeld(leases []*Lease) bool {
	for _, l := range leases {
		if l.held {
			return true
		}
	}
	return false
}
