package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"golang.org/x/sync/errgroup"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/claim"
	"github.com/idemq/idemq/internal/fieldtable"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/outbox"
)

// enqueueRows commits n rows to the env's queue in transactions of perTx,
// from writers goroutines, and returns their message ids. With rollbackEvery
// > 0, every rollbackEvery-th transaction of a writer is rolled back instead
// (its rows are extra, not counted in n), and its ids are returned apart.
func (e *env) enqueueRows(t testing.TB, n, writers, perTx, rollbackEvery int) (committed, rolledBack []string) {
	t.Helper()
	var mu sync.Mutex
	var g errgroup.Group
	for w := range writers {
		share := n / writers
		if w < n%writers {
			share++
		}
		g.Go(func() error {
			ctx := context.Background()
			for txn := 0; share > 0; txn++ {
				rollback := rollbackEvery > 0 && txn%rollbackEvery == rollbackEvery-1
				size := min(perTx, share)
				c := dedup.Scope{Consumer: "writer", Tenant: strconv.Itoa(w), Key: fmt.Sprintf("tx-%d", txn)}
				cctx := claim.With(ctx, c)
				msgs := make([]outbox.Message, size)
				ids := make([]string, size)
				for i := range msgs {
					msgs[i] = outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, Body: []byte(strconv.Itoa(i))}
					ids[i] = outbox.MessageID(c, "", int64(i+1))
				}
				tx, err := e.pool.Begin(ctx)
				if err != nil {
					return err
				}
				if txn%2 == 0 {
					err = e.ob.EnqueueBatch(cctx, tx, msgs)
				} else {
					for _, m := range msgs {
						if err = e.ob.Enqueue(cctx, tx, m); err != nil {
							break
						}
					}
				}
				if err != nil {
					_ = tx.Rollback(ctx)
					return err
				}
				mu.Lock()
				if rollback {
					err = tx.Rollback(ctx)
					rolledBack = append(rolledBack, ids...)
				} else {
					err = tx.Commit(ctx)
					committed = append(committed, ids...)
					share -= size
				}
				mu.Unlock()
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	return committed, rolledBack
}

// Many concurrent writers, some rolling back, and three relays: every
// committed row reaches the queue exactly once, no rolled back one does.
func TestRelayConcurrentWritersAndRelays(t *testing.T) {
	t.Parallel()
	const n = 10000
	e := newEnv(t, 32)
	relays := make([]*outbox.Relay, 3)
	for i := range relays {
		cfg := e.relayConfig(t)
		cfg.BatchSize = 200
		relays[i] = e.startRelay(t, cfg)
	}
	start := time.Now()
	committed, rolledBack := e.enqueueRows(t, n, 20, 10, 4)
	if len(committed) != n || len(rolledBack) == 0 {
		t.Fatalf("committed %d rows, rolled back %d", len(committed), len(rolledBack))
	}
	waitFor(t, 60*time.Second, "every row published", func() bool { return e.backlog(t).Pending == 0 })
	t.Logf("%d rows published by 3 relays in %s", n, time.Since(start).Round(time.Millisecond))
	// Each committed row moved once into the record of published messages,
	// with where it went and its one attempt; the outbox table is empty.
	var left int
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+e.schema+".outbox").Scan(&left); err != nil || left != 0 {
		t.Fatalf("outbox rows left = %d (%v), want 0", left, err)
	}
	rs, err := e.pool.Query(context.Background(), "SELECT message_id FROM "+e.schema+".outbox_published WHERE exchange = $1 AND routing_key = $2 AND attempts = 1 AND published_at >= created_at", e.exchange, boundKey)
	if err != nil {
		t.Fatal(err)
	}
	recorded, err := pgx.CollectRows(rs, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(recorded)
	want := slices.Sorted(slices.Values(committed))
	if !slices.Equal(recorded, want) {
		t.Fatalf("published records: %d, want the %d committed message ids, each once", len(recorded), len(want))
	}
	// Confirms come after the queue has the message: the depth is exact.
	if depth := e.queueDepth(t); depth != n {
		t.Fatalf("queue holds %d messages, want %d (no crash, so no duplicate)", depth, n)
	}
	ids, _ := e.consumeAll(t, n, 60*time.Second)
	for _, id := range committed {
		if ids[id] != 1 {
			t.Fatalf("message %s received %d times, want 1", id, ids[id])
		}
	}
	for _, id := range rolledBack {
		if ids[id] != 0 {
			t.Fatalf("rolled back message %s was published", id)
		}
	}
	var total int64
	for _, r := range relays {
		s, err := r.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		total += s.Published
	}
	if total != n {
		t.Fatalf("relays count %d published, want %d", total, n)
	}
}

// The broker closes the relay's connection, twice, while rows flow: nothing
// is lost, and the relay reconnects and goes on.
func TestRelayBrokerConnectionClosed(t *testing.T) {
	t.Parallel()
	const n = 3000
	e := newEnv(t, 8)
	cfg := e.relayConfig(t)
	cfg.BatchSize = 50
	cfg.ReconnectInitial = 50 * time.Millisecond
	r := e.startRelay(t, cfg)
	c := e.collect(t)

	done := make(chan []string, 1)
	go func() {
		ids, _ := e.enqueueRows(t, n, 4, 25, 0)
		done <- ids
	}()
	for _, after := range []int{300, 1200} {
		waitFor(t, 30*time.Second, fmt.Sprintf("%d messages", after), func() bool {
			_, total := c.counts()
			return total >= after
		})
		waitFor(t, 30*time.Second, "the relay's connection to close", func() bool {
			return testamqp.CloseConnections(t, cfg.ConnectionName) > 0
		})
	}
	committed := <-done
	dups := e.waitAllPublished(t, c, committed, n)
	s, err := r.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Reconnects < 2 {
		t.Fatalf("relay counted %d reconnects, want at least 2", s.Reconnects)
	}
	t.Logf("%d messages, %d republished after a lost connection (same message id), %d reconnects", n, dups, s.Reconnects)
}

// A relay process killed (SIGKILL) in the middle of a batch loses nothing:
// another relay publishes the rest, and a row published but not marked is
// published again with the same message id.
func TestRelayKilledProcess(t *testing.T) {
	t.Parallel()
	const n = 5000
	e := newEnv(t, 8)
	committed, _ := e.enqueueRows(t, n, 4, 500, 0)
	c := e.collect(t)

	connName := testamqp.Name(t, "idemq-test-relay-child")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envRelaySchema+"="+e.schema, envRelayConn+"="+connName, envRelayBatch+"=500")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start relay process: %v", err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})

	// Kill it once the broker has messages whose rows are not marked yet:
	// a batch between publish and commit.
	midBatch := false
	published := func() int {
		var k int
		_ = e.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+e.schema+".outbox_published").Scan(&k)
		return k
	}
	waitFor(t, 30*time.Second, "the relay process to publish", func() bool {
		_, total := c.counts()
		if total == 0 {
			return false
		}
		midBatch = total > published()
		return midBatch || total > n/2
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill relay process: %v", err)
	}
	<-exited
	if waitErr == nil || !strings.Contains(waitErr.Error(), "killed") {
		t.Fatalf("relay process ended with %v, want killed; stderr: %s", waitErr, stderr.String())
	}
	before := published()
	t.Logf("relay process killed (mid-batch: %v) with %d of %d rows marked published", midBatch, before, n)
	if before == n {
		t.Fatal("the relay process published everything before it was killed; the test proves nothing")
	}

	e.startRelay(t, e.relayConfig(t))
	dups := e.waitAllPublished(t, c, committed, n)
	t.Logf("%d duplicates after the kill, each with its row's message id", dups)
	if midBatch && dups == 0 {
		t.Fatal("killed mid-batch, yet no message was published twice")
	}
}

// syncBuffer is a log sink for a relay running in another goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// An unroutable message (its exchange has no binding for it) and one whose
// exchange is missing are kept, retried, reported and parked; the others
// flow meanwhile. Unparked after the binding is fixed, it is published.
func TestRelayUnroutableParked(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	ctx := context.Background()
	var logs syncBuffer
	cfg := e.relayConfig(t)
	cfg.MaxReturns = 3
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	r := e.startRelay(t, cfg)

	missing := testamqp.Name(t, "idemq-test-missing-x")
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: "nowhere", MessageID: "unroutable"}); err != nil {
			return err
		}
		return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: missing, RoutingKey: "any", MessageID: "no-exchange"})
	})
	if err != nil {
		t.Fatal(err)
	}
	committed, _ := e.enqueueRows(t, 200, 2, 20, 0)
	ids, _ := e.consumeAll(t, 200, 30*time.Second)
	for _, id := range committed {
		if ids[id] != 1 {
			t.Fatalf("routable message %s received %d times", id, ids[id])
		}
	}
	// A message reaches the queue before its row is marked, and the relay
	// counts a batch after its commit: wait for both.
	waitFor(t, 30*time.Second, "both messages parked, the others marked and counted", func() bool {
		s, err := r.Stats(ctx)
		return err == nil && s.Backlog.Parked == 2 && s.Backlog.Pending == 0 && s.Published == 200 &&
			s.Parked == 2 && strings.Count(logs.String(), "PARKED") == 2
	})

	type parked struct {
		id                int64
		attempts, returns int
		lastError, reason string
	}
	rows, err := e.pool.Query(ctx, "SELECT id, attempts, returns, last_error, parked_reason FROM "+e.schema+".outbox WHERE parked_at IS NOT NULL ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (parked, error) {
		var p parked
		return p, r.Scan(&p.id, &p.attempts, &p.returns, &p.lastError, &p.reason)
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"unroutable: 312 NO_ROUTE", "exchange not found"} {
		p := got[i]
		if p.attempts != 3 || p.returns != 3 || !strings.Contains(p.reason, want) || !strings.Contains(p.lastError, want) {
			t.Fatalf("parked row %d = %+v, want 3 attempts, 3 returns, reason %q", i, p, want)
		}
	}
	s, err := r.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Returned != 6 || s.Parked != 2 || s.Published != 200 || s.Backlog.Parked != 2 || s.Backlog.Pending != 0 {
		t.Fatalf("stats = %+v", s)
	}
	out := logs.String()
	if strings.Count(out, "outbox message unroutable") != 6 || strings.Count(out, "PARKED") != 2 || !strings.Contains(out, "level=WARN") {
		t.Fatalf("logs do not report the unroutable messages:\n%s", out)
	}
	if strings.Contains(out, "guest:guest") {
		t.Fatalf("logs leak the broker URL:\n%s", out)
	}

	// The operator adds the missing binding and unparks the row.
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.QueueBind(e.queue, "nowhere", e.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	if n, err := e.ob.Unpark(ctx, got[0].id); err != nil || n != 1 {
		t.Fatalf("unpark = %d, %v", n, err)
	}
	ids, _ = e.consumeAll(t, 1, 30*time.Second)
	if ids["unroutable"] != 1 {
		t.Fatalf("after unpark received %v", ids)
	}
}

// A relay whose confirms never come in time keeps the rows pending, counts
// the attempts, and starts a fresh channel.
func TestRelayConfirmTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	cfg := e.relayConfig(t)
	cfg.ConfirmTimeout = time.Nanosecond
	cfg.RetryInitial, cfg.RetryMax = time.Hour, time.Hour
	r := e.startRelay(t, cfg)
	ctx := context.Background()
	count := func(where string) int {
		var n int
		if err := e.pool.QueryRow(ctx, "SELECT count(*) FROM "+e.schema+".outbox WHERE "+where).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// The 1ns timeout strikes before the confirms come in, unless the timer
	// fires late on a loaded machine and every confirm beats it: publish
	// rounds of 50 rows until one round has rows that timed out.
	const timedOut = "published_at IS NULL AND last_error LIKE 'publisher confirm timed out%' AND available_at > now() + interval '30 minutes'"
	for round := 1; ; round++ {
		e.enqueueRows(t, 50, 1, 50, 0)
		waitFor(t, 30*time.Second, "an attempt on every row", func() bool { return count("attempts = 0") == 0 })
		failed := count(timedOut)
		if failed == 0 {
			if round == 5 {
				t.Fatal("no confirm timed out in 5 rounds of 50 rows with a 1ns confirm timeout")
			}
			continue
		}
		// Every row whose confirm did not come in time is kept for later,
		// and the relay takes a fresh channel. The counters follow the
		// commit that kept the rows, so they are waited for too.
		var s outbox.Stats
		waitFor(t, 30*time.Second, "a fresh channel and the timeouts counted", func() bool {
			var err error
			if s, err = r.Stats(ctx); err != nil {
				t.Fatal(err)
			}
			return s.Reconnects >= 1 && s.TimedOut >= int64(failed)
		})
		if int64(failed) != s.TimedOut || s.Backlog.Pending != int64(failed) {
			t.Fatalf("after the timeout: %d rows kept, stats %+v", failed, s)
		}
		return
	}
}

// Messages with an ordering key reach the queue in order per key,
// with three relays competing, while unordered messages flow around them.
func TestRelayOrderingKey(t *testing.T) {
	t.Parallel()
	const keys, perKey = 5, 150
	e := newEnv(t, 16)
	for range 3 {
		e.startRelay(t, e.relayConfig(t))
	}
	ctx := context.Background()
	var g errgroup.Group
	for k := range keys {
		g.Go(func() error {
			for i := range perKey {
				err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					if err := e.ob.Enqueue(ctx, tx, outbox.Message{
						Exchange: e.exchange, RoutingKey: boundKey, OrderingKey: fmt.Sprintf("key-%d", k),
						Body: []byte(strconv.Itoa(i)), MessageID: fmt.Sprintf("key-%d/%d", k, i),
					}); err != nil {
						return err
					}
					return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: fmt.Sprintf("free-%d/%d", k, i)})
				})
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	_, all := e.consumeAll(t, 2*keys*perKey, 60*time.Second)
	next := map[string]int{}
	for _, d := range all {
		if !strings.HasPrefix(d.MessageId, "key-") {
			continue
		}
		key, seq, _ := strings.Cut(d.MessageId, "/")
		if want := strconv.Itoa(next[key]); seq != want {
			t.Fatalf("key %s: got message %s, want %s next", key, seq, want)
		}
		next[key]++
	}
	for k := range keys {
		if got := next[fmt.Sprintf("key-%d", k)]; got != perKey {
			t.Fatalf("key-%d: %d messages in order, want %d", k, got, perKey)
		}
	}
}

// The LISTEN connection comes back after the database drops it: with
// polling nearly off, a new row is still published at once.
func TestRelayListenReconnects(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	cfg := e.relayConfig(t)
	cfg.PollInterval = time.Hour
	cfg.ReconnectInitial = 20 * time.Millisecond
	e.startRelay(t, cfg)
	ctx := context.Background()
	listening := func() int {
		var n int
		_ = e.pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", cfg.ConnectionName+"-listen").Scan(&n)
		return n
	}
	waitFor(t, 10*time.Second, "the LISTEN connection", func() bool { return listening() == 1 })
	if _, err := e.pool.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", cfg.ConnectionName+"-listen"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the LISTEN connection to come back", func() bool { return listening() == 1 })
	for i := range 3 {
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: strconv.Itoa(i)})
		})
		if err != nil {
			t.Fatal(err)
		}
		if ids, _ := e.consumeAll(t, 1, 10*time.Second); ids[strconv.Itoa(i)] != 1 {
			t.Fatalf("got %v", ids)
		}
	}
}

func TestGC(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	cfg := e.relayConfig(t)
	cfg.MaxReturns = 1
	e.startRelay(t, cfg)
	e.enqueueRows(t, 10, 1, 10, 0)
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: "nowhere"})
	})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "rows published and parked", func() bool {
		b := e.backlog(t)
		return b.Pending == 0 && b.Parked == 1
	})
	if r, err := e.ob.GC(ctx, dedup.GCOptions{Retention: time.Hour, Batch: 3}); err != nil || r.Deleted != 0 {
		t.Fatalf("gc of fresh rows deleted %d, %v", r.Deleted, err)
	}
	if _, err := e.pool.Exec(ctx, "UPDATE "+e.schema+".outbox_published SET published_at = published_at - interval '2 hours'"); err != nil {
		t.Fatal(err)
	}
	if r, err := e.ob.GC(ctx, dedup.GCOptions{Retention: time.Hour, Batch: 3}); err != nil || r.Deleted != 10 {
		t.Fatalf("gc deleted %d, %v; want 10", r.Deleted, err)
	}
	if b := e.backlog(t); b.Parked != 1 {
		t.Fatalf("gc touched the parked row: %+v", b)
	}
	if r, err := e.ob.GCParked(ctx, dedup.GCOptions{Retention: time.Microsecond}); err != nil || r.Deleted != 1 {
		t.Fatalf("gc parked deleted %d, %v; want 1", r.Deleted, err)
	}
}

// A row that makes the broker close the connection (a non-finite float
// header, written behind Enqueue's back) is found, counted and parked; the
// rows around it are published.
func TestRelayPoisonRowParked(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	ctx := context.Background()
	before, _ := e.enqueueRows(t, 30, 1, 30, 0)
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: "poison"}); err != nil {
			return err
		}
		inf, err := fieldtable.Encode(amqp.Table{"x": math.Inf(1)})
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE `+e.schema+`.outbox SET headers_amqp = $1 WHERE message_id = 'poison'`, inf)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	after, _ := e.enqueueRows(t, 30, 1, 30, 0)
	cfg := e.relayConfig(t)
	cfg.BatchSize = 20
	cfg.MaxReturns = 2
	cfg.ReconnectInitial = 10 * time.Millisecond
	e.startRelay(t, cfg)

	waitFor(t, 60*time.Second, "the poison row parked and the others published", func() bool {
		b := e.backlog(t)
		return b.Parked == 1 && b.Pending == 0
	})
	var reason string
	var returns int
	if err := e.pool.QueryRow(ctx, "SELECT parked_reason, returns FROM "+e.schema+".outbox WHERE message_id = 'poison'").Scan(&reason, &returns); err != nil {
		t.Fatal(err)
	}
	if returns != 2 || !strings.Contains(reason, "the broker closed the channel") {
		t.Fatalf("poison row: returns %d, reason %q", returns, reason)
	}
	// Rows of the batch that broke were published, then rolled back and
	// published again: the queue may hold duplicates, never the poison.
	got, _ := e.consumeAll(t, e.queueDepth(t), 30*time.Second)
	for _, id := range append(before, after...) {
		if got[id] == 0 {
			t.Fatalf("message %s lost", id)
		}
	}
	if got["poison"] != 0 {
		t.Fatal("the poison message was delivered")
	}
}

// With the broker unreachable the relay keeps retrying, logs without the
// URL's user and password, and still stops at once when its context ends.
func TestRelayBrokerDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	var logs syncBuffer
	cfg := e.relayConfig(t)
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg.ReconnectInitial, cfg.ReconnectMax = time.Millisecond, 5*time.Millisecond
	cfg.Dial = func(context.Context) (*amqp.Connection, error) {
		return nil, errors.New("dial amqp://relay:s3cret@broker.invalid:5672/: connection refused")
	}
	r, err := outbox.NewRelay(e.ob, "", cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.enqueueRows(t, 3, 1, 3, 0)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	waitFor(t, 10*time.Second, "a few reconnect attempts", func() bool {
		s, _ := r.Stats(context.Background())
		return s.Reconnects >= 3
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("relay did not stop within 5s of its context's end")
	}
	if b := e.backlog(t); b.Pending != 3 {
		t.Fatalf("pending = %d, want 3", b.Pending)
	}
	out := logs.String()
	if strings.Contains(out, "s3cret") || !strings.Contains(out, "amqp://xxxxx@broker.invalid") {
		t.Fatalf("logs do not redact the password:\n%s", out)
	}
}

// waitAllPublished waits until the outbox is drained and n distinct
// messages were consumed, fails on a committed message that never came or
// on a stray one, and returns how many extra copies arrived.
func (e *env) waitAllPublished(t *testing.T, c *collector, committed []string, n int) (dups int) {
	t.Helper()
	waitFor(t, 60*time.Second, "every row published", func() bool { return e.backlog(t).Pending == 0 })
	waitFor(t, 30*time.Second, "every message consumed", func() bool {
		distinct, _ := c.counts()
		return distinct >= n
	})
	got := c.snapshot()
	for _, id := range committed {
		if got[id] == 0 {
			t.Fatalf("message %s lost", id)
		}
		dups += got[id] - 1
	}
	if len(got) != n {
		t.Fatalf("received %d distinct message ids, want %d", len(got), n)
	}
	return dups
}

// Rows of one ordering key, enqueued by four writers at once (two rows a
// transaction, with EnqueueBatch), take the sequences 1…N of their key in
// commit order, with no gap, and arrive in that order with x-ordering-key
// and x-sequence; a message that carries its own x-sequence keeps it.
func TestOrderingKeySequencesFollowCommitOrder(t *testing.T) {
	t.Parallel()
	const writers, txs = 4, 40
	e := newEnv(t, 16)
	e.startRelay(t, e.relayConfig(t))
	e.startRelay(t, e.relayConfig(t))
	ctx := context.Background()
	var g errgroup.Group
	for w := range writers {
		g.Go(func() error {
			for i := range txs {
				err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					return e.ob.EnqueueBatch(ctx, tx, []outbox.Message{
						{Exchange: e.exchange, RoutingKey: boundKey, OrderingKey: "acct", MessageID: fmt.Sprintf("w%d/%d/a", w, i)},
						{Exchange: e.exchange, RoutingKey: boundKey, OrderingKey: "acct", MessageID: fmt.Sprintf("w%d/%d/b", w, i)},
					})
				})
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, OrderingKey: "other",
			MessageID: "own", Headers: amqp.Table{"x-sequence": int64(41)}})
	}); err != nil {
		t.Fatal(err)
	}
	_, all := e.consumeAll(t, 2*writers*txs+1, 60*time.Second)
	var want int64 = 1
	for _, d := range all {
		if d.MessageId == "own" {
			if d.Headers["x-sequence"] != int64(41) || d.Headers["x-ordering-key"] != "other" {
				t.Errorf("own sequence: headers %v, want x-sequence 41 kept", d.Headers)
			}
			continue
		}
		if d.Headers["x-ordering-key"] != "acct" || d.Headers["x-sequence"] != want {
			t.Fatalf("message %s: x-ordering-key %v x-sequence %v, want acct %d", d.MessageId, d.Headers["x-ordering-key"], d.Headers["x-sequence"], want)
		}
		want++
	}
	if want != 2*writers*txs+1 {
		t.Fatalf("%d sequenced messages, want %d", want-1, 2*writers*txs)
	}
}
