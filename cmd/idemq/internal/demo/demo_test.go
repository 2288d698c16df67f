package demo_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/cmd/idemq/internal/demo"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// TestMain doubles as the workers' main: demo.Run re-executes this test
// binary with the same arguments and IDEMQ_DEMO_WORKER set.
func TestMain(m *testing.M) {
	// A tracer that records nothing but makes real trace ids, so that the
	// report's duplicate trace can be checked.
	tp := sdktrace.NewTracerProvider()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	if demo.IsWorker() {
		_, err := demo.Run(context.Background(), demo.Options{}, os.Stdout)
		_ = tp.Shutdown(context.Background())
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func TestDemo(t *testing.T) {
	t.Parallel()
	suffix := testdb.RandomHex(4)
	schema, queue := "idemq_demo_t_"+suffix, "idemq.demo.t."+suffix
	cleanup(t, schema, queue)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := demo.Run(ctx, demo.Options{
		PostgresURL:  testdb.URL(),
		AMQPURL:      testamqp.URL(),
		Schema:       schema,
		Queue:        queue,
		Payments:     300,
		HTTPPayments: 100,
		Workers:      2,
		Concurrency:  4,
		Seed:         7,
		JaegerURL:    "http://jaeger.example:16686",
		Timeout:      2 * time.Minute,
		LogDir:       t.TempDir(),
	}, &out)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatalf("demo: %v", err)
	}

	// The progress ends on the final count, also when the killed worker
	// took the events of messages it settled with it.
	if lines := regexp.MustCompile(`(?m)^.*\] settled (\d+)/(\d+) .*$`).FindAllStringSubmatch(out.String(), -1); len(lines) == 0 {
		t.Errorf("no progress line")
	} else if last := lines[len(lines)-1]; last[1] != last[2] || last[2] != strconv.Itoa(rep.Published) {
		t.Errorf("the progress ends on %s/%s settled, want %d/%d: %s", last[1], last[2], rep.Published, rep.Published, last[0])
	}
	if !rep.OK() || !strings.Contains(out.String(), "\nOK: effects applied == unique keys processed, 0 doubled, 0 lost; HTTP: charges == unique operations (100), 0 doubled\n") {
		t.Fatalf("not OK: %v", rep.Failures)
	}
	if rep.Effects != rep.Processed || rep.DoubledKeys != 0 || rep.LostKeys != 0 || rep.InProgress != 0 || rep.Unsettled != 0 {
		t.Errorf("invariant: effects %d, processed %d, doubled %d, lost %d, in progress %d, unsettled %d",
			rep.Effects, rep.Processed, rep.DoubledKeys, rep.LostKeys, rep.InProgress, rep.Unsettled)
	}
	if got := rep.Processed + rep.Rejected + rep.DeadLetteredKeys; got != rep.UniqueKeys || rep.UniqueKeys != 300 {
		t.Errorf("unique keys %d, want 300 = processed %d + rejected %d + dead-lettered %d",
			rep.UniqueKeys, rep.Processed, rep.Rejected, rep.DeadLetteredKeys)
	}
	if rep.WorkerKills != 1 {
		t.Errorf("worker kills %d, want 1", rep.WorkerKills)
	}
	if rep.DuplicatesPublished == 0 || rep.DuplicatesSuppressed == 0 || rep.Retries == 0 || rep.Rejected == 0 {
		t.Errorf("scenario too tame: %d duplicates published, %d suppressed, %d retries, %d rejected",
			rep.DuplicatesPublished, rep.DuplicatesSuppressed, rep.Retries, rep.Rejected)
	}
	for _, reason := range []string{consumer.ReasonPermanentError, consumer.ReasonKeyReuse, consumer.ReasonKeyRequired,
		consumer.ReasonKeyInvalid, consumer.ReasonMaxAttemptsExceeded} {
		if rep.DeadLetters[reason] == 0 || rep.DeadLetters[reason] < rep.ExpectedDeadLetters[reason] {
			t.Errorf("dead letters %s: %d, want %d", reason, rep.DeadLetters[reason], rep.ExpectedDeadLetters[reason])
		}
	}

	// The HTTP part: clients that time out and retry, one charge per operation.
	if h := rep.HTTP; h == nil || h.Charges != 100 || h.ChargedKeys != 100 || h.DoubledKeys != 0 || h.Published != 100 ||
		h.Conflicts == 0 || h.Replayed == 0 || h.Timeouts == 0 || h.Lost == 0 || h.Attempts <= h.Operations {
		t.Errorf("HTTP part: %+v", h)
	}

	// The duplicate's trace and the original's, as the key row stored it.
	if rep.DuplicateTraceID == "" || rep.OriginalTraceID == "" || rep.DuplicateTraceID == rep.OriginalTraceID {
		t.Fatalf("duplicate trace %q, original %q", rep.DuplicateTraceID, rep.OriginalTraceID)
	}
	if want := "http://jaeger.example:16686/trace/" + rep.DuplicateTraceID; !strings.Contains(rep.TraceLink, want) {
		t.Errorf("trace link %q lacks %q", rep.TraceLink, want)
	}
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM "+schema+".keys WHERE trace_id = $1 AND state = 'completed'", rep.OriginalTraceID).Scan(&n); err != nil || n != 1 {
		t.Errorf("keys first processed in trace %s: %d (%v), want 1", rep.OriginalTraceID, n, err)
	}
}

// TestRerunIsClean runs a tiny scenario twice on the same schema and queue:
// the second run starts from scratch (reset), so its report is the same.
func TestRerunIsClean(t *testing.T) {
	t.Parallel()
	suffix := testdb.RandomHex(4)
	schema, queue := "idemq_demo_t_"+suffix, "idemq.demo.t."+suffix
	cleanup(t, schema, queue)
	opts := demo.Options{
		PostgresURL: testdb.URL(), AMQPURL: testamqp.URL(), Schema: schema, Queue: queue,
		Payments: 40, HTTPPayments: -1, Workers: 1, Concurrency: 2, KillAt: -1, Seed: 3, Timeout: time.Minute, LogDir: t.TempDir(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var reps []demo.Report
	for i := range 2 {
		var out bytes.Buffer
		rep, err := demo.Run(ctx, opts, &out)
		if err != nil {
			t.Fatalf("run %d: %v\n%s", i+1, err, out.String())
		}
		reps = append(reps, rep)
	}
	a, b := reps[0], reps[1]
	if a.Published != b.Published || a.UniqueKeys != b.UniqueKeys || a.Processed != b.Processed ||
		a.Effects != b.Effects || a.Rejected != b.Rejected || b.WorkerKills != 0 {
		t.Errorf("second run differs: %+v\nvs %+v", a, b)
	}
}

func TestUnreachable(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out bytes.Buffer
	_, err := demo.Run(ctx, demo.Options{
		PostgresURL: "postgres://postgres:secret@127.0.0.1:1/postgres?sslmode=disable",
		Schema:      "idemq_demo_unreachable",
		ConnectWait: time.Second,
	}, &out)
	if err == nil || !strings.Contains(err.Error(), "make up") || !strings.Contains(err.Error(), "postgres") {
		t.Fatalf("err = %v, want a hint to run `make up`", err)
	}
	if strings.Contains(err.Error(), "secret") {
		t.Errorf("err leaks the password: %v", err)
	}
}

func TestRefusesForeignSchema(t *testing.T) {
	t.Parallel()
	_, err := demo.Run(context.Background(), demo.Options{Schema: schema.Default}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "must contain \"demo\"") {
		t.Fatalf("err = %v, want a refusal to reset schema %q", err, schema.Default)
	}
}

// cleanup drops the test's schema and queues when it ends (the tiers of
// the demo's retry policy: 200ms ×2, 4 attempts).
func cleanup(t *testing.T, schema, queue string) {
	topo := consumer.NewTopology(consumer.TopologyConfig{Queue: queue, RetryInitial: 200 * time.Millisecond, RetryMultiplier: 2, MaxAttempts: 4})
	queues := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		queues = append(queues, topo.TierName(d))
	}
	testamqp.DeleteQueuesAtCleanup(t, queues, []string{topo.DLX})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, testdb.URL())
		if err != nil {
			t.Logf("drop schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Logf("drop schema %s: %v", schema, err)
		}
	})
}
