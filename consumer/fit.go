package consumer

import "github.com/idemq/idemq/internal/wire"

// ReasonHeadersTooLarge is the dead-letter reason of a delivery whose copy
// cannot carry its headers in one frame of the connection's frame_max,
// even with idemq's own optional headers dropped and the error text cut.
// Its dead letter keeps the body and properties; the largest headers are
// dropped, and x-idemq-error names them.
const ReasonHeadersTooLarge = "headers_too_large"

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
