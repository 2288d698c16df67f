package consumer_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// TestMain doubles as a worker process for TestWorkerKilledMidHandler, and
// fails the package if a test leaves a goroutine running.
func TestMain(m *testing.M) {
	if os.Getenv("IDEMQ_TEST_WORKER_QUEUE") != "" {
		os.Exit(runBlockingWorker())
	}
	goleak.VerifyTestMain(m)
}

// runBlockingWorker consumes IDEMQ_TEST_WORKER_QUEUE; its handler writes the
// effect, says so on stdout and blocks until the process is killed.
func runBlockingWorker() int {
	ctx := context.Background()
	schema := os.Getenv("IDEMQ_TEST_WORKER_SCHEMA")
	pool, err := pgxPool(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: schema})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	c, err := consumer.New(store, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		if _, err := tx.Exec(ctx, "INSERT INTO "+schema+".ledger (key, attempt) VALUES ($1, -1)", d.Key); err != nil {
			return consumer.Response{}, err
		}
		fmt.Println("IN-HANDLER")
		select {} // until SIGKILL
	}, &consumer.Config{
		URL: testamqp.URL(), Queue: os.Getenv("IDEMQ_TEST_WORKER_QUEUE"), Name: "payments",
		Lease: 2 * time.Second, RetryInitial: 200 * time.Millisecond, RetryMultiplier: 2, MaxAttempts: 3, Concurrency: 1,
		SeparateReservations: os.Getenv("IDEMQ_TEST_WORKER_SEPARATE") == "1",
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	if err := c.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	return 0
}

func TestWorkerKilledMidHandler(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) { c.Lease = 2 * time.Second })
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		separate := "0"
		if m.Separate() {
			separate = "1"
		}
		cmd.Env = append(os.Environ(), "IDEMQ_TEST_WORKER_QUEUE="+h.cfg.Queue, "IDEMQ_TEST_WORKER_SCHEMA="+h.schema, "IDEMQ_TEST_WORKER_SEPARATE="+separate)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		inHandler := make(chan struct{})
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if strings.Contains(sc.Text(), "IN-HANDLER") {
					close(inHandler)
					return
				}
			}
		}()
		h.publish("killed-1", `{"amount":5}`, nil)
		select {
		case <-inHandler:
		case <-time.After(30 * time.Second):
			t.Fatal("worker never entered its handler")
		}
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()

		// Another worker gets the redelivery and waits out the dead lease,
		// then takes the key over; a held reservation died with its
		// worker's session, and the key is new again.
		h.start(1, h.ledgerEffect)
		h.waitEvents(30*time.Second, "processing after takeover", func(evs []consumer.Event) bool {
			return countOutcomes(evs)[consumer.OutcomeProcessed] == 1
		})
		if eff := h.effects(); eff["killed-1"] != 1 {
			t.Fatalf("effects %v, want exactly one", eff)
		}
		rec, err := h.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments", Key: "killed-1"})
		wantAttempts := 1
		if m.Separate() {
			wantAttempts = 2
		}
		if err != nil || rec.Attempts != wantAttempts || rec.State != dedup.StateCompleted {
			t.Fatalf("key %+v %v; want completed on reservation %d", rec, err, wantAttempts)
		}
	})
}

// publishMany publishes n messages, key i%unique, with confirms in batches.
func (h *harness) publishMany(n, unique int, prefix string) {
	h.t.Helper()
	ctx := context.Background()
	var pending []*amqp.DeferredConfirmation
	flush := func() {
		for _, c := range pending {
			if ok, err := c.WaitContext(ctx); !ok || err != nil {
				h.t.Fatalf("publish not confirmed: %v", err)
			}
		}
		pending = pending[:0]
	}
	for i := range n {
		key := keyOf(i%unique, prefix)
		c, err := h.pub.PublishWithDeferredConfirmWithContext(ctx, "", h.cfg.Queue, false, false,
			amqp.Publishing{MessageId: key, Body: []byte(`{"amount":` + fmt.Sprint(i%unique) + `}`), DeliveryMode: amqp.Persistent})
		if err != nil {
			h.t.Fatal(err)
		}
		pending = append(pending, c)
		if len(pending) == 500 {
			flush()
		}
	}
	flush()
}

// waitAllApplied waits until every one of the unique keys has an effect and
// the queues are empty, then checks that no key has more than one.
func (h *harness) waitAllApplied(unique int, prefix string, timeout time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		eff := h.effects()
		if len(eff) == unique && h.queuesEmpty() {
			for k, n := range eff {
				if n != 1 || !strings.HasPrefix(k, prefix) {
					h.t.Fatalf("key %s has %d effects", k, n)
				}
			}
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("after %s: %d of %d keys applied", timeout, len(eff), unique)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (h *harness) queuesEmpty() bool {
	ch, err := h.conn.Channel()
	if err != nil {
		h.t.Fatal(err)
	}
	defer ch.Close()
	topo := consumer.NewTopology(h.cfg.TopologyConfig())
	names := []string{topo.Queue, topo.DLQ}
	for _, d := range topo.Delays {
		names = append(names, topo.TierName(d))
	}
	for _, name := range names {
		q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		if err != nil {
			h.t.Fatal(err)
		}
		if q.Messages > 0 {
			return false
		}
	}
	return true
}

func TestConnectionClosedUnderLoad(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		const total, unique = 5000, 4000 // 20% duplicates
		h := newHarness(t, m, func(c *consumer.Config) { c.Concurrency = 8; c.RetryInitial = 100 * time.Millisecond })
		h.publishMany(total, unique, "load")
		h.start(2, h.ledgerEffect)
		for _, at := range []int{800, 2500} {
			h.waitEvents(60*time.Second, fmt.Sprintf("%d deliveries", at), func(evs []consumer.Event) bool { return finals(evs) >= at })
			if n := testamqp.CloseConnections(t, h.cfg.ConnectionName); n == 0 {
				t.Fatal("no consumer connection found to close")
			}
		}
		h.waitAllApplied(unique, "load", 120*time.Second)
		var inProgress int
		if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+h.schema+".keys WHERE state = 'in_progress'").Scan(&inProgress); err != nil {
			t.Fatal(err)
		}
		if inProgress != 0 {
			t.Fatalf("%d keys left in progress", inProgress)
		}
	})
}

func TestGracefulShutdownUnderLoad(t *testing.T) {
	forEachMode(t, func(t *testing.T, m mode) {
		const total = 3000
		h := newHarness(t, m, func(c *consumer.Config) { c.Concurrency = 8 })
		h.publishMany(total, total, "drain")
		slow := func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			time.Sleep(2 * time.Millisecond) // a handler that takes a moment
			return h.ledgerEffect(ctx, tx, d)
		}
		stop := h.start(2, slow)
		h.waitEvents(60*time.Second, "some deliveries", func(evs []consumer.Event) bool { return finals(evs) >= 100 })
		stop() // returns once Run has drained and closed
		var inProgress int
		if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+h.schema+".keys WHERE state = 'in_progress'").Scan(&inProgress); err != nil {
			t.Fatal(err)
		}
		if inProgress != 0 {
			t.Fatalf("graceful stop left %d keys in progress", inProgress)
		}
		if n := len(h.effects()); n >= total {
			t.Fatalf("all %d processed before the stop; the test stopped nothing", n)
		}
		h.start(1, slow)
		h.waitAllApplied(total, "drain", 120*time.Second)
	})
}

func pgxPool(ctx context.Context) (*pgxPoolT, error) { return pgxNew(ctx, testdb.URL()) }
