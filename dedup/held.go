package dedup

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// lockSQL takes the transaction-scoped advisory lock of a key, or reports
// that another transaction has it. The two-int4 form keeps the lock apart
// from the single-bigint advisory locks applications take. A transaction
// that holds the lock gets it again.
const lockSQL = "SELECT pg_try_advisory_xact_lock($1::int4, $2::int4)"

// lockID is the advisory lock of a key in the store's schema: 64 bits of
// the hash of both. Two keys that share them (one chance in 2^64) only
// refuse each other while both are held.
func (s *Store) lockID(sc Scope) (hi, lo int32) {
	h := sha256.Sum256([]byte(s.cfg.Schema + "\x00" + sc.KeyHash()))
	return int32(binary.BigEndian.Uint32(h[0:4])), int32(binary.BigEndian.Uint32(h[4:8]))
}

// TryReserveTx is ReserveTx for a caller that must not wait for another
// transaction holding the key (a request answered 409 at once). One round
// trip takes the key's advisory lock and reads its row. With the lock and
// no row, the key is this transaction's and nothing is written yet: the
// completion writes the row once, with the result, and finds the key taken
// (ErrLeaseLost) if a reservation that takes no lock wrote it meanwhile.
// With the lock and a row, the row's answer is Reserve's (an expired lease
// of the same operation is taken over in tx). When another transaction
// holds the lock, the answer is Refusal's.
func (s *keys) TryReserveTx(ctx context.Context, tx pgx.Tx, c Claim) (Reservation, error) {
	if err := checkClaim(c); err != nil {
		return Reservation{}, err
	}
	st := s.store()
	hi, lo := st.lockID(c.Scope)
	key := st.storedKey(c.Key)
	b := &pgx.Batch{}
	b.Queue(lockSQL, hi, lo)
	// A statement of its own, after the lock: its snapshot sees what the
	// transaction that held the lock committed.
	b.Queue(st.sql.inspect, c.Consumer, c.Tenant, key)
	br := tx.SendBatch(ctx, b)
	var got bool
	if err := br.QueryRow().Scan(&got); err != nil {
		_ = br.Close()
		return Reservation{}, fmt.Errorf("lock key: %w", err)
	}
	rec, _, err := scanRecord(br.QueryRow())
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		err = interpretError("read key", err)
	} else {
		rec.Key = c.Key
	}
	switch {
	case !got:
		return refusalWhileHeld(rec, err, c)
	case errors.Is(err, ErrNotFound):
		l := &Lease{Scope: c.Scope, Attempts: 1, stored: key, held: true,
			unwritten: &unwrittenRow{fingerprint: c.Fingerprint, traceID: c.TraceID, spanID: c.SpanID}}
		return Reservation{Decision: Acquired, Lease: l}, nil
	case err != nil:
		return Reservation{}, err
	}
	if r, ok := refusal(rec, c); ok {
		return r, nil
	}
	// An expired lease of the same operation: take it over, in tx.
	return st.reserveRounds(ctx, tx, c)
}

// CompleteCommit completes l's key with r in tx and commits tx, in one
// round trip: the completion is pipelined with the COMMIT, and fails the
// transaction when the lease was lost (ErrLeaseLost), so that the COMMIT
// behind it never commits the effects without it. On nil, tx is over but
// pgx does not know it: the caller must not Commit or Rollback it (either
// would send a statement of its own) and releases its connection. On an
// error, the caller rolls tx back.
func (s *keys) CompleteCommit(ctx context.Context, tx pgx.Tx, l *Lease, r Result) error {
	st := s.store()
	sql, args, err := st.completion(l, r)
	if err != nil {
		return err
	}
	b := &pgx.Batch{}
	switch sql {
	case "":
	case st.sql.completeHeld:
		b.Queue(st.sql.completeHeldOrFail, args...)
	case st.sql.insertCompleted:
		b.Queue(st.sql.insertCompletedOrFail, args...)
	default:
		b.Queue(st.sql.completeOrFail, args...)
	}
	b.Queue("COMMIT")
	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if sql != "" {
		if _, err := br.Exec(); err != nil {
			if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == divisionByZero {
				return fmt.Errorf("complete key: %w", ErrLeaseLost)
			}
			return interpretError("complete key", err)
		}
	}
	tag, err := br.Exec()
	if err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	if tag.String() != "COMMIT" {
		return fmt.Errorf("commit: the transaction rolled back (%s)", tag)
	}
	return br.Close()
}

// divisionByZero is the error a completion …OrFail statement raises when
// it completed no row (orFail).
const divisionByZero = "22012"

// orFail turns a completion (an UPDATE) into a statement that fails, and
// with it the transaction, when it updates no row: the completion's fence
// as an error, for a completion pipelined with the COMMIT behind it.
func orFail(update string) string {
	return "WITH done AS (" + update + "\nRETURNING 1)\nSELECT 1 / count(*) FROM done"
}

// errUnwritten refuses a batch operation on a lease whose row is not
// written yet (TryReserveTx): only its completion writes it.
func errUnwritten(what string, i int) error {
	return fmt.Errorf("%s: lease %d has no row yet (TryReserveTx): complete it (Complete, CompleteCommit) or roll back", what, i)
}
