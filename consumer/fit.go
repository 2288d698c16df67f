package consumer

import "github.com/idemq/idemq/internal/wire"

// deathReserve is the room a retry copy of t leaves in its header frame for
// the broker's dead-lettering headers (wire.DeathReserve): one x-death
// entry for the work queue and for every tier.
func deathReserve(t Topology) int {
	queues := []string{t.Queue}
	for _, d := range t.Delays {
		queues = append(queues, t.TierName(d))
	}
	return wire.DeathReserve(t.DLX, queues)
}
