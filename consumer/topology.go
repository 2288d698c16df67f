package consumer

import (
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Topology names the queues and exchanges of one work queue Q:
//
//	Q                 the work queue (quorum, x-delivery-limit, dead-letters to Q.dlx)
//	Q.retry.<delay>   one delay tier per retry delay (TTL, dead-letters back to Q)
//	Q.dlx → Q.dlq     the dead-letter exchange (fanout) and queue
type Topology struct {
	Queue       string
	DLX, DLQ    string
	Delays      []time.Duration
	Classic     bool
	DeliveryLim int
}

// NewTopology returns the topology of cfg (defaults applied).
func NewTopology(cfg *Config) Topology {
	c := cfg.WithDefaults()
	return Topology{
		Queue:       c.Queue,
		DLX:         c.Queue + ".dlx",
		DLQ:         c.Queue + ".dlq",
		Delays:      retryDelays(c.RetryInitial, c.RetryMultiplier, c.RetryMax, c.MaxAttempts),
		Classic:     c.ClassicQueues,
		DeliveryLim: c.DeliveryLimit,
	}
}

// retryDelays returns the delay before each retry, as cenkalti/backoff's
// exponential policy (no jitter: the delays name fixed tiers) computes them:
// one delay per retry, maxAttempts-1 in all, duplicates removed.
func retryDelays(initial time.Duration, multiplier float64, maxDelay time.Duration, maxAttempts int) []time.Duration {
	b := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(initial),
		backoff.WithMultiplier(multiplier),
		backoff.WithMaxInterval(maxDelay),
		backoff.WithRandomizationFactor(0),
		backoff.WithMaxElapsedTime(0),
	)
	var out []time.Duration
	for range maxAttempts - 1 {
		d := b.NextBackOff().Round(time.Millisecond)
		if len(out) == 0 || out[len(out)-1] != d {
			out = append(out, d)
		}
	}
	if len(out) == 0 {
		// A delay tier still serves busy keys and lost leases.
		out = append(out, initial)
	}
	return out
}

// horizon is the longest time from a message's first delivery to its last
// retry: the sum of the delays of all retries. Keys must be retained longer.
func (t Topology) horizon(maxAttempts int) time.Duration {
	var sum time.Duration
	for i := 1; i < maxAttempts; i++ {
		sum += t.delayFor(i)
	}
	return sum
}

// delayFor is the delay before the retry that follows attempt n (1-based).
func (t Topology) delayFor(n int) time.Duration {
	if n-1 < len(t.Delays) {
		return t.Delays[n-1]
	}
	return t.Delays[len(t.Delays)-1]
}

// tierFor returns the tier queue holding messages for the retry after attempt n.
func (t Topology) tierFor(n int) string { return t.TierName(t.delayFor(n)) }

// tierAtLeast returns the shortest tier whose delay is at least d (the
// longest if none is): where busy keys wait for a lease to end.
func (t Topology) tierAtLeast(d time.Duration) string {
	for _, delay := range t.Delays {
		if delay >= d {
			return t.TierName(delay)
		}
	}
	return t.TierName(t.Delays[len(t.Delays)-1])
}

// TierName is the queue name of the tier with delay d.
func (t Topology) TierName(d time.Duration) string {
	return fmt.Sprintf("%s.retry.%s", t.Queue, d)
}

func (t Topology) queueArgs(extra amqp.Table) amqp.Table {
	args := amqp.Table{}
	if !t.Classic {
		args["x-queue-type"] = "quorum"
		// At-least-once dead-lettering, which RabbitMQ honours only with
		// reject-publish overflow; otherwise it falls back to at-most-once.
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
	}
	for k, v := range extra {
		args[k] = v
	}
	return args
}

// Declare declares the whole topology on ch. It is idempotent: declaring
// again with the same configuration changes nothing.
func (t Topology) Declare(ch *amqp.Channel) error {
	if err := ch.ExchangeDeclare(t.DLX, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", t.DLX, err)
	}
	if _, err := ch.QueueDeclare(t.DLQ, true, false, false, false, t.queueArgs(nil)); err != nil {
		return fmt.Errorf("declare queue %s: %w", t.DLQ, err)
	}
	if err := ch.QueueBind(t.DLQ, "", t.DLX, false, nil); err != nil {
		return fmt.Errorf("bind %s to %s: %w", t.DLQ, t.DLX, err)
	}
	work := amqp.Table{"x-dead-letter-exchange": t.DLX}
	if !t.Classic {
		work["x-delivery-limit"] = int64(t.DeliveryLim)
	}
	if _, err := ch.QueueDeclare(t.Queue, true, false, false, false, t.queueArgs(work)); err != nil {
		return fmt.Errorf("declare queue %s: %w", t.Queue, err)
	}
	for _, d := range t.Delays {
		name := t.TierName(d)
		args := t.queueArgs(amqp.Table{
			"x-message-ttl":             d.Milliseconds(),
			"x-dead-letter-exchange":    "",
			"x-dead-letter-routing-key": t.Queue,
		})
		if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
			return fmt.Errorf("declare queue %s: %w", name, err)
		}
	}
	return nil
}

// Apply dials url, declares the topology of cfg and closes the connection.
func Apply(cfg *Config) error {
	c := cfg.WithDefaults()
	conn, err := dial(c)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	return NewTopology(&c).Declare(ch)
}
