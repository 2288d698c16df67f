package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Deferred collects the outbox rows enqueued on one transaction, for a
// runtime that runs many operations in it and writes their rows with one
// statement before it commits (the consumer, for a group's handlers): an
// Enqueue on that transaction, with a context that carries the Deferred
// (WithDeferred), checks the message and takes its message id and trace
// context at once, as always, but only queues the row. The runtime drops
// the rows of an operation that failed (Truncate) and writes the rest
// (Write) before the commit, so a message is still published if and only if
// its operation commits. A handler does not see its rows in the outbox table
// before the commit.
type Deferred struct {
	tx   pgx.Tx
	rows []deferredRow
}

type deferredRow struct {
	o   *Outbox
	row []any
}

// NewDeferred returns an empty Deferred for the rows enqueued on tx (the
// transaction value the operations are given).
func NewDeferred(tx pgx.Tx) *Deferred { return &Deferred{tx: tx} }

type deferredKey struct{}

// WithDeferred returns a context in which an Enqueue on d's transaction is
// deferred to d.
func WithDeferred(ctx context.Context, d *Deferred) context.Context {
	return context.WithValue(ctx, deferredKey{}, d)
}

// deferredFor returns the Deferred of ctx when it collects tx's rows.
func deferredFor(ctx context.Context, tx pgx.Tx) *Deferred {
	d, _ := ctx.Value(deferredKey{}).(*Deferred)
	if d == nil || d.tx != tx {
		return nil
	}
	return d
}

func (d *Deferred) add(o *Outbox, row []any) { d.rows = append(d.rows, deferredRow{o, row}) }

// Len is the number of rows queued so far: a mark to Truncate to.
func (d *Deferred) Len() int { return len(d.rows) }

// Truncate drops the rows queued after the first n (those of an operation
// that failed).
func (d *Deferred) Truncate(n int) {
	clear(d.rows[n:])
	d.rows = d.rows[:n]
}

// Write writes the queued rows in tx, in the order they were enqueued, with
// one COPY per outbox (one in all, usually), and empties d. It wakes the
// relays as Enqueue does: with a NOTIFY in tx, or, when ctx comes from
// WakeAfterCommit, at the Wake(ctx) the runtime calls after its commit
// (the consumer's way, so that its groups' commits do not queue on
// Postgres' notify lock).
func (d *Deferred) Write(ctx context.Context, tx pgx.Tx) error {
	for len(d.rows) > 0 {
		o := d.rows[0].o
		var rows [][]any
		rest := d.rows[:0]
		for _, r := range d.rows {
			if r.o == o {
				rows = append(rows, r.row)
			} else {
				rest = append(rest, r)
			}
		}
		if err := o.copyRows(ctx, tx, rows); err != nil {
			return fmt.Errorf("outbox: write %d deferred rows: %w", len(rows), err)
		}
		clear(d.rows[len(rest):])
		d.rows = rest
	}
	return nil
}
