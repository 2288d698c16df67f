package idemhttp_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// The outbox messages of a guarded request wake the relays once the
// middleware committed its transaction, with no insert trigger; a request
// whose transaction rolls back notifies no one.
func TestOutboxMessagesWakeTheRelaysAfterTheCommit(t *testing.T) {
	t.Parallel()
	a := newAPI(t, idemhttp.Config{}, nil)
	ctx := context.Background()
	if _, err := a.pool.Exec(ctx, "DROP TRIGGER IF EXISTS outbox_notify ON "+pgx.Identifier{a.schema, "outbox"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	a.before = func(w http.ResponseWriter, r *http.Request) bool {
		if err := outbox.Enqueue(r.Context(), idemhttp.Tx(r), outbox.Message{RoutingKey: "orders", Body: []byte("created")}); err != nil {
			t.Errorf("enqueue: %v", err)
		}
		if r.Header.Get("X-Fail") != "" {
			panic("the handler fails after enqueueing")
		}
		return true
	}
	heard := listen(t, a.schema)
	next := func() string {
		t.Helper()
		select {
		case p := <-heard:
			return p
		case <-time.After(10 * time.Second):
			t.Fatal("no notification within 10s")
			return ""
		}
	}
	for i := range 3 {
		if rep := a.do("POST", "/orders", "wake-"+string(rune('a'+i)), `{"amount":5}`); rep.status != http.StatusCreated {
			t.Fatalf("status %d: %s", rep.status, rep.body)
		}
		if p := next(); p != "" {
			t.Fatalf("notification %q, want the outbox's", p)
		}
	}
	if rep := a.do("POST", "/orders", "wake-fail", `{"amount":5}`, "X-Fail", "1"); rep.status != http.StatusInternalServerError {
		t.Fatalf("status %d: %s", rep.status, rep.body)
	}
	if _, err := a.pool.Exec(ctx, "SELECT pg_notify($1, 'after')", outbox.ChannelName(a.schema)); err != nil {
		t.Fatal(err)
	}
	if p := next(); p != "after" {
		t.Fatalf("notification %q before the sentinel: the rolled-back request notified", p)
	}
	var rows int
	if err := a.pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{a.schema, "outbox"}.Sanitize()).Scan(&rows); err != nil || rows != 3 {
		t.Fatalf("%d outbox rows (%v), want the 3 committed", rows, err)
	}
}

// listen returns the notifications of schema's outbox channel until the
// test ends.
func listen(t *testing.T, schema string) <-chan string {
	t.Helper()
	return testdb.Listen(t, outbox.ChannelName(schema))
}
