package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

// Handler handles one delivery. Whatever it writes in tx commits together
// with the key's completion (and the delivery's outbox rows), or not at all.
//
// Return a Response (possibly zero) for success; Reject(...) for a business
// rejection, which is stored and replayed to duplicates like a success;
// Permanent(err) for a message that can never succeed (straight to the DLQ);
// any other error is an infrastructure failure: the key is released and the
// message retried with backoff. A panic or a timeout counts as an
// infrastructure failure too. The handler never sees a duplicate.
type Handler func(ctx context.Context, tx pgx.Tx, d *Delivery) (Response, error)

// Response is what a handler's success stores with the key; duplicates get
// it back (and it is sent to reply_to when the message asks for a reply).
type Response struct {
	Code int
	Body []byte
}

// Delivery is a message as a handler sees it.
type Delivery struct {
	// Key is the idempotency key, Tenant its tenant ("" by default).
	Key, Tenant string
	// Attempt is 1 on the first delivery and counts retries after
	// infrastructure failures.
	Attempt int
	// Body, Headers and the AMQP properties as published. Headers hold
	// idemq's x-idemq-* headers only as idemq wrote them: they are removed
	// from any delivery that is not a copy idemq signed.
	Body          []byte
	Headers       amqp.Table
	MessageID     string
	ContentType   string
	CorrelationID string
	ReplyTo       string
	Exchange      string
	RoutingKey    string
	Timestamp     time.Time
	// The other AMQP properties, for stages that forward the message.
	ContentEncoding string
	DeliveryMode    uint8
	Priority        uint8
	Expiration      string
	Type            string
	// UserID is the user_id property: the publisher's on a first delivery,
	// empty on idemq's copies (RabbitMQ lets a connection publish only its
	// own user's), whose tenant travels in HeaderTenant instead.
	UserID string
	AppID  string
	// OriginalExchange and OriginalRoutingKey are where the message was
	// first published: as idemq's signed headers record it on a retry copy
	// (which comes back from its tier with other ones), else Exchange and
	// RoutingKey. Never what a publisher wrote into those headers.
	OriginalExchange, OriginalRoutingKey string

	lease *dedup.Lease
	store *dedup.Store
	// crash is the test kit's crash hook (Consumer.crashAt), and tx the
	// handler's transaction, which a crash in a step abandons too; nil in a
	// running consumer.
	crash func(stage kit.Stage, step string, txs ...pgx.Tx)
	tx    pgx.Tx
	// order is its place in its ordering key's order (Config.Ordering).
	order *orderState
}

// RecoveryPoint is the last step committed by an earlier attempt ("" if none).
func (d *Delivery) RecoveryPoint() string { return d.lease.RecoveryPoint }

// RecoveryData is the data committed with the recovery point.
func (d *Delivery) RecoveryData() []byte { return d.lease.RecoveryData }

// StepDone reports whether step name was committed by an earlier attempt.
func (d *Delivery) StepDone(name string) bool { return d.lease.StepDone(name) }

// Step runs one atomic phase in its own transaction, committed with the
// recovery point name; a retry skips it once committed. See dedup.Store.Step.
// Messages the step enqueues to the outbox get ids derived from the step,
// so a retry that skips committed steps cannot reuse them.
//
// A step's transaction must see the key: declare Config.Steps, which makes
// the consumer reserve its keys as leases others can see. Where the keys
// are held in the group's transaction instead, Step returns ErrStepInBatch
// without running fn (an infrastructure failure unless the handler
// handles it: the delivery is retried).
func (d *Delivery) Step(ctx context.Context, name string, fn func(ctx context.Context, tx pgx.Tx) error) error {
	if d.lease.HeldByTransaction() {
		return ErrStepInBatch
	}
	if d.crash == nil || d.StepDone(name) {
		return d.store.Step(outbox.WithStep(ctx, name), d.lease, name, fn)
	}
	err := d.store.Step(outbox.WithStep(ctx, name), d.lease, name, func(ctx context.Context, tx pgx.Tx) error {
		if err := fn(ctx, tx); err != nil {
			return err
		}
		d.crash(kit.StageInStep, name, tx, d.tx)
		return nil
	})
	if err == nil {
		d.crash(kit.StageAfterStep, name, d.tx)
	}
	return err
}

// ErrStepInBatch is what Delivery.Step returns on a consumer that holds
// its keys in the group's transaction, which a step's transaction cannot
// see: one whose Config does not declare Steps (or SeparateReservations).
var ErrStepInBatch = errors.New("a step cannot see a key held in the group's transaction: declare Config.Steps")

// DerivedKey returns a deterministic key for one step of this operation, to
// pass to an external API (a payment gateway) whose own deduplication then
// recognises the retry.
func (d *Delivery) DerivedKey(step string) string { return d.lease.DerivedKey(step) }

// RejectError is a business rejection: the operation's result, kept.
type RejectError struct {
	Response Response
	Reason   string
}

func (e *RejectError) Error() string { return "rejected: " + e.Reason }

// Reject returns a business rejection (insufficient funds, unknown account):
// the handler's transaction commits with the key completed as "rejected" and
// the response stored, and duplicates get the same rejection back.
func Reject(code int, reason string, body []byte) error {
	return &RejectError{Response: Response{Code: code, Body: body}, Reason: reason}
}

// PermanentError marks a failure that no retry can fix.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err as permanent (an undecodable or invalid payload): the
// transaction rolls back, the key is released, and the message goes straight
// to the DLQ with reason permanent_error.
func Permanent(err error) error {
	if err == nil {
		err = errors.New("no cause given")
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err is or wraps a PermanentError.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// IsRejection reports whether err is or wraps a RejectError.
func IsRejection(err error) bool {
	var r *RejectError
	return errors.As(err, &r)
}

// storedResult is what a handler's return stores with the key: a success or
// a business rejection. Any other error comes back as it is: nothing is stored.
func storedResult(resp Response, err error) (dedup.Result, error) {
	var rej *RejectError
	switch {
	case err == nil:
		return dedup.Result{Outcome: dedup.OutcomeOK, Code: resp.Code, Response: resp.Body}, nil
	case errors.As(err, &rej):
		return dedup.Result{Outcome: dedup.OutcomeRejected, Code: rej.Response.Code, Reason: rej.Reason, Response: rej.Response.Body}, nil
	}
	return dedup.Result{}, err
}

// PanicError is the infrastructure failure a handler's panic turns into:
// the delivery is retried like any other failure, Event.Err is (or wraps)
// the *PanicError, and the runtime logs the stack. It does not unwrap to the
// panic's value, so that a panic is never routed as the error it carried.
type PanicError struct {
	// Value is what the handler passed to panic.
	Value any
	// Stack is the panicking goroutine's stack (runtime/debug.Stack), taken
	// where the panic was recovered: its frames include the handler's.
	Stack []byte
}

// Error says that the handler panicked and with what; the stack is in Stack.
func (e *PanicError) Error() string { return fmt.Sprintf("the handler panicked: %v", e.Value) }

// BatchHandler handles a batch of deliveries in one transaction: whatever
// it writes in tx commits together with the completion of every key of the
// batch, with one commit. It returns one Response per delivery, in order.
//
// If it returns an error, the batch's transaction rolls back and each
// delivery is handled again alone (a batch of one, under its own savepoint),
// so that one bad message never fails its batch-mates: its own error then
// decides its outcome exactly as for a Handler (Reject, Permanent, retry).
type BatchHandler func(ctx context.Context, tx pgx.Tx, ds []*Delivery) ([]Response, error)
