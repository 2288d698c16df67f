package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// A strategy runs the handlers of a group of acquired items in the group's
// transaction tx and commits their effects with their keys' completion.
// Every item's result says whether its effects committed (err == nil). An
// error instead means that nothing committed and nothing was decided: the
// group must run again another way (see Consumer.attempt).
type strategy interface {
	run(ctx context.Context, tx pgx.Tx, items []*item) ([]groupResult, error)
}

// newStrategy picks the consumer's strategy: batch (a BatchHandler),
// optimistic (Group.Optimistic), else isolated.
func (c *Consumer) newStrategy() strategy {
	switch {
	case c.batchHandler != nil:
		return whole{c: c, batch: true}
	case c.cfg.Group.Optimistic:
		return whole{c: c}
	}
	return isolated{c}
}

// isolated runs each handler under its own savepoint of the shared
// transaction (none for a group of one with a separate lease) and completes
// its key there, so that a failing handler rolls back only its own effects
// and key; then it commits once. The keys of failed items that the
// transaction holds are given up in it (dedup.Store.ReleaseTx) before the
// commit; the others are released after it (releaseFailed).
type isolated struct{ c *Consumer }

func (s isolated) run(ctx context.Context, tx pgx.Tx, items []*item) ([]groupResult, error) {
	c := s.c
	if len(items) == 1 && !items[0].lease.HeldByTransaction() {
		return s.runAlone(ctx, tx, items[0]), nil
	}
	out := make([]groupResult, len(items))
	sp := &savepoints{tx: tx}
	g := newGroupTx(tx, sp)
	for i, it := range items {
		if err := s.runOne(ctx, sp, g, it, &out[i]); err != nil {
			return broken(out, i, err), nil
		}
	}
	cctx, cspan := c.groupSpan(ctx, items, "idemq commit group", "idemq complete")
	defer cspan.End()
	if err := c.writeOutbox(cctx, g); err != nil {
		cspan.SetStatus(codes.Error, redact.Error(err))
		return failAll(out, err), nil
	}
	leased, err := s.giveUpHeld(cctx, tx, items, out)
	if err != nil {
		cspan.SetStatus(codes.Error, redact.Error(err))
		return failAll(out, err), nil
	}
	c.crashAt(kit.StageBeforeCommit, "", committing(items, out), tx)
	if err := c.commit(cctx, tx); err != nil {
		// The commit's fate is unknown: the keys are released (a no-op for
		// those it did complete) and retried; a retry is a duplicate if it
		// committed.
		cspan.SetStatus(codes.Error, redact.Error(err))
		for i := range out {
			out[i] = groupResult{err: fmt.Errorf("commit: %w", err)}
		}
		return out, nil
	}
	for it, l := range leased {
		c.acquire(it, l) // the step runs under a lease others can see
	}
	return out, nil
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

// giveUpHeld gives up, in tx, the keys tx holds whose items failed, each
// with the reason settleFailure routes it by, so that the commit leaves them
// released instead of presumed completed; the keys of items whose handler
// called Step (ErrStepInBatch) become leases others can see instead, under
// which they run again once tx committed (Consumer.execute): it returns
// those leases. One statement for each kind.
func (s isolated) giveUpHeld(ctx context.Context, tx pgx.Tx, items []*item, out []groupResult) (map[*item]*dedup.Lease, error) {
	var (
		released, stepped []*dedup.Lease
		reasons           []string
		steppers          []*item
	)
	for i, it := range items {
		switch r := out[i]; {
		case r.err == nil || !it.lease.HeldByTransaction():
		case errors.Is(r.err, ErrStepInBatch):
			stepped, steppers = append(stepped, it.lease), append(steppers, it)
		default:
			released = append(released, it.lease)
			reasons = append(reasons, s.c.releaseReason(it, r.err, r.bystander))
		}
	}
	rctx, cancel := s.c.storeCtx(ctx)
	defer cancel()
	if err := s.c.store.ReleaseTx(rctx, tx, released, reasons); err != nil {
		return nil, err
	}
	leases, err := s.c.store.LeaseTx(rctx, tx, stepped, s.c.cfg.Lease)
	if err != nil {
		return nil, err
	}
	leased := make(map[*item]*dedup.Lease, len(leases))
	for i, l := range leases {
		leased[steppers[i]] = l
	}
	return leased, nil
}

// runAlone runs a group of one with a separate lease: the handler in tx,
// then the key's completion and the commit in a span "idemq complete" of
// the delivery's trace.
func (s isolated) runAlone(ctx context.Context, tx pgx.Tx, it *item) []groupResult {
	c := s.c
	g := newGroupTx(tx, nil)
	result, err := c.call(it, g)
	if err != nil {
		return []groupResult{{err: err}}
	}
	cctx, cspan := c.tracer.Start(it.ctx, "idemq complete")
	defer cspan.End()
	err = c.writeOutbox(cctx, g)
	if err == nil {
		sctx, cancel := c.storeCtx(cctx)
		err = c.store.Complete(sctx, tx, it.lease, result)
		cancel()
	}
	if err == nil {
		c.crashAt(kit.StageBeforeCommit, "", []*item{it}, tx)
		if err = c.commit(cctx, tx); err != nil {
			// The commit's fate is unknown: the key is released (a no-op
			// if it did commit) and retried; the retry is then a duplicate.
			err = fmt.Errorf("commit: %w", err)
		}
	}
	if err != nil {
		cspan.SetStatus(codes.Error, redact.Error(err))
		return []groupResult{{err: err}}
	}
	return []groupResult{{result: result}}
}

// runOne runs one item's handler above a savepoint of its own (opened with
// its first statement) and completes its key there. The item's own failure
// (its handler's error, a lost lease) rolls back to the savepoint and is
// recorded in r; a returned error means the shared transaction itself is
// broken.
func (s isolated) runOne(ctx context.Context, sp *savepoints, g *groupTx, it *item, r *groupResult) error {
	c := s.c
	sp.next()
	rows := g.pend.Len()
	result, err := c.call(it, g)
	if err == nil {
		cctx, cancel := c.storeCtx(ctx)
		err = sp.complete(cctx, c.store, it.lease, result)
		cancel()
	}
	if err != nil {
		// Its outbox rows go with the rest of its work (a handler that
		// failed, or a completion fenced out: the lease was lost).
		g.pend.Truncate(rows)
		r.err = err
		rctx, cancel := c.storeCtx(context.WithoutCancel(ctx))
		defer cancel()
		if err := sp.rollback(rctx); err != nil {
			return fmt.Errorf("roll back to savepoint: %w", err)
		}
		return nil
	}
	r.result = result
	return nil
}

// whole runs the whole group straight in one transaction, without
// savepoints: the batch handler once (batch), or each handler in turn
// (optimistic); then it completes every key with one statement and commits
// once. When a handler fails or a lease is lost, nothing is committed and
// the group runs again isolated (Consumer.attempt), where only the failing
// item fails. A failed commit fails the group instead: its outcome is
// unknown, so nothing runs again.
type whole struct {
	c     *Consumer
	batch bool
}

func (s whole) run(ctx context.Context, tx pgx.Tx, items []*item) ([]groupResult, error) {
	if len(items) == 1 {
		// Alone, whole and isolated are the same, and a failure must not run
		// the handler twice.
		return isolated{s.c}.run(ctx, tx, items)
	}
	return s.commitWhole(ctx, tx, items)
}

// commitWhole runs the group's user code in tx, completes every key with one
// statement (for keys tx holds, only the results that differ from the
// presumed one) and commits. An error means nothing committed and nothing
// is decided: a handler failed, a lease was lost or the completion failed,
// and the group must run again another way. A failed commit is an outcome
// (unknown: every item fails and is retried), not an error.
func (s whole) commitWhole(ctx context.Context, tx pgx.Tx, items []*item) ([]groupResult, error) {
	c := s.c
	g := newGroupTx(tx, nil)
	results, err := s.handle(ctx, items, g)
	if err == nil {
		err = c.writeOutbox(ctx, g)
	}
	if err != nil {
		return nil, err
	}
	leases := make([]*dedup.Lease, len(items))
	for i, it := range items {
		leases[i] = it.lease
	}
	cctx, cspan := c.tracer.Start(ctx, "idemq complete", groupLinks(items))
	defer cspan.End()
	lost, err := c.completeBatch(cctx, tx, leases, results)
	if err == nil && len(lost) > 0 {
		err = fmt.Errorf("%d of the group's leases: %w", len(lost), dedup.ErrLeaseLost)
	}
	if err != nil {
		cspan.AddEvent("idemq.group_isolated", trace.WithAttributes(attribute.Int("idemq.leases_lost", len(lost))))
		return nil, err
	}
	out := make([]groupResult, len(items))
	c.crashAt(kit.StageBeforeCommit, "", items, tx)
	if err := c.commit(cctx, tx); err != nil {
		// The commit's fate is unknown: every item is retried; a retry finds
		// its key completed (a duplicate) if the commit landed.
		cspan.SetStatus(codes.Error, redact.Error(err))
		return failAll(out, fmt.Errorf("commit: %w", err)), nil
	}
	for i := range out {
		out[i] = groupResult{result: results[i]}
	}
	return out, nil
}

// handle runs the group's user code in tx: the batch handler once, or each
// handler in turn; the first failure ends it.
func (s whole) handle(ctx context.Context, items []*item, g *groupTx) ([]dedup.Result, error) {
	if s.batch {
		return s.c.callBatch(ctx, items, g)
	}
	results := make([]dedup.Result, len(items))
	for i, it := range items {
		var err error
		if results[i], err = s.c.call(it, g); err != nil {
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

// completeBatch completes a whole group's keys, bounded by StoreTimeout.
func (c *Consumer) completeBatch(ctx context.Context, tx pgx.Tx, leases []*dedup.Lease, results []dedup.Result) ([]*dedup.Lease, error) {
	cctx, cancel := c.storeCtx(ctx)
	defer cancel()
	return c.store.CompleteBatch(cctx, tx, leases, results)
}

// commit commits a group's transaction, bounded by StoreTimeout. A commit
// that times out has an unknown fate: the group is retried, and each retry
// finds its key completed (a duplicate) if the commit did land.
func (c *Consumer) commit(ctx context.Context, tx pgx.Tx) error {
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
