package consumer

import (
	"runtime"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer/internal/kit"
)

// The crash test kit (consumertest.CrashPoints) runs real consumers and
// crashes them at the stages of their pipeline: the stages call crashAt,
// which does nothing unless the kit set a hook (kit.SetCrash).

func init() {
	kit.SetCrash = func(c any, h kit.Hook) { c.(*Consumer).crash = h }
}

// stage tells the test kit's hook that the items reached stage together
// (a no-op in a consumer the kit does not run): the pipeline's boundaries
// (after the reservation, before and after the commit) call it from
// Consumer.execute and Consumer.commit, a step's from Delivery.Step. When
// the hook asks for a crash, the items die here as their process would:
// the transactions in txs (those they hold open) are abandoned, their
// connections closed under them without COMMIT or ROLLBACK, so that
// Postgres rolls them back; and the goroutine exits, running only its
// deferred calls (which stop the heartbeat), so nothing is released,
// published or acked: the leases expire and the broker redelivers. The
// hook itself closed the broker connection.
func (c *Consumer) stage(stage kit.Stage, items []*item, txs ...pgx.Tx) {
	c.crashAt(stage, "", items, txs...)
}

// stageCommitting is stage for the items whose handlers succeeded: those
// the group's commit commits.
func (c *Consumer) stageCommitting(stage kit.Stage, items []*item, results []groupResult, txs ...pgx.Tx) {
	if c.crash != nil {
		c.stage(stage, committing(items, results), txs...)
	}
}

// succeeded reports whether any item's handler succeeded.
func succeeded(results []groupResult) bool {
	for _, r := range results {
		if r.err == nil {
			return true
		}
	}
	return false
}

// crashAt is stage for the items at a step (named step) or a boundary.
func (c *Consumer) crashAt(stage kit.Stage, step string, items []*item, txs ...pgx.Tx) {
	if c.crash == nil || len(items) == 0 {
		return
	}
	at := kit.At{Stage: stage, Step: step}
	for _, it := range items {
		tid := ""
		if sc := trace.SpanContextFromContext(it.ctx); sc.HasTraceID() {
			tid = sc.TraceID().String()
		}
		at.Deliveries = append(at.Deliveries, it.d)
		at.TraceIDs = append(at.TraceIDs, tid)
	}
	if !c.crash(at) {
		return
	}
	for _, tx := range txs {
		if tx != nil {
			_ = tx.Conn().PgConn().Conn().Close()
		}
	}
	runtime.Goexit()
}

// settled tells the test kit the outcome of it (a no-op in a consumer the
// kit does not run).
func (c *Consumer) settled(it *item, outcome Outcome) {
	if c.crash != nil {
		c.crash(kit.At{Stage: kit.StageSettled, Deliveries: []*amqp.Delivery{it.d}, TraceIDs: []string{""}, Outcome: string(outcome)})
	}
}

// committing returns the items of an isolated group whose handlers
// succeeded: those the group's commit commits.
func committing(items []*item, out []groupResult) []*item {
	var ok []*item
	for i, it := range items {
		if out[i].err == nil {
			ok = append(ok, it)
		}
	}
	return ok
}
