// Package pgfatal tells a Postgres that refuses for good from one that is
// out of reach. A wrong password, a role or database that does not exist,
// or a schema the role may not use will not mend with retrying: the
// runtimes stop at start with the cause and what to do, as they do when the
// broker refuses its credentials. A Postgres that is down, restarting or
// not yet accepting connections is retried.
//
// Through PgBouncer the same refusals come as SQLSTATE 08P01
// (protocol_violation) with the server's or PgBouncer's own message; they
// are told by that message (see pooled), and PgBouncer's other errors, such
// as a server it cannot reach, are retried.
package pgfatal

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5/pgconn"
)

// What to do about each refusal, by SQLSTATE.
var advice = map[string]string{
	"28P01": "check the password of the Postgres URL",                                             // invalid_password
	"28000": "check the user of the Postgres URL, or create the role (pg_hba.conf may refuse it)", // invalid_authorization_specification
	"3D000": "check the database name of the Postgres URL, or create the database",                // invalid_catalog_name
	"42501": "grant the role USAGE and the table privileges on idemq's schema (docs/security.md)", // insufficient_privilege
}

// pooled are the refusals a pooler (PgBouncer) reports as 08P01, by their
// message, and the SQLSTATE Postgres gives each: its own login errors,
// passed on, and PgBouncer's for a database or user it does not know.
var pooled = []struct {
	message *regexp.Regexp
	code    string
}{
	{regexp.MustCompile(`^database ".*" does not exist$|^no such database`), "3D000"},
	{regexp.MustCompile(`^role ".*" does not exist$|^no such user`), "28000"},
	{regexp.MustCompile(`authentication failed`), "28P01"},
}

// code is err's SQLSTATE, a pooler's refusal given the code Postgres
// uses for it, and whether err is a Postgres error at all.
func code(err error) (*pgconn.PgError, string, bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return nil, "", false
	}
	if pgErr.Code == "08P01" {
		for _, p := range pooled {
			if p.message.MatchString(pgErr.Message) {
				return pgErr, p.code, true
			}
		}
	}
	return pgErr, pgErr.Code, true
}

// Refused reports whether err is a refusal that retrying will not fix (see
// the package doc). It looks through the wrapping of pgx's connect errors.
func Refused(err error) bool {
	_, c, ok := code(err)
	if !ok {
		return false
	}
	_, ok = advice[c]
	return ok
}

// Error is a refusal with what to do about it.
type Error struct {
	Code   string // the SQLSTATE (Postgres's, also when a pooler sent 08P01)
	Advice string
	err    error
}

func (e *Error) Error() string {
	return fmt.Sprintf("Postgres refuses: %v; %s", e.err, e.Advice)
}

func (e *Error) Unwrap() error { return e.err }

// Explain returns err as an *Error when it is a refusal, else err itself.
func Explain(err error) error {
	pgErr, c, ok := code(err)
	if !ok {
		return err
	}
	a, ok := advice[c]
	if !ok {
		return err
	}
	return &Error{Code: c, Advice: a, err: pgErr}
}
