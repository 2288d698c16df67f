package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/jackc/pgx/v5"
)

// runInTx is the whole-group modes' path (batch handlers, optimistic
// groups; see Config.SeparateReservations): the group's keys are reserved
// inside the group's own transaction (dedup.ReserveBatchTx, which writes
// each row completed with the presumed default result), the handlers run
// (whole.handle), the results that differ are recorded, and ONE commit
// makes the reservations, the effects and the completions durable
// together. Until then no one else sees the reservations, and any other
// reservation of those keys waits for the commit (and finds a duplicate)
// or the rollback (and claims the key); no heartbeat is needed, and a
// worker that dies takes its reservations with it.
//
// Nothing is settled before the commit. If anything fails first (the
// reservation, the handler, the completion), the transaction rolls back and
// runInTx returns false, with every item as it was: the caller then claims
// and runs the group the usual way (a separate reservation, then each
// delivery alone), where each item's own error decides its outcome.
func (c *Consumer) runInTx(ctx context.Context, s *session, items []*item) bool {
	if len(items) < 2 {
		return false // alone, a failure must not run the handler twice
	}
	tx, err := c.beginHeld(ctx)
	if err != nil {
		return false
	}
	defer c.rollback(ctx, tx)
	claims := make([]dedup.Claim, len(items))
	for i, it := range items {
		claims[i] = it.claim
	}
	rctx, cancel := c.storeCtx(ctx)
	rctx, rspan := c.tracer.Start(rctx, "idemq reserve batch", groupLinks(items))
	rspan.SetAttributes(attribute.Int("idemq.batch.size", len(claims)), attribute.Bool("idemq.reserve.in_tx", true))
	t0 := time.Now()
	res, err := c.store.ReserveBatchTx(rctx, tx, claims)
	c.metrics.reserveTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
	rspan.End()
	cancel()
	if err != nil {
		return false
	}
	var acquired, others []*item
	var otherRes []dedup.Reservation
	for i, it := range items {
		if res[i].Decision == dedup.Acquired {
			c.acquire(it, res[i].Lease)
			acquired = append(acquired, it)
			continue
		}
		others = append(others, it)
		otherRes = append(otherRes, res[i])
	}
	var results []groupResult
	if len(acquired) > 0 {
		done := c.handling(ctx, acquired)
		t0 := time.Now()
		results, err = c.strategy.(whole).commitWhole(ctx, tx, acquired)
		c.metrics.handlerTime.Record(ctx, time.Since(t0).Seconds(), c.metrics.with())
		done()
		if errors.Is(err, ErrStepInBatch) && c.stepsSeen.CompareAndSwap(false, true) {
			// The handlers run steps, which need leases others can see:
			// from now on every group reserves separately.
			c.log.Info("the handler runs steps: groups reserve their keys separately from now on")
		}
		if err != nil {
			return false
		}
	}
	for i, it := range others {
		it.span.AddEvent("idemq reserve", trace.WithAttributes(attribute.String("idemq.decision", otherRes[i].Decision.String())))
		c.decide(s, it, otherRes[i])
	}
	for _, it := range acquired {
		it.span.AddEvent("idemq reserve", trace.WithAttributes(attribute.String("idemq.decision", dedup.Acquired.String())))
	}
	// A failed commit left nothing to release: the held keys rolled back.
	c.settle(s, acquired, results)
	return true
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
