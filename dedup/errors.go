package dedup

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/dedup/schema"
)

// Sentinel errors. Test them with errors.Is, never by their text. Each reads
// as a clause saying what is wrong; the functions that return them wrap them
// with what was being done ("complete key: the key's lease was taken over or
// released").
var (
	// ErrLeaseLost means the caller's lease token no longer matches the key's
	// row: the lease expired and another worker took the key over, or it was
	// released. Whatever the caller wrote in the same transaction must roll back.
	ErrLeaseLost = errors.New("the key's lease was taken over or released")

	// ErrNotFound means no row exists for the key.
	ErrNotFound = errors.New("the key is not in the store")

	// ErrKeyRequired means the message carries no idempotency key.
	// The consumer dead-letters it with reason idempotency_key_required.
	ErrKeyRequired = errors.New("the idempotency key is missing")

	// ErrKeyInvalid means the key is longer than MaxKeyLen bytes, is not
	// valid UTF-8, or contains control characters. The consumer
	// dead-letters it with reason idempotency_key_invalid.
	ErrKeyInvalid = errors.New("the idempotency key is invalid")

	// ErrDuplicate is what Reservation.Err returns for a key already completed.
	ErrDuplicate = errors.New("the key is already completed")

	// ErrBusy is what Reservation.Err returns while another worker holds a valid lease.
	ErrBusy = errors.New("the key is in progress under another lease")

	// ErrKeyReuse is what Reservation.Err returns when the key was first used
	// for an operation with another fingerprint. The consumer dead-letters
	// it with reason idempotency_key_reuse.
	ErrKeyReuse = errors.New("the key was first used with another fingerprint")

	// ErrNotMigrated means a table this build needs does not exist, or the
	// schema lacks migrations this build needs: run schema.Migrate (or
	// `idemq migrate`). It is schema.ErrNotMigrated.
	ErrNotMigrated = schema.ErrNotMigrated

	// ErrFingerprint means the significant content could not be read (for
	// example, a field fingerprint over a body that is not a JSON object).
	ErrFingerprint = errors.New("the fingerprint cannot be computed")
)

// interpretError maps driver errors to the package's sentinels. It is the one
// place where pgx errors are translated.
func interpretError(op string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%s: %w", op, ErrNotFound)
	}
	// undefined_table, invalid_schema_name
	if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "3F000") {
		return fmt.Errorf("%s: %w: %w", op, ErrNotMigrated, err)
	}
	return fmt.Errorf("%s: %w", op, err)
}
