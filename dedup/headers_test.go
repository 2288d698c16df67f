package dedup_test

import (
	"context"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/dedup"
)

// A result's headers are stored with its code and body and come back to
// duplicates, from Complete, QueueComplete and CompleteBatch alike; a result
// without headers reads back as none.
func TestResultHeadersAreStoredAndReplayed(t *testing.T) {
	t.Parallel()
	store, pool := newStore(t, 4, nil)
	ctx := context.Background()
	headers := map[string][]string{"Content-Type": {"application/json"}, "Location": {"/payments/1"}, "Set-Cookie": {"a=1", "b=2"}}

	complete := map[string]func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error{
		"Complete": func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error { return store.Complete(ctx, tx, l, r) },
		"QueueComplete": func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error {
			b := &pgx.Batch{}
			if err := store.QueueComplete(b, l, r); err != nil {
				return err
			}
			return tx.SendBatch(ctx, b).Close()
		},
		"CompleteBatch": func(tx pgx.Tx, l *dedup.Lease, r dedup.Result) error {
			lost, err := store.CompleteBatch(ctx, tx, []*dedup.Lease{l}, []dedup.Result{r})
			if err == nil && len(lost) > 0 {
				t.Fatalf("lost %d leases", len(lost))
			}
			return err
		},
	}
	for name, fn := range complete {
		for _, want := range []map[string][]string{headers, nil} {
			c := claim("headers-"+name+"-"+map[bool]string{true: "none", false: "some"}[want == nil], "{}")
			r := mustReserve(t, store, c, dedup.Acquired)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return fn(tx, r.Lease, dedup.Result{Outcome: dedup.OutcomeOK, Code: 201, Headers: want, Response: []byte(`{"id":1}`)})
			})
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			dup := mustReserve(t, store, c, dedup.Duplicate)
			if got := dup.Record.Result.Headers; !reflect.DeepEqual(got, want) {
				t.Errorf("%s: headers = %v, want %v", name, got, want)
			}
		}
	}
}
