package main_test

import (
	"strings"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testamqp"
)

// TestMalformedURLsExit2: a connection URL that cannot be parsed is bad
// usage (exit 2), reported in one line that names the flag and never
// echoes the password, for every command that connects.
func TestMalformedURLsExit2(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		env  string
		args []string
		want string
	}{
		{"mysql scheme", "IDEMQ_POSTGRES_URL=mysql://idemq:s3cret@127.0.0.1/db", []string{"migrate"}, "--postgres-url"},
		{"bogus sslmode", "IDEMQ_POSTGRES_URL=postgres://idemq:s3cret@127.0.0.1/db?sslmode=bogus", []string{"gc"}, "sslmode"},
		{"bad sslmode by flag", "", []string{"keys", "inspect", "--consumer", "c", "--postgres-url", "postgres://idemq:s3cret@127.0.0.1/db?sslmode=bogus", "k"}, "sslmode"},
		{"http scheme", "IDEMQ_AMQP_URL=http://idemq:s3cret@127.0.0.1:5672/", []string{"topology", "apply", "--queue", "q"}, "--amqp-url"},
		{"http scheme dlq", "IDEMQ_AMQP_URL=http://idemq:s3cret@127.0.0.1:5672/", []string{"dlq", "list", "--queue", "q"}, "amqp://"},
		{"http scheme publish", "IDEMQ_AMQP_URL=http://idemq:s3cret@127.0.0.1:5672/", []string{"publish", "--queue", "q", "--key", "k", "--body", "b"}, "--amqp-url"},
		{"http scheme forward", "IDEMQ_AMQP_URL=http://idemq:s3cret@127.0.0.1:5672/", []string{"forward", "--queue", "q", "--consumer", "c", "--to-exchange", "x"}, "--amqp-url"},
		{"mysql scheme demo", "IDEMQ_POSTGRES_URL=mysql://idemq:s3cret@127.0.0.1/db", []string{"demo", "--payments", "1"}, "--postgres-url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var extra []string
			if tc.env != "" {
				extra = append(extra, tc.env)
			}
			r := idemq(t, env("idemq", extra...), tc.args...)
			if r.code != 2 {
				t.Fatalf("want exit 2: %s", r)
			}
			if !strings.HasPrefix(r.stderr, "idemq: ") || !strings.Contains(r.stderr, tc.want) {
				t.Errorf("want a one-line message with %q: %s", tc.want, r)
			}
			if strings.Contains(r.stderr+r.stdout, "s3cret") {
				t.Errorf("password leaked: %s", r)
			}
		})
	}
}

// TestReplayRefusesAnUnknownReason: a misspelt reason would replay nothing
// and look like success; it is refused with the list of reasons.
func TestReplayRefusesAnUnknownReason(t *testing.T) {
	t.Parallel()
	r := idemq(t, env("idemq"), "dlq", "replay", "--queue", "q", "--reason", "permanent_eror")
	if r.code != 2 {
		t.Fatalf("want exit 2: %s", r)
	}
	for _, want := range append([]string{`"permanent_eror"`}, consumer.Reasons()...) {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("want %q in the message: %s", want, r)
		}
	}
	if strings.Contains(r.stdout, "replayed") {
		t.Errorf("replayed anyway: %s", r)
	}
}

// TestReplayOfAMissingQueuePrintsOnlyItsError: `dlq replay` on a queue that
// does not exist (or whose DLQ does not) exits 1 with the error and prints
// no count: "replayed 0, skipped 0" would read as a replay that ran.
func TestReplayOfAMissingQueuePrintsOnlyItsError(t *testing.T) {
	t.Parallel()
	schema := newSchema(t) // dlq replay records itself in the store
	q := testamqp.Name(t, "cli-noq")
	deleteTopologyAtCleanup(t, q, []string{"1s", "5s", "25s", "2m5s"}, nil, nil)
	mustRun(t, env(schema), "topology", "apply", "--queue", q)
	for _, queue := range []string{testamqp.Name(t, "cli-no-such-queue"), q + ".dlq"} {
		r := idemq(t, env(schema), "dlq", "replay", "--queue", queue)
		if r.code != 1 || !strings.Contains(r.stderr, "queue does not exist") {
			t.Errorf("--queue %s: want exit 1 and the error: %s", queue, r)
		}
		if r.stdout != "" {
			t.Errorf("--queue %s: a count printed for a replay that did not start: %s", queue, r)
		}
	}
	// A replay that ran prints its count.
	if r := mustRun(t, env(schema), "dlq", "replay", "--queue", q); r.stdout != "replayed 0, skipped 0\n" {
		t.Errorf("dlq replay of an empty DLQ: %s", r)
	}
}

// TestDLQNameGivenForQueueIsHinted: --queue takes the work queue; a DLQ's
// name given instead is pointed out when its own DLQ does not exist.
func TestDLQNameGivenForQueueIsHinted(t *testing.T) {
	t.Parallel()
	schema := newSchema(t) // dlq replay records itself in the store
	q := testamqp.Name(t, "cli-hint")
	deleteTopologyAtCleanup(t, q, []string{"1s", "5s", "25s", "2m5s"}, nil, nil)
	mustRun(t, env(schema), "topology", "apply", "--queue", q)
	for _, cmd := range [][]string{{"dlq", "list"}, {"dlq", "replay"}} {
		r := idemq(t, env(schema), append(cmd, "--queue", q+".dlq")...)
		if r.code != 1 || !strings.Contains(r.stderr, "--queue takes the work queue") || !strings.Contains(r.stderr, "--queue "+q+" ") {
			t.Errorf("%v: want exit 1 and a hint: %s", cmd, r)
		}
	}
	// The work queue's name works.
	if r := mustRun(t, env(schema), "dlq", "list", "--queue", q); !strings.Contains(r.stdout, q+".dlq: 0 dead letters") {
		t.Errorf("dlq list: %s", r)
	}
}

// TestDemoHasNoHiddenAlias: --payments is the demo's one flag for the
// number of payments.
func TestDemoHasNoHiddenAlias(t *testing.T) {
	t.Parallel()
	r := idemq(t, env("idemq"), "demo", "--messages", "5")
	if r.code != 2 || !strings.Contains(r.stderr, "unknown flag: --messages") {
		t.Fatalf("want exit 2, unknown flag: %s", r)
	}
	r = mustRun(t, env("idemq"), "demo", "--help")
	if !strings.Contains(r.stdout, "--payments") || strings.Contains(r.stdout, "--messages") {
		t.Errorf("help: %s", r.stdout)
	}
}
