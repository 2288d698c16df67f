// Package dlq lists and replays the dead letters of a work queue (Q.dlq)
// without losing any: it is what `idemq dlq list` and `idemq dlq replay` run.
//
// # Reading without taking
//
// Both read the DLQ with basic.get and manual acknowledgement on a channel of
// their own. A message read is held by that channel, so the next get returns
// the next message; a message that is not acked goes back to the queue when
// the channel closes. List acks nothing. Replay acks a dead letter only after
// the broker confirmed its copy in the work queue, so an interruption at any
// point leaves each message in the DLQ, in the work queue, or (at worst, if
// the process dies between the confirm and the ack) in both, never in
// neither. A duplicate made that way is harmless: it keeps its message_id
// and its idempotency key.
//
// Both read at most the number of messages the DLQ held when they started,
// so that a message that comes back to the DLQ while they run (a reused key
// replayed and dead-lettered again) is not read twice.
//
// # Reasons
//
// A dead letter's reason is its x-idemq-reason header, written by the idemq
// consumer, else for a message the broker dead-lettered itself (the work
// queue's x-delivery-limit, a TTL, a length limit) the reason of the latest
// x-death entry: delivery_limit, expired, maxlen or rejected. The words are
// the consumer package's Reason* constants.
package dlq

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/confirm"
)

// DefaultConfirmTimeout bounds the wait for the broker's confirm of one copy.
const DefaultConfirmTimeout = 30 * time.Second

// Name returns the DLQ of work queue q.
func Name(q string) string { return q + ".dlq" }

// Letter describes one dead letter.
type Letter struct {
	MessageID string `json:"message_id"`
	// Reason is x-idemq-reason, else the latest x-death reason, else
	// consumer.ReasonUnknown (the words are the consumer's Reason* constants).
	Reason string `json:"reason"`
	// ByBroker reports that the broker dead-lettered the message itself
	// (the reason comes from x-death).
	ByBroker bool `json:"by_broker"`
	// Attempts is x-idemq-attempts: how many times the message was handled.
	Attempts int `json:"attempts,omitempty"`
	// FirstSeen is x-idemq-first-seen: when idemq first saw the message.
	FirstSeen string `json:"first_seen,omitempty"`
	// Error is x-idemq-error: the failure's text, truncated.
	Error string `json:"error,omitempty"`
	// OriginalExchange and OriginalRoutingKey say where the message was first
	// published (x-idemq-original-*, else the latest x-death entry).
	OriginalExchange   string `json:"original_exchange"`
	OriginalRoutingKey string `json:"original_routing_key"`
	// DeathCount is the count of the latest x-death entry (broker dead-lettering).
	DeathCount  int64     `json:"death_count,omitempty"`
	ContentType string    `json:"content_type,omitempty"`
	BodySize    int       `json:"body_size"`
	Timestamp   time.Time `json:"timestamp,omitzero"`
}

// Parse reads the dead-letter metadata of d.
func Parse(d *amqp.Delivery) Letter {
	h := d.Headers
	l := Letter{
		MessageID:   d.MessageId,
		Attempts:    int(headerInt(h[consumer.HeaderAttempts])),
		FirstSeen:   headerString(h[consumer.HeaderFirstSeen]),
		Error:       headerString(h[consumer.HeaderError]),
		ContentType: d.ContentType,
		BodySize:    len(d.Body),
		Timestamp:   d.Timestamp,
	}
	l.Reason = headerString(h[consumer.HeaderReason])
	l.OriginalExchange = headerString(h[consumer.HeaderOriginalExchange])
	l.OriginalRoutingKey = headerString(h[consumer.HeaderOriginalRouting])
	_, hasOrigin := h[consumer.HeaderOriginalExchange]
	if death, ok := latestDeath(h); ok {
		if l.Reason == "" {
			l.Reason = headerString(death["reason"])
			l.ByBroker = l.Reason != ""
			l.DeathCount = headerInt(death["count"])
		}
		if !hasOrigin {
			l.OriginalExchange = headerString(death["exchange"])
			if keys, ok := death["routing-keys"].([]any); ok && len(keys) > 0 {
				l.OriginalRoutingKey = headerString(keys[0])
			}
		}
	}
	if l.Reason == "" {
		for _, k := range []string{"x-last-death-reason", "x-first-death-reason"} {
			if r := headerString(h[k]); r != "" {
				l.Reason, l.ByBroker = r, true
				break
			}
		}
	}
	if l.Reason == "" {
		l.Reason = consumer.ReasonUnknown
	}
	return l
}

// latestDeath is the first (most recent) entry of x-death.
func latestDeath(h amqp.Table) (amqp.Table, bool) {
	deaths, ok := h["x-death"].([]any)
	if !ok || len(deaths) == 0 {
		return nil, false
	}
	t, ok := deaths[0].(amqp.Table)
	return t, ok
}

func headerString(v any) string {
	switch s := v.(type) {
	case string:
		return s
	case []byte:
		return string(s)
	}
	return ""
}

func headerInt(v any) int64 {
	switch n := v.(type) {
	case int8:
		return int64(n)
	case int16:
		return int64(n)
	case int32:
		return int64(n)
	case int64:
		return n
	case int:
		return int64(n)
	case uint8:
		return int64(n)
	case uint16:
		return int64(n)
	case uint32:
		return int64(n)
	case float64:
		return int64(n)
	case string:
		i, _ := strconv.ParseInt(n, 10, 64)
		return i
	}
	return 0
}

// ListResult is what List saw.
type ListResult struct {
	Queue string `json:"queue"`
	// InQueue is the number of ready messages in the DLQ when List started.
	InQueue int `json:"in_queue"`
	// Letters are the messages read, in queue order.
	Letters []Letter `json:"letters"`
	// ByReason counts the letters read by reason.
	ByReason map[string]int `json:"by_reason"`
}

// ErrNoQueue means the queue does not exist.
var ErrNoQueue = errors.New("queue does not exist")

// inspect returns the number of ready messages in queue, on a throwaway
// channel (a failed passive declare closes its channel).
func inspect(conn *amqp.Connection, queue string) (int, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0, fmt.Errorf("queue %s: %w", queue, ErrNoQueue)
	}
	if err != nil {
		return 0, fmt.Errorf("inspect queue %s: %w", queue, err)
	}
	return q.Messages, nil
}

// List reads up to limit (0: all) dead letters of queue without removing
// any: every message read goes back to the queue when List returns.
func List(ctx context.Context, conn *amqp.Connection, queue string, limit int) (ListResult, error) {
	res := ListResult{Queue: queue, ByReason: map[string]int{}, Letters: []Letter{}}
	n, err := inspect(conn, queue)
	if err != nil {
		return res, err
	}
	res.InQueue = n
	ch, err := conn.Channel()
	if err != nil {
		return res, fmt.Errorf("open channel: %w", err)
	}
	// Closing the channel returns every message read (none is acked).
	defer ch.Close()
	for range n {
		if limit > 0 && len(res.Letters) >= limit {
			break
		}
		if err := ctx.Err(); err != nil {
			return res, err
		}
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			return res, fmt.Errorf("read %s: %w", queue, err)
		}
		if !ok {
			break
		}
		l := Parse(&d)
		res.Letters = append(res.Letters, l)
		res.ByReason[l.Reason]++
	}
	return res, nil
}

// ReplayOptions configures Replay.
type ReplayOptions struct {
	// Queue is the DLQ to read; Target the work queue its copies go to
	// (through the default exchange).
	Queue, Target string
	// Reason, when set, replays only dead letters with that reason; the
	// others stay in the DLQ.
	Reason string
	// Limit is the most messages replayed (0: no limit).
	Limit int
	// ConfirmTimeout bounds the wait for one copy's confirm. Default
	// DefaultConfirmTimeout.
	ConfirmTimeout time.Duration
	// Progress, when set, is called after each message read with the
	// numbers read and replayed so far.
	Progress func(read, replayed int)
	// Start, when set, is called once before the first read with the number
	// of messages Replay will read at most.
	Start func(total int)
}

// ReplayResult counts what Replay did.
type ReplayResult struct {
	// Read is the number of dead letters read.
	Read int `json:"read"`
	// Replayed were copied to the work queue (confirmed) and removed from the DLQ.
	Replayed int `json:"replayed"`
	// Skipped did not match the reason and stay in the DLQ.
	Skipped int `json:"skipped"`
	// ByReason counts the replayed letters by reason.
	ByReason map[string]int `json:"by_reason"`
	// Interrupted reports that ctx ended before the end of the DLQ.
	Interrupted bool `json:"interrupted"`
}

// Replay moves dead letters back to their work queue: for each message of
// the DLQ that matches the reason, it publishes a copy to the work queue
// with publisher confirms and mandatory routing, and acks the dead letter
// only after the copy is confirmed. The copy keeps the body, the properties,
// message_id and the headers, except x-idemq-reason, x-idemq-error,
// x-idemq-attempts and x-delivery-count, which it drops. It keeps idemq's
// signed headers as they are, so that their signature still verifies and
// the consumer keeps the tenant and the original exchange and routing key:
// idemq dead-letters with x-idemq-attempt 1 (a full retry budget); a retry
// copy the broker dead-lettered itself keeps its attempt; an unsigned dead
// letter is a first attempt anyway.
//
// When ctx ends Replay stops after the message in hand (its copy confirmed
// and acked, or left in the DLQ) and returns the counts with Interrupted set
// and a nil error. A copy the broker refuses (nack, unroutable, no confirm in
// time) stops Replay with an error; its dead letter stays in the DLQ.
func Replay(ctx context.Context, conn *amqp.Connection, opts ReplayOptions) (ReplayResult, error) {
	res := ReplayResult{ByReason: map[string]int{}}
	if opts.Queue == "" || opts.Target == "" {
		return res, errors.New("replay: queue and target are required")
	}
	if opts.ConfirmTimeout <= 0 {
		opts.ConfirmTimeout = DefaultConfirmTimeout
	}
	if _, err := inspect(conn, opts.Target); err != nil {
		return res, err
	}
	total, err := inspect(conn, opts.Queue)
	if err != nil {
		return res, err
	}
	if opts.Start != nil {
		opts.Start(total)
	}
	ch, err := conn.Channel()
	if err != nil {
		return res, fmt.Errorf("open channel: %w", err)
	}
	// Closing the channel returns the skipped messages to the DLQ.
	defer ch.Close()
	pub, err := confirm.New(ch, conn.Config.FrameSize)
	if err != nil {
		return res, err
	}

	for range total {
		if opts.Limit > 0 && res.Replayed >= opts.Limit {
			break
		}
		if ctx.Err() != nil {
			res.Interrupted = true
			break
		}
		d, ok, err := ch.Get(opts.Queue, false)
		if err != nil {
			return res, fmt.Errorf("read %s: %w", opts.Queue, err)
		}
		if !ok {
			break
		}
		res.Read++
		l := Parse(&d)
		if opts.Reason != "" && l.Reason != opts.Reason {
			res.Skipped++ // left unacked: back to the DLQ when the channel closes
		} else {
			if err := replayOne(pub, &d, opts); err != nil {
				return res, err
			}
			res.Replayed++
			res.ByReason[l.Reason]++
		}
		if opts.Progress != nil {
			opts.Progress(res.Read, res.Replayed)
		}
	}
	return res, nil
}

// replayOne publishes the copy of d to the target, waits for its confirm,
// and acks d. It is not cancelled by the caller's context: once a copy is
// out, its fate is settled before Replay stops.
func replayOne(pub *confirm.Publisher, d *amqp.Delivery, opts ReplayOptions) error {
	ctx, cancel := context.WithTimeout(context.Background(), opts.ConfirmTimeout)
	defer cancel()
	err := pub.PublishWait(ctx, "", opts.Target, Copy(d))
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("copy to %s not confirmed within %s; its dead letter stays in %s", opts.Target, opts.ConfirmTimeout, opts.Queue)
	case errors.Is(err, confirm.ErrNacked):
		return fmt.Errorf("the broker refused the copy to %s (nack); its dead letter stays in %s", opts.Target, opts.Queue)
	case err != nil:
		return fmt.Errorf("copy to %s: %w; its dead letter stays in %s", opts.Target, err, opts.Queue)
	}
	if err := d.Ack(false); err != nil {
		// The copy is in the work queue and the dead letter goes back to
		// the DLQ: a harmless duplicate (same message_id and key).
		return fmt.Errorf("ack dead letter after its copy was confirmed (the message is now in both queues): %w", err)
	}
	return nil
}

// Copy returns the publishing that replays d to its work queue.
func Copy(d *amqp.Delivery) amqp.Publishing {
	h := maps.Clone(d.Headers)
	if h == nil {
		h = amqp.Table{}
	}
	for _, k := range []string{consumer.HeaderReason, consumer.HeaderError, consumer.HeaderAttempts, "x-delivery-count"} {
		delete(h, k)
	}
	return amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		UserId:          d.UserId,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}
