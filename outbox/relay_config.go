package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Defaults used where a RelayConfig leaves a field zero.
const (
	DefaultBatchSize      = 100
	DefaultMaxBatchBytes  = 16 << 20 // 16 MiB
	DefaultPollInterval   = time.Second
	DefaultConfirmTimeout = 10 * time.Second
	DefaultMaxReturns     = 5
	// DefaultLanes is the default RelayConfig.Lanes.
	DefaultLanes             = 4
	DefaultRetryInitial      = time.Second
	DefaultRetryMax          = 5 * time.Minute
	DefaultReconnectInitial  = 100 * time.Millisecond
	DefaultReconnectMax      = 30 * time.Second
	DefaultConnectionName    = "idemq-outbox-relay"
	DefaultDialTimeout       = 10 * time.Second
	DefaultExchangeCacheTime = 30 * time.Second
)

// DialFunc opens a broker connection for the relay.
type DialFunc func(ctx context.Context) (*amqp.Connection, error)

// RelayConfig configures a Relay. A nil *RelayConfig means all defaults. The
// schema is the Outbox's (Config.Schema).
type RelayConfig struct {
	// ConnectionName is the client-provided name of the relay's broker
	// connection, shown by RabbitMQ. Default "idemq-outbox-relay".
	ConnectionName string
	// Dial, when set, replaces dialling the URL given to NewRelay.
	Dial DialFunc
	// BatchSize is the most rows claimed, published and confirmed together. Default 100.
	BatchSize int
	// Lanes is how many batches are in flight at once: each lane claims,
	// publishes, waits for the confirms of and marks its own batch, on a
	// broker connection of its own, while the others do the same (rows are
	// claimed with SKIP LOCKED, so two lanes never take one row; ordering keys
	// keep their order as with several relays). Default 4.
	Lanes int
	// MaxBatchBytes bounds the body bytes of one batch, which the relay
	// holds in memory until its confirms: rows are taken in id order until
	// the next body would go over it; a row larger than the bound still goes
	// out, alone. Headers and properties are not counted. Default 16 MiB.
	MaxBatchBytes int
	// PollInterval is how often the relay looks for rows when no NOTIFY
	// wakes it (a missed notification, rows whose backoff ended). Default 1s.
	PollInterval time.Duration
	// NoNotify turns LISTEN/NOTIFY off: the relay only polls.
	NoNotify bool
	// ListenConfig is where the relay's LISTEN connection connects: nil,
	// the pool's own connection config. A LISTEN needs a session, which a
	// transaction pooler (PgBouncer's transaction mode) does not keep:
	// through one, give a config that reaches Postgres directly. Each
	// LISTEN connection checks that it hears a notification of its own sent
	// through the pool; one that does not logs why and the relay polls,
	// trying a LISTEN again every minute
	// (docs/operations.md, "PgBouncer").
	ListenConfig *pgx.ConnConfig
	// ConfirmTimeout bounds the wait for the confirms of one batch. The rows
	// not confirmed in time are retried later and the broker connection is
	// opened anew. Default 10s.
	ConfirmTimeout time.Duration
	// MaxReturns is how many times a message may come back unroutable (or
	// find its exchange missing) before it is parked. Default 5.
	MaxReturns int
	// RetryInitial and RetryMax bound the exponential backoff of a row whose
	// publish failed (returned, nacked, not confirmed). Defaults 1s and 5m.
	RetryInitial, RetryMax time.Duration
	// ReconnectInitial and ReconnectMax bound the backoff between broker
	// (and LISTEN connection) reconnects. Defaults 100ms and 30s.
	ReconnectInitial, ReconnectMax time.Duration
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// TracerProvider makes the publish spans. Default otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// MeterProvider makes the relay's metrics. Default otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Propagator writes the publish span's context into the message headers.
	// Default: the global propagator once a program has set one, else W3C
	// TraceContext + Baggage, so the next consumer continues the trace.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c *RelayConfig) WithDefaults() RelayConfig {
	var out RelayConfig
	if c != nil {
		out = *c
	}
	out.ConnectionName = cmp.Or(out.ConnectionName, DefaultConnectionName)
	out.BatchSize = cmp.Or(out.BatchSize, DefaultBatchSize)
	out.Lanes = cmp.Or(out.Lanes, DefaultLanes)
	out.MaxBatchBytes = cmp.Or(out.MaxBatchBytes, DefaultMaxBatchBytes)
	out.PollInterval = cmp.Or(out.PollInterval, DefaultPollInterval)
	out.ConfirmTimeout = cmp.Or(out.ConfirmTimeout, DefaultConfirmTimeout)
	out.MaxReturns = cmp.Or(out.MaxReturns, DefaultMaxReturns)
	out.RetryInitial = cmp.Or(out.RetryInitial, DefaultRetryInitial)
	out.RetryMax = cmp.Or(out.RetryMax, DefaultRetryMax)
	out.ReconnectInitial = cmp.Or(out.ReconnectInitial, DefaultReconnectInitial)
	out.ReconnectMax = cmp.Or(out.ReconnectMax, DefaultReconnectMax)
	return out
}

func (c RelayConfig) validate() error {
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		return fmt.Errorf("batch size %d: want 1 to 10000", c.BatchSize)
	}
	if c.Lanes < 1 || c.Lanes > 64 {
		return fmt.Errorf("lanes %d: want 1 to 64", c.Lanes)
	}
	if c.MaxBatchBytes < 0 {
		return fmt.Errorf("max batch bytes %d must not be negative", c.MaxBatchBytes)
	}
	if c.MaxReturns < 1 {
		return fmt.Errorf("max returns %d must be positive", c.MaxReturns)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"poll interval", c.PollInterval}, {"confirm timeout", c.ConfirmTimeout},
		{"retry initial", c.RetryInitial}, {"retry max", c.RetryMax},
		{"reconnect initial", c.ReconnectInitial}, {"reconnect max", c.ReconnectMax},
	} {
		if d.v <= 0 {
			return fmt.Errorf("%s %s must be positive", d.name, d.v)
		}
	}
	if c.RetryMax < c.RetryInitial {
		return errors.New("retry max is shorter than retry initial")
	}
	if c.ReconnectMax < c.ReconnectInitial {
		return errors.New("reconnect max is shorter than reconnect initial")
	}
	return nil
}

// ChannelName is the LISTEN/NOTIFY channel on which inserts into the outbox
// of schema are announced: "<schema>_outbox", the schema cut to 56 bytes.
func ChannelName(schema string) string {
	return schema[:min(len(schema), 56)] + "_outbox"
}
