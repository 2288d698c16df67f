package outbox_test

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// A relay whose LISTEN connection goes through PgBouncer in transaction
// mode hears no NOTIFY (the backend that ran the LISTEN serves others): it
// finds out with its probe, says so once and polls, and every message still
// goes out, within about a poll interval of its commit. With its LISTEN
// connection direct, the same relay is woken at once. Both latencies, commit
// to delivery, are logged (docs/operations.md, "PgBouncer").
func TestRelayThroughAPoolerPolls(t *testing.T) {
	t.Parallel()
	pooled, err := pgx.ParseConfig(testdb.PgBouncerURL(t))
	if err != nil {
		t.Fatal(err)
	}
	const poll = 250 * time.Millisecond
	for _, tc := range []struct {
		name   string
		listen *pgx.ConnConfig
		deaf   bool
	}{
		{name: "direct", listen: testdb.Direct(t)},
		{name: "pgbouncer", listen: pooled, deaf: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 4)
			cfg := e.relayConfig(t)
			cfg.ListenConfig, cfg.PollInterval = tc.listen, poll
			log := &syncBuffer{}
			cfg.Logger = slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelWarn}))
			e.startRelay(t, cfg)
			const deafLine = "its LISTEN connection does not hear NOTIFY"
			if tc.deaf {
				waitFor(t, 15*time.Second, "the relay to say it polls", func() bool { return strings.Contains(log.String(), deafLine) })
			}
			ctx := context.Background()
			ch, err := e.conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			defer ch.Close()
			deliveries, err := ch.Consume(e.queue, "", true, false, false, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			var lat []time.Duration
			for i := range 20 {
				err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					return e.ob.Enqueue(ctx, tx, outbox.Message{Exchange: e.exchange, RoutingKey: boundKey, MessageID: strconv.Itoa(i)})
				})
				if err != nil {
					t.Fatal(err)
				}
				committed := time.Now()
				select {
				case d := <-deliveries:
					if d.MessageId != strconv.Itoa(i) {
						t.Fatalf("got message %q, want %d", d.MessageId, i)
					}
					lat = append(lat, time.Since(committed))
				case <-time.After(10 * time.Second):
					t.Fatalf("message %d not published within 10 s", i)
				}
			}
			slices.Sort(lat)
			p50, worst := lat[len(lat)/2], lat[len(lat)-1]
			t.Logf("%s LISTEN, poll %s: commit to delivery p50 %s, max %s (20 messages)", tc.name, poll, p50.Round(time.Millisecond), worst.Round(time.Millisecond))
			if !tc.deaf && strings.Contains(log.String(), deafLine) {
				t.Fatalf("a direct LISTEN connection taken for deaf:\n%s", log.String())
			}
			if worst > poll+2*time.Second {
				t.Fatalf("a message took %s from commit to delivery, poll %s", worst, poll)
			}
		})
	}
}
