package consumer

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
)

// A runner runs the handlers of a group of acquired items in the group's
// transaction tx, which the pipeline then commits once (Consumer.commit).
// New picks it from the Config: isolated (a savepoint per handler, the
// default), whole (Group.Optimistic) or batch (a BatchHandler).
type runner interface {
	// run runs the items' handlers in tx and returns, for each item, its
	// result or failure, with g, the handlers' view of tx. A key the runner
	// completed is marked completed; the pipeline completes the others
	// that succeeded with one statement. ok false: nothing can commit and
	// nothing is decided (a handler of a whole group failed): the pipeline
	// re-queues the items to run isolated.
	run(ctx context.Context, tx pgx.Tx, items []*item) (g *groupTx, results []groupResult, ok bool)
	// commitSpan names the span of a group's commit.
	commitSpan() string
}

// newRunner picks the consumer's runner: batch (a BatchHandler), whole
// (Group.Optimistic), else isolated.
func (c *Consumer) newRunner() runner {
	switch {
	case c.batchHandler != nil:
		return whole{c: c, batch: true}
	case c.cfg.Group.Optimistic:
		return whole{c: c}
	}
	return c.isolated
}

// isolated runs each handler under its own savepoint of the shared
// transaction and completes its key there, so that a failing handler rolls
// back only its own effects and key. A group of one whose key is a lease
// (bare) needs no savepoint: its failure fails the whole transaction, and
// its key is completed at the commit.
type isolated struct {
	c    *Consumer
	bare bool
}

func (r isolated) commitSpan() string { return "idemq commit group" }

func (r isolated) run(ctx context.Context, tx pgx.Tx, items []*item) (*groupTx, []groupResult, bool) {
	out := make([]groupResult, len(items))
	if len(items) == 1 && r.bare {
		g := newGroupTx(tx, nil)
		out[0].result, out[0].err = r.c.call(items[0], g)
		return g, out, true
	}
	sp := &savepoints{tx: tx}
	g := newGroupTx(tx, sp)
	for i, it := range items {
		if err := r.runOne(ctx, sp, g, it, &out[i]); err != nil {
			return g, broken(out, i, err), true
		}
	}
	return g, out, true
}

// runOne runs one item's handler above a savepoint of its own (opened with
// its first statement) and completes its key there. The item's own failure
// (its handler's error, a lost lease) rolls back to the savepoint and is
// recorded in r; a returned error means the shared transaction itself is
// broken.
func (r isolated) runOne(ctx context.Context, sp *savepoints, g *groupTx, it *item, res *groupResult) error {
	c := r.c
	sp.next()
	rows := g.pend.Len()
	result, err := c.call(it, g)
	if err == nil {
		_, err = c.complete(ctx, g.tx, sp, []*dedup.Lease{it.lease}, []dedup.Result{result})
	}
	if err != nil {
		// Its outbox rows go with the rest of its work (a handler that
		// failed, or a completion fenced out: the lease was lost).
		g.pend.Truncate(rows)
		res.err = err
		rctx, cancel := c.storeCtx(context.WithoutCancel(ctx))
		defer cancel()
		if err := sp.rollback(rctx); err != nil {
			return fmt.Errorf("roll back to savepoint: %w", err)
		}
		return nil
	}
	res.result, res.completed = result, true
	return nil
}

// broken records that item i broke the shared transaction: what ran before
// it is lost too, through no fault of its own.
func broken(out []groupResult, i int, err error) []groupResult {
	for j := range out {
		if j != i && (j > i || out[j].err == nil) {
			out[j] = groupResult{err: fmt.Errorf("group-mate broke the transaction: %w", err), bystander: true}
		}
	}
	out[i] = groupResult{err: err}
	return out
}

// whole runs the whole group straight in one transaction, without
// savepoints: the batch handler once (batch), or each handler in turn
// (optimistic); the pipeline then completes every key with one statement
// and commits once. When a handler fails or a lease is lost, nothing is
// committed and the group runs again isolated, where only the failing
// item fails. A failed commit fails the group instead: its outcome is
// unknown, so nothing runs again.
type whole struct {
	c     *Consumer
	batch bool
}

func (r whole) commitSpan() string { return "idemq complete" }

func (r whole) run(ctx context.Context, tx pgx.Tx, items []*item) (*groupTx, []groupResult, bool) {
	if len(items) == 1 {
		// Alone, whole and isolated are the same, and a failure must not run
		// the handler twice.
		return r.c.isolated.run(ctx, tx, items)
	}
	g := newGroupTx(tx, nil)
	results, err := r.handle(ctx, items, g)
	if err != nil {
		return nil, nil, false
	}
	out := make([]groupResult, len(items))
	for i := range out {
		out[i].result = results[i]
	}
	return g, out, true
}

// handle runs the group's user code in g: the batch handler once, or each
// handler in turn; the first failure ends it.
func (r whole) handle(ctx context.Context, items []*item, g *groupTx) ([]dedup.Result, error) {
	if r.batch {
		return r.c.callBatch(ctx, items, g)
	}
	results := make([]dedup.Result, len(items))
	for i, it := range items {
		var err error
		if results[i], err = r.c.call(it, g); err != nil {
			return nil, err
		}
	}
	return results, nil
}

// failAll marks every item not yet failed as failed with err.
func failAll(out []groupResult, err error) []groupResult {
	for i := range out {
		if out[i].err == nil {
			out[i] = groupResult{err: err}
		}
	}
	return out
}

// beginGroup opens a group's transaction, bounded by StoreTimeout.
func (c *Consumer) beginGroup(ctx context.Context) (pgx.Tx, error) {
	bctx, cancel := c.storeCtx(ctx)
	defer cancel()
	tx, err := c.store.Pool().Begin(bctx)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	return tx, nil
}

// beginHeld opens the transaction of a group that reserves its keys in it.
// The transaction's row locks are the group's leases, so it must not
// outlive the worker's reach: a worker cut off from Postgres leaves its
// session idle in the transaction, which the server ends after
// HandlerTimeout + StoreTimeout (the longest a live worker leaves it idle:
// a handler doing other work, then a store call), releasing the keys.
func (c *Consumer) beginHeld(ctx context.Context) (pgx.Tx, error) {
	bctx, cancel := c.storeCtx(ctx)
	defer cancel()
	idle := (c.cfg.HandlerTimeout + c.cfg.StoreTimeout).Milliseconds()
	tx, err := c.store.Pool().BeginTx(bctx, pgx.TxOptions{
		BeginQuery: "BEGIN; SET LOCAL idle_in_transaction_session_timeout = " + strconv.FormatInt(idle, 10),
	})
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	return tx, nil
}

// commitTx commits a group's transaction, bounded by StoreTimeout. A commit
// that times out has an unknown fate: the group is retried, and each retry
// finds its key completed (a duplicate) if the commit did land.
func (c *Consumer) commitTx(ctx context.Context, tx pgx.Tx) error {
	cctx, cancel := c.storeCtx(ctx)
	defer cancel()
	return tx.Commit(cctx)
}

// storeCtx bounds one key-store call the runtime makes on its own behalf
// by StoreTimeout.
func (c *Consumer) storeCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.cfg.StoreTimeout)
}

// rollback rolls tx back, bounded by StoreTimeout, even when ctx is gone.
// On a dead connection pgx closes it instead; either way nothing commits.
func (c *Consumer) rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := c.storeCtx(context.WithoutCancel(ctx))
	defer cancel()
	_ = tx.Rollback(rctx)
}
