package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/redact"
)

// A keyHolder is how a consumer holds the keys of a group while its
// handlers run. New picks it from the Config: held in the group's
// transaction (the default: the row lock is the lease, one commit per
// group) or leased (SeparateReservations, Steps: a lease others can see,
// reserved before the group's transaction and extended by a heartbeat).
type keyHolder interface {
	// begin opens the transaction the keys are reserved in: held, the
	// group's own; leased, none (nil).
	begin(ctx context.Context) (pgx.Tx, error)
	// reserve reserves the claims' keys with one statement, in tx when it
	// is not nil.
	reserve(ctx context.Context, tx pgx.Tx, claims []dedup.Claim) ([]dedup.Reservation, error)
	// watch keeps the items' keys while their handlers run; stop ends it.
	watch(ctx context.Context, items []*item) (stop func())
	// giveUp gives up in tx, before it commits, the keys tx holds whose
	// items failed, so that the commit leaves them released instead of
	// presumed completed; it reports whether it gave any up.
	giveUp(ctx context.Context, tx pgx.Tx, items []*item, results []groupResult) (bool, error)
	// release releases, once the group's transaction ended, the keys of
	// the items that failed, so that their retries take them over at once.
	release(ctx context.Context, items []*item, results []groupResult)
	// kept reports whether a group's keys outlive the rollback of its
	// transaction (leases do; held keys go with it).
	kept() bool
}

// newKeyHolder picks how the consumer holds its keys.
func (c *Consumer) newKeyHolder() keyHolder {
	if c.cfg.SeparateReservations {
		return leasedKeys{c}
	}
	return heldKeys{c}
}

// heldKeys are reserved in the group's transaction (see
// keystore.Keys.ReserveBatchTx): the reservations, the effects and the
// completions commit once.
type heldKeys struct{ c *Consumer }

func (k heldKeys) begin(ctx context.Context) (pgx.Tx, error) { return k.c.beginHeld(ctx) }

func (k heldKeys) reserve(ctx context.Context, tx pgx.Tx, claims []dedup.Claim) ([]dedup.Reservation, error) {
	if len(claims) > 1 {
		return k.c.protocol.ReserveBatchTx(ctx, tx, claims)
	}
	r, err := k.c.protocol.ReserveTx(ctx, tx, claims[0])
	return []dedup.Reservation{r}, err
}

// watch does nothing: the transaction's row locks are the leases.
func (heldKeys) watch(context.Context, []*item) func() { return func() {} }

func (k heldKeys) giveUp(ctx context.Context, tx pgx.Tx, items []*item, results []groupResult) (bool, error) {
	leases, reasons := k.c.failedKeys(items, results)
	if len(leases) == 0 {
		return false, nil
	}
	rctx, cancel := k.c.storeCtx(ctx)
	defer cancel()
	return true, k.c.protocol.ReleaseTx(rctx, tx, leases, reasons)
}

// release does nothing: the keys were given up in the transaction, or went
// with its rollback.
func (heldKeys) release(context.Context, []*item, []groupResult) {}

func (heldKeys) kept() bool { return false }

// leasedKeys are reserved with a statement of their own, as leases others
// can see, which one heartbeat extends while the group runs.
type leasedKeys struct{ c *Consumer }

func (leasedKeys) begin(context.Context) (pgx.Tx, error) { return nil, nil }

func (k leasedKeys) reserve(ctx context.Context, _ pgx.Tx, claims []dedup.Claim) ([]dedup.Reservation, error) {
	if len(claims) > 1 {
		return k.c.protocol.ReserveBatch(ctx, claims)
	}
	r, err := k.c.store.Reserve(ctx, claims[0])
	return []dedup.Reservation{r}, err
}

func (k leasedKeys) watch(ctx context.Context, items []*item) func() {
	return k.c.heartbeat(ctx, items)
}

// giveUp does nothing: the leases are released after the transaction.
func (leasedKeys) giveUp(context.Context, pgx.Tx, []*item, []groupResult) (bool, error) {
	return false, nil
}

// release releases the failed items' leases with one statement bounded by
// StoreTimeout (a lost lease has nothing to release).
func (k leasedKeys) release(ctx context.Context, items []*item, results []groupResult) {
	leases, reasons := k.c.failedKeys(items, results)
	if len(leases) == 0 {
		return
	}
	sctx, cancel := k.c.storeCtx(context.WithoutCancel(ctx))
	defer cancel()
	if _, err := k.c.protocol.ReleaseBatch(sctx, leases, reasons); err != nil {
		k.c.log.Warn("release keys failed; the leases will expire", "keys", len(leases), "err", redact.Error(err))
	}
}

func (leasedKeys) kept() bool { return true }
