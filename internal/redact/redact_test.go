package redact_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/redact"
)

func TestRedact(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"amqp://guest:s3cret@127.0.0.1:5672/",
		"amqps://user:s3cret@broker:5671/vhost?heartbeat=10",
		"postgres://app:s3cret@db:5432/idemq?sslmode=verify-full",
		"dial postgres://app:s3cret@db/x: connection refused",
		"amqp://guest:s3cret@node1:5672/,amqp://guest:s3cret@node2:5672/",
		"postgres://app:s3cret@db1:5432,db2:5432/idemq?target_session_attrs=read-write",
		"amqp://guest:guest@node1:5672/,amqps://user:s3cret@node2:5671/vhost",
	} {
		for _, got := range []string{redact.URL(in), redact.String(in), redact.Error(errors.New(in))} {
			if strings.Contains(got, "s3cret") {
				t.Fatalf("secret left in %q → %q", in, got)
			}
		}
	}
	if got := redact.URL("postgres://postgres@127.0.0.1:5432/test"); strings.Contains(got, "postgres@") {
		t.Fatalf("user left in %q", got)
	}
}

func TestDSN(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://app:secret@db:5432/app":          "postgres://xxxxx@db:5432/app",
		"host=db user=app password=secret dbname=x":  "host=db user=app password=xxxxx dbname=x",
		"host=db password='s e c r e t' dbname=x":    "host=db password=xxxxx dbname=x",
		"postgres://postgres@127.0.0.1:5432/db":      "postgres://xxxxx@127.0.0.1:5432/db",
		"postgres://127.0.0.1:5432/db?sslmode=false": "postgres://127.0.0.1:5432/db?sslmode=false",
	} {
		if got := redact.DSN(in); got != want {
			t.Errorf("DSN(%q) = %q, want %q", in, got, want)
		}
	}
}
