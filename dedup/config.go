package dedup

import (
	"cmp"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/idemq/idemq/dedup/schema"
	"github.com/idemq/idemq/internal/sweep"
)

// Defaults used where a Config leaves a field zero.
const (
	DefaultLease     = 30 * time.Second
	DefaultRetention = 24 * time.Hour
	// DefaultGCBatchSize is the most keys one GC statement deletes: small
	// batches keep each commit's WAL flush short (docs/operations.md).
	DefaultGCBatchSize = sweep.DefaultBatch
	// DefaultGCPause is the pause `idemq gc` takes after each full batch
	// (GCOptions.Pause): it keeps GC from raising the workers' p99 while it
	// works off a backlog (docs/operations.md).
	DefaultGCPause = sweep.DefaultPause
	// MaxKeyLen is the longest key accepted, in bytes.
	MaxKeyLen = 255
	// maxReserveRounds bounds the reserve loop when the row vanishes (GC) or
	// its lease expires between the upsert and the read.
	maxReserveRounds = 5
)

// Config configures a Store. A nil *Config means all defaults.
type Config struct {
	// Schema is the Postgres schema holding the tables (created by
	// schema.Migrate). Default schema.Default.
	Schema string
	// Lease is how long a reservation stays valid without a heartbeat.
	// Default 30s: a crashed worker's key is taken over within about that long.
	Lease time.Duration
	// Retention is how long completed keys are kept, and so how long a
	// duplicate is recognised. Default 24h. It must exceed the longest
	// redelivery horizon of the queues feeding the store.
	Retention time.Duration
	// GCBatchSize bounds the rows one GC statement deletes. Default 1000.
	GCBatchSize int
	// DurableReservations makes reservations, releases and heartbeats wait
	// for the WAL flush. Off by default: a reservation lost in a database
	// crash only makes a key look absent, and the fenced completion turns
	// that into a retry, never a double effect. Completions are always as
	// durable as the handler's transaction.
	DurableReservations bool
	// MeterProvider makes the metrics of GC (idemq.gc.*, see
	// docs/observability.md). Default otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// HashKeys stores SHA-256 of each key instead of the key itself, so that
	// personal data put into keys by careless publishers stays out of the table.
	HashKeys bool
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c *Config) WithDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	out.Schema = cmp.Or(out.Schema, schema.Default)
	out.Lease = cmp.Or(out.Lease, DefaultLease)
	out.Retention = cmp.Or(out.Retention, DefaultRetention)
	out.GCBatchSize = cmp.Or(out.GCBatchSize, DefaultGCBatchSize)
	return out
}

func (c Config) validate() error {
	if err := schema.Validate(c.Schema); err != nil {
		return err
	}
	if c.Lease < time.Second {
		return fmt.Errorf("lease %s is shorter than 1s", c.Lease)
	}
	if c.Retention < c.Lease {
		return fmt.Errorf("retention %s is shorter than the lease %s", c.Retention, c.Lease)
	}
	if c.GCBatchSize < 1 {
		return fmt.Errorf("gc batch size %d must be positive", c.GCBatchSize)
	}
	return nil
}
