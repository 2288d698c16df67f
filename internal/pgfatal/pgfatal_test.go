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
