package conformance_test

import (
	"testing"

	"github.com/idemq/idemq/internal/conformance"
	"github.com/idemq/idemq/internal/testdb"
)

// TestConformance runs the protocol's scenarios against every door: the
// HTTP middleware and the consumer in each mode, in parallel, each door on
// a schema and a queue of its own.
func TestConformance(t *testing.T) {
	// One pool for every door: the doors share the database's connections
	// with the other packages' tests.
	pool := testdb.Pool(t, 32)
	t.Run("http", func(t *testing.T) {
		t.Parallel()
		conformance.Run(t, conformance.NewHTTPDoor(pool, false))
	})
	t.Run("http/separate", func(t *testing.T) {
		t.Parallel()
		conformance.Run(t, conformance.NewHTTPDoor(pool, true))
	})
	for _, m := range conformance.Modes() {
		t.Run("consumer/"+string(m), func(t *testing.T) {
			t.Parallel()
			conformance.Run(t, conformance.NewConsumerDoor(pool, m))
		})
	}
}
