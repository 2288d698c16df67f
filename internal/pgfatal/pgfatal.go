// Package pgfatal tells a Postgres that refuses for good from one that is
// out of reach. A wrong password, a role or database that does not exist,
// or a schema the role may not use will not mend with retrying: the
// runtimes stop at start with the cause and what to do, as they do when the
// broker refuses its credentials. A Postgres that is down, restarting or
// not yet accepting connections is retried.
package pgfatal

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// What to do about each refusal, by SQLSTATE.
var advice = map[string]string{
	"28P01": "check the password of the Postgres URL",                                             // invalid_password
	"28000": "check the user of the Postgres URL, or create the role (pg_hba.conf may refuse it)", // invalid_authorization_specification
	"3D000": "check the database name of the Postgres URL, or create the database",                // invalid_catalog_name
	"42501": "grant the role USAGE and the table privileges on idemq's schema (docs/security.md)", // insufficient_privilege
}

// Refused reports whether err is a refusal that retrying will not fix (see
// the package doc). It looks through the wrapping of pgx's connect errors.
func Refused(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	_, ok := advice[pgErr.Code]
	return ok
}

// Error is a refusal with what to do about it.
type Error struct {
	Code   string // the SQLSTATE
	Advice string
	err    error
}

func (e *Error) Error() string {
	return fmt.Sprintf("Postgres refuses: %v; %s", e.err, e.Advice)
}

func (e *Error) Unwrap() error { return e.err }

// Explain returns err as an *Error when it is a refusal, else err itself.
func Explain(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	a, ok := advice[pgErr.Code]
	if !ok {
		return err
	}
	return &Error{Code: pgErr.Code, Advice: a, err: pgErr}
}
