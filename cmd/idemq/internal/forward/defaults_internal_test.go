package forward

import (
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// A stage left to its defaults runs groups of DefaultGroupSize, optimistic,
// and relay batches of DefaultRelayBatchSize; what a caller sets is kept.
func TestStageSizesItsGroupsAndRelayBatches(t *testing.T) {
	store, err := dedup.NewStore(testdb.Pool(t, 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	base := consumer.Config{URL: "amqp://127.0.0.1:5672/", Queue: "q", Name: "fwd", NoReply: true}
	for _, tc := range []struct {
		name              string
		group, relayBatch int
		wantGroup, wantRB int
	}{
		{"defaults", 0, 0, DefaultGroupSize, DefaultRelayBatchSize},
		{"set", 8, 50, 8, 50},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ccfg := base
			ccfg.Group.Size = tc.group
			s, err := New(store, Config{Consumer: ccfg, RoutingKey: "out", Relay: outbox.RelayConfig{BatchSize: tc.relayBatch}})
			if err != nil {
				t.Fatal(err)
			}
			got := s.consumer.Config()
			if got.Group.Size != tc.wantGroup || !got.Group.Optimistic {
				t.Errorf("consumer groups: size %d optimistic %v, want %d optimistic", got.Group.Size, got.Group.Optimistic, tc.wantGroup)
			}
			if rb := s.relay.Config().BatchSize; rb != tc.wantRB {
				t.Errorf("relay batch %d, want %d", rb, tc.wantRB)
			}
		})
	}
}
