package dedup

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/dedup/schema"
)

// Sentinel errors. Test them with errors.Is.
var (
	// ErrLeaseLost means the caller's lease token no longer matches the key's
	// row: the lease expired and another worker took the key over, or it was
	// released. Whatever the caller wrote in the same transaction must roll back.
	ErrLeaseLost = errors.New("lease lost")

	// ErrNotFound means no row exists for the key.
	ErrNotFound = errors.New("key not found")

	// ErrKeyRequired means the message carries no idempotency key.
	// Its reason word, for dead letters, is ReasonKeyRequired.
	ErrKeyRequired = errors.New(ReasonKeyRequired)

	// ErrKeyInvalid means the key is longer than MaxKeyLen bytes, is not
	// valid UTF-8, or contains control characters. Its reason word is ReasonKeyInvalid.
	ErrKeyInvalid = errors.New(ReasonKeyInvalid)

	// ErrDuplicate is what Reservation.Err returns for a key already completed.
	ErrDuplicate = errors.New("duplicate: key already completed")

	// ErrBusy is what Reservation.Err returns while another worker holds a valid lease.
	ErrBusy = errors.New("busy: key is in progress under another lease")

	// ErrKeyReuse is what Reservation.Err returns when the key was first used
	// for an operation with another fingerprint.
	ErrKeyReuse = errors.New(ReasonKeyReuse)

	// ErrNotMigrated means a table this build needs does not exist, or the
	// schema lacks migrations this build needs: run schema.Migrate (or
	// `idemq migrate`). It is schema.ErrNotMigrated.
	ErrNotMigrated = schema.ErrNotMigrated

	// ErrFingerprint means the significant content could not be read (for
	// example, a field fingerprint over a body that is not a JSON object).
	ErrFingerprint = errors.New("fingerprint")
)

// Reason words: the values of the x-idemq-reason header on dead letters.
const (
	ReasonKeyRequired = "idempotency_key_required"
	ReasonKeyInvalid  = "idempotency_key_invalid"
	ReasonKeyReuse    = "idempotency_key_reuse"
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
