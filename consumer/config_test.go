package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/testdb"
)

// The bounds on waits and memory have defaults, and a negative one is refused.
func TestConfigBounds(t *testing.T) {
	t.Parallel()
	c := (&consumer.Config{}).WithDefaults()
	if c.StoreTimeout != consumer.DefaultStoreTimeout || c.MaxInFlightBytes != consumer.DefaultMaxInFlightBytes {
		t.Fatalf("defaults: store timeout %s, max in-flight bytes %d", c.StoreTimeout, c.MaxInFlightBytes)
	}
	if want := (consumer.Group{Size: consumer.DefaultGroupSize}); c.Group != want || c.Prefetch != (c.Concurrency+1)*want.Size {
		t.Fatalf("defaults: group %+v, prefetch %d; want %+v, %d", c.Group, c.Prefetch, want, (c.Concurrency+1)*want.Size)
	}
	store, err := dedup.NewStore(testdb.Pool(t, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	noop := func(context.Context, pgx.Tx, *consumer.Delivery) (consumer.Response, error) {
		return consumer.Response{}, nil
	}
	for name, mod := range map[string]func(*consumer.Config){
		"store timeout":       func(c *consumer.Config) { c.StoreTimeout = -time.Second },
		"max in-flight bytes": func(c *consumer.Config) { c.MaxInFlightBytes = -1 },
		"group size":          func(c *consumer.Config) { c.Group.Size = -1 },
		"group linger":        func(c *consumer.Config) { c.Group.Linger = -time.Millisecond },
		"key preset":          func(c *consumer.Config) { c.KeyFrom = "rebus" },
		"key preset and function": func(c *consumer.Config) {
			c.KeyFrom = consumer.KeyFromMassTransit
			c.KeyFunc = func(*amqp.Delivery) string { return "k" }
		},
	} {
		cfg := consumer.Config{URL: "amqp://127.0.0.1:1/", Queue: "q", Name: "n"}
		mod(&cfg)
		if _, err := consumer.New(store, noop, &cfg); err == nil {
			t.Errorf("a bad %s was accepted", name)
		}
	}
}
