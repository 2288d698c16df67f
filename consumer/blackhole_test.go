package consumer_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
)

// A Postgres that drops packets (no RST, no FIN) must not stall a worker:
// whichever key-store call of whichever mode hangs, it times out within
// StoreTimeout (HandlerTimeout for what runs with the handler), every
// delivery is retried without an ack of an uncommitted effect, and once the
// network is back every key is applied exactly once. The proxy black-holes
// the database at the first time the worker sends the named call.
func TestBlackHoledPostgres(t *testing.T) {
	t.Parallel()
	const (
		begin    = "begin"
		commit   = "commit"
		complete = "complete"
	)
	triggers := map[string][]byte{
		begin:       testdb.SimpleQuery("begin"),
		commit:      testdb.SimpleQuery("commit"),
		"savepoint": testdb.SimpleQuery("SAVEPOINT idemq_item_1"),
		// The group's key completion (dedup.CompleteBatch), sent as text.
		complete: []byte("SET state = 'completed', outcome = c.outcome"),
		// A group that reserves its keys in its transaction begins it with
		// a guard, reserves the keys in it, and completes nothing when the
		// results are the presumed ones.
		"held begin":   []byte("SET LOCAL idle_in_transaction_session_timeout"),
		"held reserve": []byte("'completed', c.fingerprint"),
		// Alone, the single-key reservation.
		"held reserve one": []byte("'completed', $4::bytea"),
	}
	cases := []struct {
		mode mode
		call string
	}{
		{modeSingle, "held begin"}, {modeSingle, "held reserve one"}, {modeSingle, "savepoint"}, {modeSingle, commit},
		{modeSingleSeparate, commit},
		{modeGroup, "held begin"}, {modeGroup, "held reserve"}, {modeGroup, "savepoint"}, {modeGroup, commit},
		{modeGroupSeparate, begin}, {modeGroupSeparate, "savepoint"}, {modeGroupSeparate, commit},
		{modeOptimistic, "held begin"}, {modeOptimistic, "held reserve"}, {modeOptimistic, commit},
		{modeBatch, "held begin"}, {modeBatch, "held reserve"}, {modeBatch, commit},
		{modeOptimisticSeparate, begin}, {modeOptimisticSeparate, complete}, {modeOptimisticSeparate, commit},
		{modeBatchSeparate, begin}, {modeBatchSeparate, complete}, {modeBatchSeparate, commit},
	}
	for _, tc := range cases {
		t.Run(string(tc.mode)+"/"+tc.call, func(t *testing.T) {
			t.Parallel()
			testBlackHoled(t, tc.mode, triggers[tc.call])
		})
	}
}

func testBlackHoled(t *testing.T, m mode, trigger []byte) {
	const n = 4
	h := newHarness(t, m, func(c *consumer.Config) {
		c.Concurrency = 1
		c.Group.Size, c.Group.Linger = n, time.Second
		m.Apply(c) // groups of n, or of one in the single modes
		c.StoreTimeout, c.HandlerTimeout = time.Second, 2*time.Second
		c.Lease = 2 * time.Second
		c.MaxAttempts = 10 // retries while the database is away must not dead-letter
	})
	proxy := testdb.NewProxy(t)
	store, err := dedup.NewStore(proxy.Pool(t, 8), &dedup.Config{Schema: h.schema})
	if err != nil {
		t.Fatal(err)
	}
	h.store = store
	for i := range n {
		h.publish(keyOf(i, "dark"), `{"amount":1}`, nil)
	}
	proxy.BlackHoleOn(trigger)
	h.start(1, h.ledgerEffect)
	t.Cleanup(proxy.Restore) // before the consumer's stop, even after a failure
	select {
	case <-proxy.Tripped():
	case <-time.After(30 * time.Second):
		t.Fatalf("the worker never sent %q", trigger)
	}

	// Each call that hangs now ends within a second or two (StoreTimeout,
	// HandlerTimeout); a worker waiting on a context without a deadline
	// never settles its deliveries.
	evs := h.waitEvents(15*time.Second, "every delivery settled while Postgres is black-holed", func(evs []consumer.Event) bool {
		keys := map[string]bool{}
		for _, e := range evs {
			keys[e.KeyHash] = true
		}
		return len(keys) >= n
	})
	for _, e := range evs {
		if e.Outcome != consumer.OutcomeRetried && e.Outcome != consumer.OutcomeInProgress {
			t.Fatalf("outcome %s while the database is unreachable (err %v); want retried", e.Outcome, e.Err)
		}
	}

	proxy.Restore()
	h.waitEvents(60*time.Second, "every key applied after the network is back", func(evs []consumer.Event) bool {
		return finals(evs) >= n
	})
	eff := h.effects()
	for i := range n {
		if k := keyOf(i, "dark"); eff[k] != 1 {
			t.Fatalf("key %s has %d effects, want 1 (all: %v)", k, eff[k], eff)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if finals(h.events) != n {
		t.Fatalf("%d final outcomes for %d keys: %v", finals(h.events), n, countOutcomes(h.events))
	}
}
