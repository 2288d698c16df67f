package dedup

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The runtime's protocol moved to internal/keystore. These forwarders last
// until its callers in package consumer call keystore.Of.

// Deprecated: the consumer runtime's; use keystore.Of(s).ReserveTx.
func (s *Store) ReserveTx(ctx context.Context, tx pgx.Tx, c Claim) (Reservation, error) {
	return (*keys)(s).ReserveTx(ctx, tx, c)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).ReserveBatch.
func (s *Store) ReserveBatch(ctx context.Context, claims []Claim) ([]Reservation, error) {
	return (*keys)(s).ReserveBatch(ctx, claims)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).ReserveBatchTx.
func (s *Store) ReserveBatchTx(ctx context.Context, tx pgx.Tx, claims []Claim) ([]Reservation, error) {
	return (*keys)(s).ReserveBatchTx(ctx, tx, claims)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).QueueComplete.
func (s *Store) QueueComplete(b *pgx.Batch, l *Lease, r Result) error {
	return (*keys)(s).QueueComplete(b, l, r)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).CompleteBatch.
func (s *Store) CompleteBatch(ctx context.Context, tx pgx.Tx, leases []*Lease, results []Result) ([]*Lease, error) {
	return (*keys)(s).CompleteBatch(ctx, tx, leases, results)
}

// Deprecated: the consumer runtime's; use Heartbeat or keystore.Of(s).ExtendBatch.
func (s *Store) ExtendBatch(ctx context.Context, leases []*Lease, d time.Duration) ([]*Lease, error) {
	return (*keys)(s).ExtendBatch(ctx, leases, d)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).ReleaseBatch.
func (s *Store) ReleaseBatch(ctx context.Context, leases []*Lease, reasons []string) ([]*Lease, error) {
	return (*keys)(s).ReleaseBatch(ctx, leases, reasons)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).ReleaseTx.
func (s *Store) ReleaseTx(ctx context.Context, tx pgx.Tx, leases []*Lease, reasons []string) error {
	return (*keys)(s).ReleaseTx(ctx, tx, leases, reasons)
}

// Deprecated: the consumer runtime's; use keystore.Of(s).LeaseTx.
func (s *Store) LeaseTx(ctx context.Context, tx pgx.Tx, leases []*Lease, d time.Duration) ([]*Lease, error) {
	return (*keys)(s).LeaseTx(ctx, tx, leases, d)
}
