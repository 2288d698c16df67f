package pgfatal

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestRefused(t *testing.T) {
	for code, want := range map[string]bool{"28P01": true, "28000": true, "3D000": true, "42501": true, "57P03": false, "53300": false} {
		err := fmt.Errorf("connect: %w", &pgconn.PgError{Severity: "FATAL", Code: code, Message: "m"})
		if got := Refused(err); got != want {
			t.Errorf("Refused(%s) = %v, want %v", code, got, want)
		}
		var e *Error
		if got := errors.As(Explain(err), &e); got != want {
			t.Errorf("Explain(%s) is an *Error: %v, want %v", code, got, want)
		}
		if want && (!strings.Contains(e.Error(), "Postgres refuses") || e.Advice == "" || !errors.Is(e, err.(interface{ Unwrap() error }).Unwrap())) {
			t.Errorf("Explain(%s) = %v", code, e)
		}
	}
	for _, err := range []error{nil, context.DeadlineExceeded, errors.New("dial tcp: connection refused")} {
		if Refused(err) || Explain(err) != err {
			t.Errorf("%v taken for a refusal", err)
		}
	}
}

// PgBouncer reports a refusal as 08P01 with the message: the server's, passed
// on, or its own. Its other 08P01 errors (no server to reach) are retried.
func TestRefusedThroughPgBouncer(t *testing.T) {
	for msg, want := range map[string]string{
		`database "nope" does not exist`:                                      "3D000",
		`no such database: nope`:                                              "3D000",
		`role "nobody" does not exist`:                                        "28000",
		`no such user: nobody`:                                                "28000",
		`"trust" authentication failed`:                                       "28P01",
		`password authentication failed for user "me"`:                        "28P01",
		`pgbouncer cannot connect to server`:                                  "",
		`server login has been failing, try again later (server_login_retry)`: "",
	} {
		err := fmt.Errorf("connect: %w", &pgconn.PgError{Severity: "FATAL", Code: "08P01", Message: msg})
		var e *Error
		refused := errors.As(Explain(err), &e)
		if Refused(err) != (want != "") || refused != (want != "") {
			t.Errorf("%q: refused %v, want %v", msg, refused, want != "")
			continue
		}
		if refused && e.Code != want {
			t.Errorf("%q: code %s, want %s", msg, e.Code, want)
		}
	}
}
