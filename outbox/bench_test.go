package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/outbox"
)

// BenchmarkCommitToPublish measures the time from a transaction's COMMIT to
// the delivery of its outbox message to a consumer, one message at a time,
// with the relay woken by NOTIFY (sent in the transaction, or after the
// commit with WakeAfterCommit and Wake) or by polling only. Commits come at random
// moments, so polling shows its real average. Run it with a fixed count:
//
//	go test -run '^$' -bench CommitToPublish -benchtime 200x ./outbox/
func BenchmarkCommitToPublish(b *testing.B) {
	for _, mode := range []struct {
		name        string
		notify      bool
		afterCommit bool
		poll        time.Duration
	}{
		{"notify", true, false, time.Second},
		{"notify-after-commit", true, true, time.Second},
		{"poll=100ms", false, false, 100 * time.Millisecond},
		{"poll=1s", false, false, time.Second},
	} {
		b.Run(mode.name, func(b *testing.B) {
			e := newEnv(b, 4)
			cfg := e.relayConfig(b)
			cfg.NoNotify = !mode.notify
			cfg.PollInterval = mode.poll
			e.startRelay(b, cfg)
			deliveries := e.consumer(b)
			ctx := context.Background()
			pause := mode.poll
			if mode.notify {
				pause = 5 * time.Millisecond
			}
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				b.StopTimer()
				time.Sleep(rand.N(pause)) // commits at random moments, not a synchronisation
				b.StartTimer()
				id := strconv.Itoa(i)
				wctx := ctx
				if mode.afterCommit {
					wctx = outbox.WakeAfterCommit(ctx)
				}
				err := pgx.BeginFunc(wctx, e.pool, func(tx pgx.Tx) error {
					return e.ob.Enqueue(wctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: id})
				})
				if err != nil {
					b.Fatal(err)
				}
				committed := time.Now()
				outbox.Wake(wctx)
				select {
				case d := <-deliveries:
					if d.MessageId != id {
						b.Fatalf("got message %s, want %s", d.MessageId, id)
					}
				case <-time.After(30 * time.Second):
					b.Fatalf("message %s not delivered in 30s", id)
				}
				lat = append(lat, time.Since(committed))
			}
			b.StopTimer()
			slices.Sort(lat)
			ms := func(q float64) float64 {
				return float64(lat[min(len(lat)-1, int(q*float64(len(lat))))].Microseconds()) / 1000
			}
			b.ReportMetric(ms(0.50), "p50-ms")
			b.ReportMetric(ms(0.99), "p99-ms")
		})
	}
}

// BenchmarkRelayThroughput measures how fast relays drain a backlog of b.N
// rows into a durable queue, persistent messages, with publisher confirms:
//
//	go test -run '^$' -bench RelayThroughput -benchtime 20000x ./outbox/
func BenchmarkRelayThroughput(b *testing.B) {
	for _, c := range []struct{ relays, batch int }{{1, 100}, {1, 500}, {3, 500}} {
		b.Run(fmt.Sprintf("relays=%d/batch=%d", c.relays, c.batch), func(b *testing.B) {
			e := newEnv(b, 8)
			durable := e.queue + ".durable"
			ch, err := e.conn.Channel()
			if err != nil {
				b.Fatal(err)
			}
			if _, err := ch.QueueDeclare(durable, true, false, false, false, nil); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				_, _ = ch.QueueDelete(durable, false, false, false)
				_ = ch.Close()
			})
			ctx := context.Background()
			msgs := make([]outbox.Message, 0, 1000)
			for i := 0; i < b.N; i += cap(msgs) {
				msgs = msgs[:0]
				for j := i; j < min(b.N, i+cap(msgs)); j++ {
					msgs = append(msgs, outbox.Message{RoutingKey: durable, Body: make([]byte, 256), MessageID: strconv.Itoa(j)})
				}
				if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return e.ob.EnqueueBatch(ctx, tx, msgs) }); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			start := time.Now()
			for range c.relays {
				cfg := e.relayConfig(b)
				cfg.BatchSize = c.batch
				e.startRelay(b, cfg)
			}
			deadline := time.Now().Add(5 * time.Minute)
			for e.backlog(b).Pending > 0 {
				if time.Now().After(deadline) {
					b.Fatal("backlog not drained in 5 minutes")
				}
				time.Sleep(5 * time.Millisecond)
			}
			elapsed := time.Since(start)
			b.StopTimer()
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		})
	}
}

// consumer returns the deliveries of the env's queue, auto-acked.
func (e *env) consumer(tb testing.TB) <-chan amqp.Delivery {
	tb.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = ch.Close() })
	d, err := ch.Consume(e.queue, "", true, false, false, false, nil)
	if err != nil {
		tb.Fatal(err)
	}
	return d
}
