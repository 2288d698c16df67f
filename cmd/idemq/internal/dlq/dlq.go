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
// # Memory
//
// basic.get always transfers a letter's body. Scan reads one letter at a
// time and hands it to its callback, which keeps what it needs: List keeps
// what each letter says (wire.Letter), Read the first bodyLimit bytes of
// each body. A scan's peak is about two letters' sizes (the one being read
// and the last one read, which the AMQP client keeps until the next) plus
// what the callback keeps: limit × (headers + bodyLimit) for Read.
//
// # user_id
//
// A dead letter the broker made itself keeps its publisher's user_id, which
// RabbitMQ lets a connection publish only when it is that connection's user
// (wire.UserIDAllowed). Replay leaves such a letter in the DLQ by default
// (ErrForeignUserID), or drops or keeps the user_id when told to
// (UserIDPolicy): it cannot know whether the consumer takes the tenant from
// user_id, where a copy without it would be claimed in another tenant.
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
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/interop"
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
	Letters []Listed `json:"letters"`
	// ByReason counts the letters read by reason.
	ByReason map[string]int `json:"by_reason"`
}

// Listed is one dead letter as List saw it: what it says, and the hash of
// its key (KeyScope.Of).
type Listed struct {
	wire.Letter
	// KeyHash is the hash of the letter's key in its scope, as the
	// consumer's logs and `idemq keys inspect` show it; "" for a letter
	// without a key.
	KeyHash string `json:"key_hash"`
}

// KeyScope is where a dead letter's key is read from and whose scope it is
// in: the consumer's name, the header of a key when there is no message_id
// (default consumer.DefaultKeyHeader), the header of the tenant (default
// consumer.DefaultTenantHeader), and the consumer's key preset (KeyFrom,
// docs/interop.md: a MassTransit envelope's, a CloudEvent's source and id;
// default message_id).
type KeyScope struct {
	Consumer, KeyHeader, TenantHeader string
	KeyFrom                           consumer.KeyPreset
}

// Of returns the key of dead letter m (as its consumer's preset reads it),
// its tenant (x-idemq-tenant on idemq's copies, else the tenant header) and
// the key's hash in the scope (dedup.Scope.KeyHash: the key_hash of the
// consumer's logs). key and hash are "" for a letter without a key, or one
// whose key its preset cannot read. m's body must be whole (Scan's, not
// Read's).
func (s KeyScope) Of(m Message) (key, tenant, hash string) {
	return s.OfDelivery(&amqp.Delivery{MessageId: m.MessageID, Headers: m.Headers, Body: m.Body, ContentType: m.ContentType})
}

// OfDelivery is Of for a delivery.
func (s KeyScope) OfDelivery(d *amqp.Delivery) (key, tenant, hash string) {
	if read, err := interop.ReaderFor(string(s.KeyFrom)); err == nil {
		key, _, _ = read(d, cmp.Or(s.KeyHeader, consumer.DefaultKeyHeader))
	}
	tenant, ok := wire.String(d.Headers[wire.HeaderTenant])
	if !ok {
		tenant, _ = wire.String(d.Headers[cmp.Or(s.TenantHeader, consumer.DefaultTenantHeader)])
	}
	if key != "" {
		hash = dedup.Scope{Consumer: s.Consumer, Tenant: tenant, Key: key}.KeyHash()
	}
	return key, tenant, hash
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

// Message is one dead letter as Scan or Read saw it: what it says (Letter),
// an id that names it while it stays in the DLQ (ID), and the message itself.
type Message struct {
	wire.Letter
	// ID names the dead letter (see ID); ReplayOptions.Select receives it.
	ID string `json:"id"`
	// Headers, Body and RoutingKey are the message's own. Read keeps only
	// the first bytes of Body (Letter.BodySize is the whole body's size).
	Headers    amqp.Table `json:"-"`
	Body       []byte     `json:"-"`
	RoutingKey string     `json:"-"`
	// UserID is the message's user_id property (a broker-checked user name
	// of its publisher, which a dead letter the broker made keeps).
	UserID string `json:"-"`
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
		text(d.Headers[wire.HeaderFirstSeen]), text(d.Headers[wire.HeaderError]),
	} {
		fmt.Fprintf(h, "%d:%s;", len(part), part)
	}
	fmt.Fprintf(h, "%d:", len(d.Body))
	h.Write(d.Body)
	h.Write([]byte(";"))
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// List reads up to limit (0: all) dead letters of queue without removing
// any: every message read goes back to the queue when List returns. It
// keeps what each letter says and its key's hash in scope, never its body.
func List(ctx context.Context, conn *amqp.Connection, queue string, limit int, scope KeyScope) (ListResult, error) {
	res := ListResult{Queue: queue, ByReason: map[string]int{}, Letters: []Listed{}}
	n, err := Scan(ctx, conn, queue, limit, func(m Message) bool {
		_, _, hash := scope.Of(m)
		res.Letters = append(res.Letters, Listed{Letter: m.Letter, KeyHash: hash})
		res.ByReason[m.Reason]++
		return true
	})
	res.InQueue = n
	return res, err
}

// Read reads up to limit (0: all) dead letters of queue without removing
// any, like List, and returns the number of ready messages the queue held
// and the messages read, in queue order, each with at most bodyLimit bytes
// of its body (0: none), copied out of the letter: what Read returns holds
// at most limit × (headers + bodyLimit) bytes, whatever the bodies' sizes.
func Read(ctx context.Context, conn *amqp.Connection, queue string, limit, bodyLimit int) (int, []Message, error) {
	msgs := []Message{}
	n, err := Scan(ctx, conn, queue, limit, func(m Message) bool {
		msgs = append(msgs, m.Cut(bodyLimit))
		return true
	})
	return n, msgs, err
}

// Cut returns m with at most n bytes of its body, in a slice of their own
// (so that the whole body can be freed).
func (m Message) Cut(n int) Message {
	m.Body = bytes.Clone(m.Body[:min(max(n, 0), len(m.Body))])
	return m
}

// Scan reads up to limit (0: all) dead letters of queue without removing
// any, one at a time, and calls fn with each, in queue order, until fn
// returns false. It returns the number of ready messages the queue held when
// it started. fn receives the letter's whole body and must not keep it
// (Message.Cut keeps a part): only then does a scan hold one body at a time,
// whatever the number of letters. Every message read goes back to the queue
// when Scan returns (its channel closes). A scan that stops before the end
// reorders the queue: the broker puts the letters read behind the others.
func Scan(ctx context.Context, conn *amqp.Connection, queue string, limit int, fn func(Message) bool) (int, error) {
	n, err := inspect(conn, queue)
	if err != nil {
		return 0, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return n, fmt.Errorf("open channel: %w", err)
	}
	// Closing the channel returns every message read (none is acked).
	defer ch.Close()
	for i := range n {
		if limit > 0 && i >= limit {
			break
		}
		if err := ctx.Err(); err != nil {
			return n, err
		}
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			return n, fmt.Errorf("read %s: %w", queue, err)
		}
		if !ok {
			break
		}
		m := Message{
			Letter: wire.ReadLetter(&d), ID: ID(&d),
			Headers: d.Headers, Body: d.Body, RoutingKey: d.RoutingKey, UserID: d.UserId,
		}
		if !fn(m) {
			break
		}
	}
	return n, nil
}

// UserIDPolicy says what Replay does with a dead letter whose user_id the
// replaying connection may not publish (wire.UserIDAllowed): one the broker
// dead-lettered itself (x-delivery-limit, a TTL, a length limit) keeps its
// publisher's user_id, and RabbitMQ closes the channel of a publish whose
// user_id is not the connection's user (PRECONDITION_FAILED), unless that
// user has the impersonator tag. idemq's own dead letters carry none.
type UserIDPolicy int

const (
	// UserIDRefuse, the default, leaves such a letter in the DLQ and
	// replays the others; Replay then returns an error wrapping
	// ErrForeignUserID. Replay cannot know whether the consumer takes the
	// tenant from user_id (consumer.Config.TenantFromUserID): if it does, a
	// copy without it would claim its key in another tenant's scope, and
	// could be processed a second time.
	UserIDRefuse UserIDPolicy = iota
	// UserIDDrop replays such a letter without its user_id, and counts it
	// (ReplayResult.UserIDDropped). Right when the consumer does not take
	// the tenant from user_id: nothing else reads it.
	UserIDDrop
	// UserIDKeep replays every letter with its user_id, for a replaying user
	// with the impersonator tag. A user without it gets the broker's
	// refusal, and Replay stops with it.
	UserIDKeep
)

// ErrForeignUserID means dead letters stayed in the DLQ because they carry a
// user_id the replaying connection may not publish (see UserIDPolicy).
var ErrForeignUserID = errors.New("dead letters carry a user_id that the replaying user may not publish")

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
	// UserID says what to do with a letter whose user_id the replaying
	// connection may not publish. Default UserIDRefuse.
	UserID UserIDPolicy
	// ConfirmTimeout bounds the wait for one copy's confirm. Default
	// DefaultConfirmTimeout.
	ConfirmTimeout time.Duration
	// Progress, when set, is called after each message read with the
	// counts so far.
	Progress func(ReplayResult)
	// Start, when set, is called once before the first read with the number
	// of messages Replay will read at most.
	Start func(total int)
	// Doomed replays the letters whose reason cannot succeed unchanged
	// (Doomed says why); without it they stay in the DLQ, counted in
	// ReplayResult.Doomed.
	Doomed bool
	// Retention, when set, is the key store's retention (dedup.Config
	// Retention, idemq gc --retention): a letter older than it (OlderThan)
	// stays in the DLQ, counted in ReplayResult.Old, unless
	// OlderThanRetention. 0: ages are not checked.
	Retention          time.Duration
	OlderThanRetention bool
	// Replayed, when set, is called with each dead letter once its copy is
	// confirmed (the audit records the keys of the messages replayed).
	Replayed func(d *amqp.Delivery)
	// Logger receives a line for each letter replayed without its user_id
	// or left for it (its id, never its key). Default slog.Default().
	Logger *slog.Logger
}

// ReplayResult counts what Replay did.
type ReplayResult struct {
	// Read is the number of dead letters read.
	Read int `json:"read"`
	// Replayed were copied to the work queue (confirmed) and removed from the DLQ.
	Replayed int `json:"replayed"`
	// Skipped did not match the reason or the selection and stay in the DLQ.
	Skipped int `json:"skipped"`
	// UserIDDropped of the replayed letters were replayed without their
	// user_id (UserIDDrop).
	UserIDDropped int `json:"user_id_dropped"`
	// UserIDRefused matched but stay in the DLQ: their user_id is one the
	// replaying connection may not publish (UserIDRefuse).
	UserIDRefused int `json:"user_id_refused"`
	// Doomed matched but stay in the DLQ: their reason cannot succeed
	// unchanged (Doomed) and ReplayOptions.Doomed was not given.
	Doomed int `json:"doomed"`
	// Old matched but stay in the DLQ: they may be older than the key
	// retention (ReplayOptions.Retention).
	Old int `json:"older_than_retention"`
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
// (so that the consumer still trusts the tenant, the origin and the attempt),
// and the user_id as opts.UserID says when the connection may not publish it.
//
// When ctx ends Replay stops after the message in hand (its copy confirmed
// and acked, or left in the DLQ) and returns the counts with Interrupted set
// and a nil error. A copy the broker refuses (nack, unroutable, no confirm in
// time, a channel closed: the error says the broker's reason) stops Replay
// with an error; its dead letter stays in the DLQ. Letters refused for their
// user_id stay in the DLQ too, and Replay returns an error wrapping
// ErrForeignUserID after it has replayed the others; so do letters older
// than opts.Retention (ErrOlderThanRetention). Letters whose reason cannot
// succeed unchanged (Doomed) stay without an error, counted.
func Replay(ctx context.Context, conn *amqp.Connection, opts ReplayOptions) (ReplayResult, error) {
	res := ReplayResult{ByReason: map[string]int{}}
	if opts.Queue == "" || opts.Target == "" {
		return res, errors.New("replay: queue and target are required")
	}
	if opts.ConfirmTimeout <= 0 {
		opts.ConfirmTimeout = DefaultConfirmTimeout
	}
	log := cmp.Or(opts.Logger, slog.Default())
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
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	pub, err := confirm.New(ch, conn.Config.FrameSize)
	if err != nil {
		return res, err
	}
	user := User(conn)

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
		switch {
		case (opts.Reason != "" && l.Reason != opts.Reason) || (opts.Select != nil && !opts.Select(ID(&d), l)):
			res.Skipped++ // left unacked: back to the DLQ when the channel closes
		case !opts.Doomed && Doomed(l.Reason) != "":
			res.Doomed++ // left unacked, like a skipped one
		case opts.Retention > 0 && !opts.OlderThanRetention && OlderThan(l, opts.Retention, time.Now()):
			res.Old++ // left unacked, like a skipped one
		case !wire.UserIDAllowed(d.UserId, user) && opts.UserID == UserIDRefuse:
			res.UserIDRefused++ // left unacked, like a skipped one
			log.Warn("dlq: replay leaves a dead letter whose user_id the replaying user may not publish",
				"queue", opts.Queue, "letter", ID(&d), "reason", l.Reason)
		default:
			p := wire.ReplayCopy(&d)
			dropped := !wire.UserIDAllowed(d.UserId, user) && opts.UserID == UserIDDrop
			if dropped {
				p.UserId = ""
			}
			if err := replayOne(pub, closed, &d, p, opts); err != nil {
				return res, err
			}
			res.Replayed++
			res.ByReason[l.Reason]++
			if opts.Replayed != nil {
				opts.Replayed(&d)
			}
			if dropped {
				res.UserIDDropped++
				log.Info("dlq: replayed a dead letter without its user_id, which the replaying user may not publish",
					"queue", opts.Queue, "target", opts.Target, "letter", ID(&d), "reason", l.Reason)
			}
		}
		if opts.Progress != nil {
			opts.Progress(res)
		}
	}
	var errs []error
	if res.Old > 0 {
		errs = append(errs, fmt.Errorf("%d dead letter(s) stay in %s, %w", res.Old, opts.Queue, ErrOlderThanRetention))
	}
	if res.UserIDRefused > 0 {
		errs = append(errs, fmt.Errorf("%d dead letter(s) stay in %s: %w (RabbitMQ accepts only the connection's own user without the impersonator tag); "+
			"replay them as their publisher's user, or without their user_id if the consumer does not take the tenant from it", res.UserIDRefused, opts.Queue, ErrForeignUserID))
	}
	return res, errors.Join(errs...)
}

// User returns the user conn authenticated as (PLAIN or AMQPLAIN), "" when
// it is not known (EXTERNAL: a certificate login).
func User(conn *amqp.Connection) string {
	for _, a := range conn.Config.SASL {
		switch a := a.(type) {
		case *amqp.PlainAuth:
			return a.Username
		case *amqp.AMQPlainAuth:
			return a.Username
		}
	}
	return ""
}

// replayOne publishes p, the copy of d, to the target, waits for its
// confirm, and acks d. It is not cancelled by the caller's context: once a
// copy is out, its fate is settled before Replay stops. closed receives the
// channel's close, whose reason a copy that the close failed reports.
func replayOne(pub *confirm.Publisher, closed <-chan *amqp.Error, d *amqp.Delivery, p amqp.Publishing, opts ReplayOptions) error {
	ctx, cancel := context.WithTimeout(context.Background(), opts.ConfirmTimeout)
	defer cancel()
	err := pub.PublishWait(ctx, "", opts.Target, p)
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("copy to %s not confirmed within %s; its dead letter stays in %s", opts.Target, opts.ConfirmTimeout, opts.Queue)
	case errors.Is(err, confirm.ErrNacked):
		return fmt.Errorf("the broker refused the copy to %s (nack); its dead letter stays in %s", opts.Target, opts.Queue)
	case errors.Is(err, confirm.ErrClosed):
		if e := closeError(closed); e != nil {
			return fmt.Errorf("copy to %s: %w (the broker closed it: %w); its dead letter stays in %s", opts.Target, err, e, opts.Queue)
		}
		return fmt.Errorf("copy to %s: %w; its dead letter stays in %s", opts.Target, err, opts.Queue)
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

// closeError is the broker's reason for closing a channel (406
// PRECONDITION_FAILED - user_id property set to …), from closed; nil when
// none comes within closeWait (a close by the client).
func closeError(closed <-chan *amqp.Error) *amqp.Error {
	select {
	case e := <-closed:
		return e
	case <-time.After(closeWait):
		return nil
	}
}

// closeWait bounds the wait for the close that failed a copy. amqp091-go
// sends it before it ends the confirms, so it is there already.
const closeWait = time.Second
