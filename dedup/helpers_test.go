package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/testdb"
)

// newStore migrates a fresh schema and returns a store over it.
func newStore(t testing.TB, maxConns int32, cfg *dedup.Config) (*dedup.Store, *pgxpool.Pool) {
	t.Helper()
	pool := testdb.Pool(t, maxConns)
	schemaName := testdb.Schema(t, pool)
	if err := schema.Migrate(context.Background(), pool, schemaName); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	c := cfg.WithDefaults()
	c.Schema = schemaName
	store, err := dedup.NewStore(pool, &c)
	if err != nil {
		t.Fatalf("new store: %v", err)
	}
	return store, pool
}

func claim(key string, body string) dedup.Claim {
	fp, _ := dedup.BodyFingerprint([]byte(body))
	return dedup.Claim{Scope: dedup.Scope{Consumer: "payments", Key: key}, Fingerprint: fp}
}

func mustReserve(t testing.TB, s *dedup.Store, c dedup.Claim, want dedup.Decision) dedup.Reservation {
	t.Helper()
	r, err := s.Reserve(context.Background(), c)
	if err != nil {
		t.Fatalf("reserve: %v", err)
	}
	if r.Decision != want {
		t.Fatalf("reserve decision = %s, want %s", r.Decision, want)
	}
	return r
}

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
