package outbox

import (
	"bytes"
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testamqp"
	"github.com/idemq/idemq/internal/testdb"
)

// A claim takes rows in id order until their bodies would go over
// MaxBatchBytes (counted uncompressed, as the relay receives them), always
// at least one row; the rows it locked past the cut stay locked for its
// batch, and another relay's claim skips them (FOR UPDATE SKIP LOCKED).
func TestClaimStopsAtMaxBatchBytes(t *testing.T) {
	t.Parallel()
	const kib = 1 << 10
	pool := testdb.Pool(t, 4)
	schemaName := testdb.Schema(t, pool)
	ctx := context.Background()
	if err := schema.Migrate(ctx, pool, schemaName); err != nil {
		t.Fatal(err)
	}
	ob, err := New(pool, &Config{Schema: schemaName})
	if err != nil {
		t.Fatal(err)
	}
	// Compressible bodies: TOAST stores them in far fewer bytes.
	sizes := []int{100 * kib, 200 * kib, 300 * kib, 2048 * kib, 50 * kib}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, n := range sizes {
			if err := ob.Enqueue(ctx, tx, Message{RoutingKey: "q", Body: bytes.Repeat([]byte("x"), n)}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	r, err := NewRelay(ob, testamqp.URL(), &RelayConfig{MaxBatchBytes: 600 * kib})
	if err != nil {
		t.Fatal(err)
	}
	type batch struct {
		sizes   []int
		claimed int
		cut     bool
	}
	claim := func(tx pgx.Tx, limit int) batch {
		t.Helper()
		rows, claimed, cut, err := r.claim(ctx, tx, limit)
		if err != nil {
			t.Fatal(err)
		}
		b := batch{claimed: claimed, cut: cut}
		for _, w := range rows {
			b.sizes = append(b.sizes, len(w.body))
		}
		return b
	}
	check := func(what string, got, want batch) {
		t.Helper()
		if !slices.Equal(got.sizes, want.sizes) || got.claimed != want.claimed || got.cut != want.cut {
			t.Fatalf("%s: bodies %v, %d locked, cut %v; want %v, %d, %v", what, got.sizes, got.claimed, got.cut, want.sizes, want.claimed, want.cut)
		}
	}
	begin := func() pgx.Tx {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return tx
	}
	publish := func(n int) {
		t.Helper()
		if _, err := pool.Exec(ctx, "UPDATE "+pgx.Identifier{schemaName, "outbox"}.Sanitize()+
			" SET published_at = now() WHERE id IN (SELECT id FROM "+pgx.Identifier{schemaName, "outbox"}.Sanitize()+
			" WHERE published_at IS NULL ORDER BY id LIMIT $1)", n); err != nil {
			t.Fatal(err)
		}
	}

	// The count bound still applies below the byte bound.
	tx := begin()
	check("limit 2", claim(tx, 2), batch{sizes[:2], 2, false})
	_ = tx.Rollback(ctx)

	// 100+200+300 KiB fit in 600 KiB; the 2 MiB row is locked, not read.
	first := begin()
	check("first batch", claim(first, 4), batch{sizes[:3], 4, true})
	// Beside it, another relay skips what the first locked.
	other := begin()
	check("concurrent batch", claim(other, 100), batch{sizes[4:], 1, false})
	_ = other.Rollback(ctx)
	_ = first.Rollback(ctx)

	publish(3)
	tx = begin()
	check("oversized row", claim(tx, 100), batch{sizes[3:4], 2, true})
	_ = tx.Rollback(ctx)

	publish(1)
	tx = begin()
	check("last row", claim(tx, 100), batch{sizes[4:], 1, false})
	_ = tx.Rollback(ctx)
}
