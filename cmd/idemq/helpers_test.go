package main_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger/jaegertest"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// binary is the idemq binary under test, built once by TestMain.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idemq-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "idemq")
	args := []string{"build", "-o", binary}
	if raceEnabled {
		args = append(args, "-race")
	}
	build := exec.Command("go", append(args, ".")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "build idemq: %v\n", err)
		os.Exit(1)
	}
	code := m.Run()
	jaegertest.Stop()
	_ = os.RemoveAll(dir)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// env is the environment of the binary: the test services and schema, and
// none of the caller's IDEMQ_* settings.
func env(schema string, extra ...string) []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMQ_") {
			out = append(out, kv)
		}
	}
	out = append(out,
		"IDEMQ_POSTGRES_URL="+testdb.URL(),
		"IDEMQ_AMQP_URL="+testamqp.URL(),
		"IDEMQ_SCHEMA="+schema,
	)
	return append(out, extra...)
}

// result is a finished run of the binary.
type result struct {
	code           int
	stdout, stderr string
	took           time.Duration
}

func (r result) String() string {
	return fmt.Sprintf("exit %d after %s\nstdout:\n%s\nstderr:\n%s", r.code, r.took.Round(time.Millisecond), r.stdout, r.stderr)
}

// idemq runs the binary to completion (at most a minute).
func idemq(t testing.TB, environ []string, args ...string) result {
	t.Helper()
	return idemqWithin(t, time.Minute, environ, args...)
}

// idemqWithin runs the binary to completion, killing it after timeout.
func idemqWithin(t testing.TB, timeout time.Duration, environ []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = environ
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String(), took: time.Since(start)}
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		r.code = exit.ExitCode()
	default:
		t.Fatalf("run idemq %v: %v", args, err)
	}
	return r
}

// mustRun runs the binary and fails the test unless it exits 0.
func mustRun(t testing.TB, environ []string, args ...string) result {
	t.Helper()
	r := idemq(t, environ, args...)
	if r.code != 0 {
		t.Fatalf("idemq %s: %s", strings.Join(args, " "), r)
	}
	return r
}

// syncBuffer is a bytes.Buffer safe for a process writing and a test reading.
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

// proc is a long-running idemq process (forward, relay).
type proc struct {
	name   string
	cmd    *exec.Cmd
	stderr *syncBuffer
	done   chan struct{}
	code   int
}

// start starts the binary in the background; the test's cleanup kills it
// if it still runs.
func start(t testing.TB, name string, environ []string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(binary, args...), stderr: &syncBuffer{}, done: make(chan struct{})}
	p.cmd.Env = environ
	p.cmd.Stdout = p.stderr
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		err := p.cmd.Wait()
		var exit *exec.ExitError
		switch {
		case err == nil:
		case errors.As(err, &exit):
			p.code = exit.ExitCode()
			if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				p.code = -int(ws.Signal())
			}
		default:
			p.code = -1000
		}
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", p.name, p.stderr.String())
		}
	})
	return p
}

// signal sends sig to the process.
func (p *proc) signal(t testing.TB, sig os.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %s: %v", p.name, err)
	}
}

// wait waits at most timeout for the process to exit and returns its code.
func (p *proc) wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %s; output:\n%s", p.name, timeout, p.stderr.String())
		return 0
	}
}

// queueState returns the ready messages and consumers of queue, on a
// throwaway channel (a failed passive declare closes it).
func queueState(t testing.TB, conn *amqp.Connection, queue string) (messages, consumers int) {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("inspect queue %s: %v", queue, err)
	}
	return q.Messages, q.Consumers
}

// drain takes every ready message of queue (acking them).
func drain(t testing.TB, conn *amqp.Connection, queue string) []amqp.Delivery {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatalf("get from %s: %v", queue, err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// newSchema returns a migrated schema of its own for the test.
func newSchema(t testing.TB) string {
	t.Helper()
	pool := testdb.Pool(t, 2)
	schema := testdb.Schema(t, pool)
	mustRun(t, env(schema), "migrate")
	return schema
}

// deleteTopologyAtCleanup deletes the queues of work queue q.
func deleteTopologyAtCleanup(t testing.TB, q string, delays []string, extraQueues, exchanges []string) {
	queues := []string{q, q + ".dlq"}
	for _, d := range delays {
		queues = append(queues, q+".retry."+d)
	}
	testamqp.DeleteQueuesAtCleanup(t, append(queues, extraQueues...), append(exchanges, q+".dlx"))
}
