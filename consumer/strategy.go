package consumer

import (
	"context"
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

// A strategy runs the handlers of a group of acquired items in one
// transaction and commits their effects with their keys' completion. Every
// item's result says whether its effects committed (err == nil).
type strategy interface {
	run(ctx context.Context, items []*item) []groupResult
}

// newStrategy picks the consumer's strategy: batch (a BatchHandler),
// optimistic (GroupOptimistic), else isolated.
func (c *Consumer) newStrategy() strategy {
	iso := isolated{c}
	switch {
	case c.batchHandler != nil:
		return whole{c: c, batch: true, fallback: iso}
	case c.cfg.GroupOptimistic:
		return whole{c: c, fallback: iso}
	}
	return iso
}

// isolated runs each handler under its own savepoint of the shared
// transaction (none for a group of one) and completes its key there, so
// that a failing handler rolls back only its own effects and key; then it
// commits once.
type isolated struct{ c *Consumer }

func (s isolated) run(ctx context.Context, items []*item) []groupResult {
	c := s.c
	out := make([]groupResult, len(items))
	tx, err := c.beginGroup(ctx)
	if err != nil {
		return failAll(out, err)
	}
	defer c.rollback(ctx, tx)
	if len(items) == 1 {
		return s.runAlone(ctx, tx, items[0])
	}
	sp := &savepoints{tx: tx}
	sctx, cancel := c.storeCtx(ctx)
	err = sp.open(sctx)
	cancel()
	if err != nil {
		return failAll(out, fmt.Errorf("savepoint: %w", err))
	}
	for i, it := range items {
		if err := s.runOne(ctx, sp, it, &out[i], i < len(items)-1); err != nil {
			// The shared transaction is broken: what ran before is lost
			// too, through no fault of its own.
			for j := range items {
				if j != i && (j > i || out[j].err == nil) {
					out[j] = groupResult{err: fmt.Errorf("group-mate broke the transaction: %w", err), bystander: true}
				}
			}
			out[i] = groupResult{err: err}
			return out
		}
	}
	cctx, cspan := c.tracer.Start(ctx, "idemq commit group", groupLinks(items))
	defer cspan.End()
	if err := c.commit(cctx, tx); err != nil {
		// The commit's fate is unknown: the keys are released (a no-op for
		// those it did complete) and retried; a retry is a duplicate if it
		// committed.
		cspan.SetStatus(codes.Error, redact.Error(err))
		return failAll(out, fmt.Errorf("commit: %w", err))
	}
	return out
}

// runAlone runs a group of one: the handler in tx, then the key's
// completion and the commit in a span "idemq complete" of the delivery's
// trace.
func (s isolated) runAlone(ctx context.Context, tx pgx.Tx, it *item) []groupResult {
	c := s.c
	result, err := c.call(it, tx)
	if err != nil {
		return []groupResult{{err: err}}
	}
	cctx, cspan := c.tracer.Start(it.ctx, "idemq complete")
	defer cspan.End()
	sctx, cancel := c.storeCtx(cctx)
	err = c.store.Complete(sctx, tx, it.lease, result)
	cancel()
	if err == nil {
		c.crashAt(it.ctx, kit.StageBeforeCommit, "", tx)
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

// runOne runs one item's handler above the newest savepoint and completes
// its key; with more items to come, the next savepoint is opened in the same
// round trip as the completion. The item's own failure (its handler's error,
// a lost lease) rolls back to the savepoint and is recorded in r; a returned
// error means the shared transaction itself is broken.
func (s isolated) runOne(ctx context.Context, sp *savepoints, it *item, r *groupResult, more bool) error {
	c := s.c
	result, err := c.call(it, sp.tx)
	if err == nil {
		cctx, cancel := c.storeCtx(ctx)
		err = sp.completeAndOpen(cctx, c.store, it.lease, result, more)
		cancel()
	}
	if err != nil {
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
// the group runs again under the fallback (isolated), where only the
// failing item fails. A failed commit fails the group instead: its outcome
// is unknown, so nothing runs again.
type whole struct {
	c        *Consumer
	batch    bool
	fallback strategy
}

func (s whole) run(ctx context.Context, items []*item) []groupResult {
	if len(items) == 1 {
		// Alone, whole and isolated are the same, and a failure must not run
		// the handler twice.
		return s.fallback.run(ctx, items)
	}
	if out, ok := s.try(ctx, items); ok {
		return out
	}
	return s.fallback.run(ctx, items)
}

func (s whole) try(ctx context.Context, items []*item) ([]groupResult, bool) {
	tx, err := s.c.beginGroup(ctx)
	if err != nil {
		return nil, false
	}
	defer s.c.rollback(ctx, tx)
	out, err := s.commitWhole(ctx, tx, items)
	return out, err == nil
}

// commitWhole runs the group's user code in tx, completes every key with one
// statement (for keys tx holds, only the results that differ from the
// presumed one) and commits. An error means nothing committed and nothing
// is decided: a handler failed, a lease was lost or the completion failed,
// and the group must run again another way. A failed commit is an outcome
// (unknown: every item fails and is retried), not an error.
func (s whole) commitWhole(ctx context.Context, tx pgx.Tx, items []*item) ([]groupResult, error) {
	c := s.c
	results, err := s.handle(ctx, items, tx)
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
func (s whole) handle(ctx context.Context, items []*item, tx pgx.Tx) ([]dedup.Result, error) {
	if s.batch {
		return s.c.callBatch(ctx, items, tx)
	}
	results := make([]dedup.Result, len(items))
	for i, it := range items {
		var err error
		if results[i], err = s.c.call(it, tx); err != nil {
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

// maxSavepointGroup is the largest savepoint group that stays within the
// subtransactions a Postgres backend caches (PGPROC_MAX_CACHED_SUBXIDS):
// beyond it, every session's snapshots must look subtransactions up on disk
// while the group runs.
const maxSavepointGroup = 64

// savepoints is the stack of savepoints of an isolated group: each item runs
// above the newest one, which its failure rolls back to (and which then
// serves the next item); its success opens the next.
type savepoints struct {
	tx pgx.Tx
	n  int
}

func (sp *savepoints) name(n int) string { return "idemq_item_" + strconv.Itoa(n) }

func (sp *savepoints) open(ctx context.Context) error {
	if _, err := sp.tx.Exec(ctx, "SAVEPOINT "+sp.name(sp.n+1)); err != nil {
		return err
	}
	sp.n++
	return nil
}

func (sp *savepoints) rollback(ctx context.Context) error {
	_, err := sp.tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp.name(sp.n))
	return err
}

// completeAndOpen completes the key and, when open, opens the next
// savepoint: one round trip. A failure of either leaves the newest
// savepoint where it was (a lease lost after the next one was opened is
// undone by the rollback to the older one).
func (sp *savepoints) completeAndOpen(ctx context.Context, store *dedup.Store, l *dedup.Lease, r dedup.Result, open bool) error {
	b := &pgx.Batch{}
	if err := store.QueueComplete(b, l, r); err != nil {
		return err
	}
	if open {
		b.Queue("SAVEPOINT " + sp.name(sp.n+1))
	}
	if err := sp.tx.SendBatch(ctx, b).Close(); err != nil {
		return err
	}
	if open {
		sp.n++
	}
	return nil
}
