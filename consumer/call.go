package consumer

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// The one place that runs user code. Whatever the mode, a handler runs:
//   - under HandlerTimeout, counted per call (one Handler call for one
//     delivery, one BatchHandler call for its batch);
//   - in a context that ends when its lease is lost (see heartbeat);
//   - in a span "idemq handler", with the claim and the store's outbox in
//     its context (for outbox.Enqueue);
//   - on the runtime's transaction wrapped so that Commit and Rollback are
//     refused: the runtime commits, once, after completing the keys;
//   - with a panic recovered, stack included, as an infrastructure failure.

// groupTx is a group's transaction as the runtime hands it to user code:
// the handlers' view of it (handlerTx) and the outbox rows they enqueue on
// it, which the runtime writes with one statement before completing the
// keys (outbox.Deferred).
type groupTx struct {
	tx   pgx.Tx
	view handlerTx
	pend *outbox.Deferred
}

// newGroupTx wraps tx for user code; sp is the isolated group's savepoints
// (nil: none).
func newGroupTx(tx pgx.Tx, sp *savepoints) *groupTx {
	view := handlerTx{tx, sp}
	return &groupTx{tx: tx, view: view, pend: outbox.NewDeferred(view)}
}

// writeOutbox writes the outbox rows the group's handlers enqueued (those
// of handlers that succeeded), bounded by StoreTimeout.
func (c *Consumer) writeOutbox(ctx context.Context, g *groupTx) error {
	if g.pend.Len() == 0 {
		return nil
	}
	wctx, cancel := c.storeCtx(ctx)
	defer cancel()
	return g.pend.Write(wctx, g.tx)
}

// call runs the handler of one item in g and maps its return to the result
// to store (nil error) or the failure.
func (c *Consumer) call(it *item, g *groupTx) (dedup.Result, error) {
	ctx, cancel := context.WithTimeoutCause(it.hctx, c.cfg.HandlerTimeout, ErrHandlerTimeout)
	defer cancel()
	ctx, span := c.tracer.Start(ctx, "idemq handler")
	defer span.End()
	resp, err := c.safeCall(outbox.WithDeferred(c.withClaim(ctx, it.del), g.pend), g.view, it.del)
	if rej := (*RejectError)(nil); errors.As(err, &rej) {
		span.SetAttributes(attribute.String("idemq.reject_reason", rej.Reason))
	}
	result, err := storedResult(resp, err)
	if err != nil {
		err = withCause(ctx, err)
		span.SetStatus(codes.Error, redact.Error(err))
	}
	return result, err
}

// callBatch runs the batch handler over every item in tx. Its context ends
// when any item's lease is lost: the batch then fails and its items run
// isolated (runner.go), where only that item fails.
func (c *Consumer) callBatch(ctx context.Context, items []*item, g *groupTx) ([]dedup.Result, error) {
	ctx, lost := context.WithCancelCause(ctx)
	defer lost(nil)
	if c.holder.kept() { // leases, which the heartbeat may find lost
		for _, it := range items {
			hctx := it.hctx // the item's field is cleared when its handling ends
			stop := context.AfterFunc(hctx, func() { lost(context.Cause(hctx)) })
			defer stop()
		}
	}
	ctx, cancel := context.WithTimeoutCause(ctx, c.cfg.HandlerTimeout, ErrHandlerTimeout)
	defer cancel()
	ctx, span := c.tracer.Start(ctx, "idemq batch handler", groupLinks(items))
	defer span.End()
	span.SetAttributes(attribute.Int("idemq.batch.size", len(items)))
	dels := make([]*Delivery, len(items))
	for i, it := range items {
		dels[i] = it.del
	}
	resps, err := c.safeBatchCall(outbox.WithDeferred(ctx, g.pend), g.view, dels)
	if err == nil && len(resps) != len(items) {
		err = fmt.Errorf("batch handler returned %d responses for %d deliveries", len(resps), len(items))
	}
	if err != nil {
		err = withCause(ctx, err)
		span.SetStatus(codes.Error, redact.Error(err))
		span.AddEvent("idemq.batch_isolated")
		return nil, err
	}
	results := make([]dedup.Result, len(items))
	for i, r := range resps {
		results[i] = dedup.Result{Outcome: dedup.OutcomeOK, Code: r.Code, Response: r.Body}
	}
	return results, nil
}

// withCause adds why ctx ended (a lost lease, the handler timeout) to a
// handler's failure, so that errors.Is finds it.
func withCause(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); cause != nil && !errors.Is(err, cause) {
		return fmt.Errorf("%w (%w)", err, cause)
	}
	return err
}

// safeCall runs the handler, turning a panic into an infrastructure failure.
func (c *Consumer) safeCall(ctx context.Context, tx pgx.Tx, del *Delivery) (resp Response, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return c.handler(ctx, tx, del)
}

func (c *Consumer) safeBatchCall(ctx context.Context, tx pgx.Tx, ds []*Delivery) (resps []Response, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return c.batchHandler(ctx, tx, ds)
}

// ErrHandlerTx is what a handler's Commit or Rollback of the transaction it
// was given returns: the transaction belongs to the runtime.
var ErrHandlerTx = errors.New("the handler's transaction belongs to the runtime: it commits after completing the key, or rolls back")
