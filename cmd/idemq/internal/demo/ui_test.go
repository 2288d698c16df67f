package demo_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/demo"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// With UIListen the demo leaves the UI running on its data until ctx ends.
func TestDemoLeavesTheUIRunning(t *testing.T) {
	t.Parallel()
	suffix := testdb.RandomHex(4)
	schema, queue := "idemq_demo_t_"+suffix, "idemq.demo.t."+suffix
	cleanup(t, schema, queue)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out syncBuffer
	done := make(chan error, 1)
	go func() {
		_, err := demo.Run(ctx, demo.Options{
			PostgresURL: testdb.URL(), AMQPURL: testamqp.URL(), Schema: schema, Queue: queue,
			Payments: 40, Workers: 1, Concurrency: 2, KillAt: -1, Seed: 5, Timeout: time.Minute,
			LogDir: t.TempDir(), UIListen: "127.0.0.1:0",
		}, &out)
		done <- err
	}()
	serving := regexp.MustCompile(`idemq ui: serving (http://\S+/)`)
	var base string
	for base == "" {
		if m := serving.FindStringSubmatch(out.String()); m != nil {
			base = m[1]
			break
		}
		select {
		case err := <-done:
			t.Fatalf("demo ended before serving the UI: %v\n%s", err, out.String())
		case <-ctx.Done():
			t.Fatalf("the UI did not start:\n%s", out.String())
		case <-time.After(50 * time.Millisecond): // poll interval
		}
	}
	resp, err := http.Get(base)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`href="/keys?consumer=payments"`, queue + ".dlq", "permanent_error"} {
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
			t.Fatalf("overview (%d) lacks %q:\n%s", resp.StatusCode, want, body)
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("demo after the UI: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the demo did not stop with its context")
	}
}
