package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// In an isolated group each handler's savepoint goes out with its first
// statement, whatever kind of statement that is. A handler that fails after
// its statements rolls back exactly its own effects, one whose statement
// breaks the transaction rolls back to its savepoint, and one that sends
// nothing has nothing to roll back: the group-mates before and after each
// of them commit, once each.
func TestSavepointsCoverEveryKindOfStatement(t *testing.T) {
	forModes(t, func(m mode) bool { return !m.Batch() }, func(t *testing.T, m mode) {
		h := newHarness(t, m, func(c *consumer.Config) {
			c.Concurrency, c.Group.Linger = 1, 200*time.Millisecond
			if !m.Single() {
				c.Group.Size = 32
			}
		})
		ledger := h.schema + ".ledger"
		insert := "INSERT INTO " + ledger + " (key, tenant, attempt) VALUES ($1, $2, $3)"
		kinds := []struct {
			name string
			run  func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error
		}{
			{"exec without arguments", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				_, err := tx.Exec(ctx, fmt.Sprintf("INSERT INTO %s (key, attempt) VALUES ('%s', 1); SELECT 1", ledger, d.Key))
				return err
			}},
			{"exec", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				_, err := tx.Exec(ctx, insert, d.Key, d.Tenant, d.Attempt)
				return err
			}},
			{"query read to the end", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				rows, err := tx.Query(ctx, "INSERT INTO "+ledger+" (key, attempt) SELECT $1, g FROM generate_series(1, 1) g RETURNING attempt", d.Key)
				if err != nil {
					return err
				}
				n := 0
				for rows.Next() {
					n++
				}
				if err := rows.Err(); err != nil {
					return err
				}
				if n != 1 {
					return fmt.Errorf("%d rows", n)
				}
				return nil
			}},
			{"query closed early", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				rows, err := tx.Query(ctx, "SELECT g FROM generate_series(1, $1::int) g", 100)
				if err != nil {
					return err
				}
				rows.Next()
				rows.Close()
				if err := rows.Err(); err != nil {
					return err
				}
				_, err = tx.Exec(ctx, insert, d.Key, d.Tenant, d.Attempt)
				return err
			}},
			{"query row", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				var attempt int
				return tx.QueryRow(ctx, "INSERT INTO "+ledger+" (key, attempt) VALUES ($1, $2) RETURNING attempt", d.Key, d.Attempt).Scan(&attempt)
			}},
			{"query row with an exec mode", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				var attempt int
				return tx.QueryRow(ctx, "INSERT INTO "+ledger+" (key, attempt) VALUES ($1, $2) RETURNING attempt", pgx.QueryExecModeSimpleProtocol, d.Key, d.Attempt).Scan(&attempt)
			}},
			{"batch", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				b := &pgx.Batch{}
				b.Queue(insert, d.Key, d.Tenant, d.Attempt)
				return tx.SendBatch(ctx, b).Close()
			}},
			{"copy", func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) error {
				_, err := tx.CopyFrom(ctx, pgx.Identifier{h.schema, "ledger"}, []string{"key", "tenant", "attempt"}, pgx.CopyFromRows([][]any{{d.Key, d.Tenant, d.Attempt}}))
				return err
			}},
		}
		// Each kind three times: succeeding, failing after its statement,
		// and (for the first two) succeeding after a group-mate broke the
		// transaction; and keys whose handlers send nothing.
		type plan struct {
			kind            int
			fail, breaks    bool
			sendsNothing    bool
			wantEffect      int
			wantDeadLetters int
		}
		plans := map[string]plan{}
		i := 0
		for k := range kinds {
			plans[keyOf(i, "ok")] = plan{kind: k, wantEffect: 1}
			plans[keyOf(i, "fails")] = plan{kind: k, fail: true, wantDeadLetters: 1}
			i++
		}
		plans[keyOf(i, "breaks")] = plan{breaks: true, wantDeadLetters: 1}
		plans[keyOf(i, "nothing")] = plan{sendsNothing: true}
		plans[keyOf(i, "nothing-fails")] = plan{sendsNothing: true, fail: true, wantDeadLetters: 1}
		for key := range plans {
			h.publish(key, `{"n":1}`, nil)
		}
		h.start(1, func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
			p := plans[d.Key]
			switch {
			case p.breaks:
				_, err := tx.Exec(ctx, "INSERT INTO "+h.schema+".no_such_table VALUES ($1)", d.Key)
				return consumer.Response{}, consumer.Permanent(fmt.Errorf("the statement broke the transaction: %w", err))
			case p.sendsNothing && p.fail:
				return consumer.Response{}, consumer.Permanent(errors.New("refused before any statement"))
			case p.sendsNothing:
				return consumer.Response{}, nil
			}
			if err := kinds[p.kind].run(ctx, tx, d); err != nil {
				return consumer.Response{}, fmt.Errorf("%s: %w", kinds[p.kind].name, err)
			}
			if p.fail {
				return consumer.Response{}, consumer.Permanent(errors.New("failed after its statement"))
			}
			return consumer.Response{}, nil
		})
		evs := h.waitEvents(60*time.Second, "every message's outcome", func(evs []consumer.Event) bool { return finals(evs) >= len(plans) })
		eff := h.effects()
		dead := 0
		for _, e := range evs {
			if e.Outcome == consumer.OutcomeDeadLettered {
				dead++
			}
			if e.Outcome == consumer.OutcomeRetried {
				t.Errorf("retried: %v", e.Err)
			}
		}
		wantDead := 0
		for key, p := range plans {
			wantDead += p.wantDeadLetters
			if eff[key] != p.wantEffect {
				name := "(none)"
				if !p.breaks && !p.sendsNothing {
					name = kinds[p.kind].name
				}
				t.Errorf("key %s (%s, fail %v): applied %d times, want %d", key, name, p.fail, eff[key], p.wantEffect)
			}
		}
		if dead != wantDead {
			t.Errorf("%d dead-lettered, want %d", dead, wantDead)
		}
	})
}
