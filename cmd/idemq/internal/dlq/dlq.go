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
// What a dead letter says, and the copy that replays it, are idemq's wire
// format (internal/wire: ReadLetter, ReplayCopy): a dead letter's reason is
// its x-idemq-reason header, written by the idemq consumer, else for a
// message the broker dead-lettered itself (the work queue's
// x-delivery-limit, a TTL, a length limit) the reason of the latest x-death
// entry: delivery_limit, expired, maxlen or rejected. The words are the
// consumer package's Reason* constants.
package dlq

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/wire"
)

// DefaultConfirmTimeout bounds the wait for the broker's confirm of one copy.
const DefaultConfirmTimeout = 30 * time.Second

// Name returns the DLQ of work queue q.
func Name(q string) string { return q + ".dlq" }

// ListResult is what List saw.
type ListResult struct {
	Queue string `json:"queue"`
	// InQueue is the number of ready messages in the DLQ when List started.
	InQueue int `json:"in_queue"`
	// Letters are the messages read, in queue order.
	Letters []wire.Letter `json:"letters"`
	// ByReason counts the letters read by reason.
	ByReason map[string]int `json:"by_reason"`
}

// ErrNoQueue means the queue does not exist.
var ErrNoQueue = errors.New("queue does not exist")

// Inspect returns the state of queue (its ready messages and consumers) from
// a passive declare, on a throwaway channel (a failed passive declare closes
// its channel). A queue that does not exist wraps ErrNoQueue.
func Inspect(conn *amqp.Connection, queue string) (amqp.Queue, error) {
	ch, err := conn.Channel()
	if err != nil {
		return amqp.Queue{}, fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return amqp.Queue{}, fmt.Errorf("queue %s: %w", queue, ErrNoQueue)
	}
	if err != nil {
		return amqp.Queue{}, fmt.Errorf("inspect queue %s: %w", queue, err)
	}
	return q, nil
}

// inspect returns the number of ready messages in queue.
func inspect(conn *amqp.Connection, queue string) (int, error) {
	q, err := Inspect(conn, queue)
	return q.Messages, err
}

// Message is one dead letter as Read saw it: what it says (Letter), an id
// that names it while it stays in the DLQ (ID), and the message itself.
type Message struct {
	wire.Letter
	// ID names the dead letter (see ID); ReplayOptions.Select receives it.
	ID string `json:"id"`
	// Headers, Body and RoutingKey are the message's own.
	Headers    amqp.Table `json:"-"`
	Body       []byte     `json:"-"`
	RoutingKey string     `json:"-"`
}

// ID returns a name for dead letter d: a hash of its message_id, timestamp,
// x-idemq-first-seen, error and body. It is the same each time d is read, so
// that a letter chosen in one read can be picked out in a later one (two
// letters that agree in all of these, the same message dead-lettered twice
// in the same way, share an id; ReplayOptions.Select decides how many of
// them to take).
func ID(d *amqp.Delivery) string {
	h := sha256.New()
	text := func(v any) string { s, _ := wire.String(v); return s }
	for _, part := range []string{
		d.MessageId, d.Timestamp.UTC().Format(time.RFC3339Nano),
		text(d.Headers[wire.HeaderFirstSeen]), text(d.Headers[wire.HeaderError]), string(d.Body),
	} {
		fmt.Fprintf(h, "%d:%s;", len(part), part)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// List reads up to limit (0: all) dead letters of queue without removing
// any: every message read goes back to the queue when List returns.
func List(ctx context.Context, conn *amqp.Connection, queue string, limit int) (ListResult, error) {
	res := ListResult{Queue: queue, ByReason: map[string]int{}, Letters: []wire.Letter{}}
	n, msgs, err := Read(ctx, conn, queue, limit)
	res.InQueue = n
	for _, m := range msgs {
		res.Letters = append(res.Letters, m.Letter)
		res.ByReason[m.Reason]++
	}
	return res, err
}

// Read reads up to limit (0: all) dead letters of queue without removing
// any, like List, and returns the number of ready messages the queue held
// and the messages read, in queue order.
func Read(ctx context.Context, conn *amqp.Connection, queue string, limit int) (int, []Message, error) {
	msgs := []Message{}
	n, err := inspect(conn, queue)
	if err != nil {
		return 0, msgs, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return n, msgs, fmt.Errorf("open channel: %w", err)
	}
	// Closing the channel returns every message read (none is acked).
	defer ch.Close()
	for range n {
		if limit > 0 && len(msgs) >= limit {
			break
		}
		if err := ctx.Err(); err != nil {
			return n, msgs, err
		}
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			return n, msgs, fmt.Errorf("read %s: %w", queue, err)
		}
		if !ok {
			break
		}
		msgs = append(msgs, Message{
			Letter: wire.ReadLetter(&d), ID: ID(&d),
			Headers: d.Headers, Body: d.Body, RoutingKey: d.RoutingKey,
		})
	}
	return n, msgs, nil
}

// ReplayOptions configures Replay.
type ReplayOptions struct {
	// Queue is the DLQ to read; Target the work queue its copies go to
	// (through the default exchange).
	Queue, Target string
	// Reason, when set, replays only dead letters with that reason; the
	// others stay in the DLQ.
	Reason string
	// Select, when set, replays only the dead letters it returns true for
	// (after the reason filter), given the letter's ID and what it says;
	// the others stay in the DLQ. It is called once per letter read, in
	// queue order, so it can count (take one of two letters sharing an id).
	Select func(id string, l wire.Letter) bool
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
// only after the copy is confirmed. The copy is wire.ReplayCopy: the
// dead-letter description dropped, idemq's signed headers kept as they are
// (so that the consumer still trusts the tenant, the origin and the attempt).
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
		l := wire.ReadLetter(&d)
		if (opts.Reason != "" && l.Reason != opts.Reason) || (opts.Select != nil && !opts.Select(ID(&d), l)) {
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
	err := pub.PublishWait(ctx, "", opts.Target, wire.ReplayCopy(d))
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
