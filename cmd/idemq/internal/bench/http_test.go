package bench

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// The HTTP front door runs its rows briefly against the real services and
// wrk: every row is there with a throughput, latencies and CPU, the rows
// with repeated keys got replays or 409s, the effects match the fresh
// answers (no note), the paced phase ran, and no other table did.
func TestHTTPRows(t *testing.T) {
	if _, err := findWrk(); err != nil {
		t.Fatalf("the HTTP rows need wrk: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rs, err := Run(ctx, Options{PostgresURL: testdb.URL(), AMQPURL: testamqp.URL(), Only: "http|gateway", HTTPDuration: time.Second}, &out)
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	var names []string
	for _, sc := range httpScenarios() {
		names = append(names, sc.name)
	}
	if len(rs) != len(names) {
		t.Fatalf("%d rows, want the %d of the HTTP table:\n%s", len(rs), len(names), out.String())
	}
	for i, r := range rs {
		if r.Section != SectionHTTP || r.Scenario != names[i] {
			t.Errorf("row %d: %s %q, want %s %q", i, r.Section, r.Scenario, SectionHTTP, names[i])
		}
		if r.Rate <= 0 || r.Settled <= 0 || r.Ratio <= 0 || r.P50 <= 0 || r.P99 < r.P50 || r.CPUPerMsg <= 0 {
			t.Errorf("%s: not sane: %+v", r.Scenario, r)
		}
		if r.Note != "" {
			t.Errorf("%s: note: %s", r.Scenario, r.Note)
		}
		if dup := strings.HasSuffix(r.Scenario, "20% dup"); dup != (r.Replayed+r.Conflicts > 0) {
			t.Errorf("%s: %d replayed, %d 409s", r.Scenario, r.Replayed, r.Conflicts)
		}
		if r.Failed > 0 {
			t.Errorf("%s: %d failed requests", r.Scenario, r.Failed)
		}
	}
	for _, want := range []string{"HTTP front door  req/s  vs bare", "paced, open loop: http idemhttp: the same handler, guarded at ", "paced, open loop: http bare: POST, one INSERT in one tx at ", "targets: guarded ≥ 70% of bare: "} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in the output:\n%s", want, out.String())
		}
	}
	for _, other := range []string{"scenario  msg/s", "publishing side  msg/s"} {
		if strings.Contains(out.String(), other) {
			t.Errorf("another table (%q) ran:\n%s", other, out.String())
		}
	}
	t.Log(out.String())
}

// Without wrk the HTTP rows say so, and the run goes on.
func TestHTTPRowsWithoutWrk(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	var out bytes.Buffer
	rs, err := Run(context.Background(), Options{PostgresURL: testdb.URL(), AMQPURL: testamqp.URL(), Only: "http|gateway", HTTPDuration: time.Second}, &out)
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, out.String())
	}
	if len(rs) != len(httpScenarios()) {
		t.Fatalf("%d rows:\n%s", len(rs), out.String())
	}
	for _, r := range rs {
		if r.Rate != 0 || !strings.Contains(r.Note, "wrk is not installed") {
			t.Errorf("%s: %+v", r.Scenario, r)
		}
	}
	if !strings.Contains(out.String(), "note: http bare: POST, one INSERT in one tx: not run: wrk is not installed (Debian: apt-get install -y wrk)") {
		t.Errorf("the table does not say why:\n%s", out.String())
	}
}
