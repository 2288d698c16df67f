// Package keystore is the runtime's side of the key store: the reservations
// made inside a caller's transaction and the batch forms of reserve,
// complete, extend and release, with which the consumer holds a group's
// keys in a few statements. They are the consumer's protocol, not what a
// user of the store calls, so dedup.Store does not show them: Of gives them
// for a store, to the packages of this module.
package keystore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/keystore/link"
)

// Keys is the runtime's protocol on one store. Every write is fenced by the
// leases' tokens, as the store's own are.
type Keys interface {
	// ReserveTx is Reserve inside the caller's transaction: the new row (or
	// the takeover) is visible to others only once tx commits, and until
	// then its row lock makes any other reservation of the key wait for
	// tx's end. The row is written as it will be after a Complete with the
	// default result (completed, ok, no response), so that a successful
	// operation writes it once; Complete then records any other result.
	// Commit only after Complete: a transaction that commits without it
	// leaves the key completed with the default result. The lease is
	// HeldByTransaction: it needs no heartbeat, and a rollback gives it up.
	ReserveTx(ctx context.Context, tx pgx.Tx, c dedup.Claim) (dedup.Reservation, error)
	// TryReserveTx is ReserveTx for a caller that must not wait for another
	// transaction holding the key (a request answered 409 at once): the
	// statement takes the key's transaction-scoped advisory lock and writes
	// only with it, in one round trip. When another transaction holds the
	// lock, the answer is Refusal's.
	TryReserveTx(ctx context.Context, tx pgx.Tx, c dedup.Claim) (dedup.Reservation, error)
	// CompleteCommit completes l's key with r in tx and commits tx in one
	// round trip, the completion failing the transaction when the lease
	// was lost (ErrLeaseLost) so that the COMMIT behind it cannot commit
	// the effects alone. On nil, tx is over but pgx does not know it: do
	// not Commit or Rollback it; release its connection. On an error, roll
	// it back.
	CompleteCommit(ctx context.Context, tx pgx.Tx, l *dedup.Lease, r dedup.Result) error
	// Refusal is the answer a reservation of c gets from the key's
	// committed row, without reserving it, for a caller that knows another
	// transaction holds the key: Duplicate or KeyReuse when the row is
	// completed (or names another operation), else Busy. It reads in tx.
	Refusal(ctx context.Context, tx pgx.Tx, c dedup.Claim) (dedup.Reservation, error)
	// ReserveBatch reserves many keys with ONE atomic statement, with the
	// semantics and fencing of Reserve; the answers are in the order of
	// claims, whose scopes must be distinct.
	ReserveBatch(ctx context.Context, claims []dedup.Claim) ([]dedup.Reservation, error)
	// ReserveBatchTx is ReserveBatch inside the caller's transaction (see
	// ReserveTx), so that a group's reservations, effects and completions
	// commit with one COMMIT.
	ReserveBatchTx(ctx context.Context, tx pgx.Tx, claims []dedup.Claim) ([]dedup.Reservation, error)
	// QueueComplete queues the completion of l's key on b, to be sent on
	// the transaction that holds the handler's effects; the queued
	// statement reports ErrLeaseLost through the batch results.
	QueueComplete(b *pgx.Batch, l *dedup.Lease, r dedup.Result) error
	// CompleteBatch completes many keys inside tx with one statement, each
	// fenced by its own token, and returns the leases that were lost (the
	// caller then rolls back, or back to a savepoint).
	CompleteBatch(ctx context.Context, tx pgx.Tx, leases []*dedup.Lease, results []dedup.Result) (lost []*dedup.Lease, err error)
	// ExtendBatch extends many leases with one statement and returns the
	// ones lost; a lease whose row another transaction holds locked is
	// left as it is, neither extended nor lost. dedup.Heartbeat beats with it.
	ExtendBatch(ctx context.Context, leases []*dedup.Lease, d time.Duration) (lost []*dedup.Lease, err error)
	// ReleaseBatch releases many keys with one statement, as Release does
	// each, and returns the leases that were already lost.
	ReleaseBatch(ctx context.Context, leases []*dedup.Lease, reasons []string) (lost []*dedup.Lease, err error)
	// ReleaseTx gives up keys tx holds (ReserveTx, ReserveBatchTx) after
	// their operations failed, while the rest of tx goes on.
	ReleaseTx(ctx context.Context, tx pgx.Tx, leases []*dedup.Lease, reasons []string) error
	// LeaseTx turns keys tx holds into leases others can see once tx
	// commits (new tokens, expiring d from now), for operations that go on
	// outside tx (a step).
	LeaseTx(ctx context.Context, tx pgx.Tx, leases []*dedup.Lease, d time.Duration) ([]*dedup.Lease, error)
	// HeaderKeys returns the keys of the schema's header_keys table, the
	// one that signs first (the latest signs_from) first. schema.Migrate
	// creates one random key, so that every worker of a schema shares it
	// without configuration. The error wraps dedup.ErrNotMigrated when the
	// table does not exist.
	HeaderKeys(ctx context.Context) ([]dedup.HeaderKey, error)
}

// Of returns the runtime's protocol on s.
func Of(s *dedup.Store) Keys {
	return link.Keys(s).(Keys)
}
