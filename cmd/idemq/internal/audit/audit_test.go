package audit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/internal/testdb"
)

// An action is recorded when it starts and completed when it ends, with the
// digests of the keys it moved; List finds it by action and by key.
func TestRecordAndList(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	r := audit.New(pool, deduptest.Schema(t, pool))
	ctx := context.Background()

	id, err := r.Begin(ctx, audit.Action{Actor: "alice", Via: audit.ViaUI, Action: audit.ActionReplay, Target: "payments", What: "2 chosen dead letter(s)"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := r.List(ctx, audit.Filter{})
	if err != nil || len(got) != 1 || got[0].Result != audit.ResultRunning || got[0].EndedAt != nil || got[0].Actor != "alice" {
		t.Fatalf("while it runs: %+v %v", got, err)
	}
	if err := r.End(ctx, id, 2, "ok", []string{audit.KeyDigest("order-1"), audit.KeyDigest("order-2")}); err != nil {
		t.Fatal(err)
	}
	if err := r.Record(ctx, audit.Action{Actor: "bob", Via: audit.ViaCLI, Action: audit.ActionSkip, Target: "ledger", What: "acct-1: 3 → 5"}, 1, "ok"); err != nil {
		t.Fatal(err)
	}

	all, err := r.List(ctx, audit.Filter{})
	if err != nil || len(all) != 2 || all[0].Action.Action != audit.ActionSkip || all[1].Count != 2 || all[1].Result != "ok" || all[1].EndedAt == nil {
		t.Fatalf("all: %+v %v", all, err)
	}
	byKey, err := r.List(ctx, audit.Filter{KeyDigest: audit.KeyDigest("order-2")})
	if err != nil || len(byKey) != 1 || byKey[0].ID != id {
		t.Fatalf("by key: %+v %v", byKey, err)
	}
	if none, err := r.List(ctx, audit.Filter{KeyDigest: audit.KeyDigest("order-3")}); err != nil || len(none) != 0 {
		t.Fatalf("another key: %+v %v", none, err)
	}
	if skips, err := r.List(ctx, audit.Filter{Action: audit.ActionSkip}); err != nil || len(skips) != 1 || skips[0].Actor != "bob" {
		t.Fatalf("skips: %+v %v", skips, err)
	}
	if later, err := r.List(ctx, audit.Filter{Since: time.Now().Add(time.Hour)}); err != nil || len(later) != 0 {
		t.Fatalf("since an hour ahead: %+v %v", later, err)
	}
}

// A store without migration 012 says which migration it lacks.
func TestNoTableNamesTheMigration(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, 2)
	r := audit.New(pool, testdb.Schema(t, pool))
	if _, err := r.Begin(context.Background(), audit.Action{Actor: "a", Via: audit.ViaCLI, Action: audit.ActionReplay, Target: "q", What: "w"}); !errors.Is(err, audit.ErrNoTable) {
		t.Fatalf("begin without the table: %v, want ErrNoTable", err)
	}
}
