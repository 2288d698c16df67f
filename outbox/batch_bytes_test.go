package outbox_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/outbox"
)

// A batch cut short by MaxBatchBytes counts as full: the relay claims the
// next one at once instead of waiting for a wake-up (here: none, and a poll
// a minute away), and every row goes out, the oversized one alone. One
// lane, so that the batches, and the messages, arrive in id order (lanes
// publish their batches at once, in no order between them).
func TestRelayBatchesBoundedByBytes(t *testing.T) {
	t.Parallel()
	const kib = 1 << 10
	e := newEnv(t, 4)
	sizes := []int{300 * kib, 300 * kib, 300 * kib, 2048 * kib, 300 * kib, 300 * kib}
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		for _, n := range sizes {
			if err := e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, Body: bytes.Repeat([]byte("x"), n)}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	cfg := e.relayConfig(t)
	cfg.MaxBatchBytes, cfg.NoNotify, cfg.PollInterval, cfg.Lanes = 700*kib, true, time.Minute, 1
	e.startRelay(t, cfg)
	_, got := e.consumeAll(t, len(sizes), 20*time.Second)
	for i, d := range got {
		if len(d.Body) != sizes[i] {
			t.Fatalf("message %d has %d bytes, want %d (in id order)", i, len(d.Body), sizes[i])
		}
	}
}
