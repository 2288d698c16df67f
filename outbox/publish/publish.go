package publish

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/msgspan"
	"github.com/idemq/idemq/internal/redact"
)

// instrumentationName names the publisher's tracer.
const instrumentationName = "github.com/idemq/idemq/outbox/publish"

// Defaults used where a Config leaves a field zero.
const (
	DefaultConnectionName = "idemq-publisher"
	DefaultConfirmTimeout = 10 * time.Second
	DefaultDialTimeout    = 10 * time.Second
	DefaultRetryInitial   = 100 * time.Millisecond
	DefaultRetryMax       = 10 * time.Second
)

// Errors a publish can end with. Test them with errors.Is.
var (
	// ErrUnroutable: no queue took the message. The broker returned it (a
	// mandatory publish that matched no binding), or its exchange does not
	// exist. It is not retried: publishing it again would meet the same
	// topology.
	ErrUnroutable = confirm.ErrUnroutable
	// ErrNacked: the broker refused the message (basic.nack). It is retried;
	// a Publish that ends on it wraps it next to the context's error.
	ErrNacked = confirm.ErrNacked
	// ErrChannelClosed: the connection or channel closed before the broker
	// confirmed the message, so its fate is unknown. It is retried with the
	// same message id; a Publish that ends on it wraps it next to the
	// context's error.
	ErrChannelClosed = confirm.ErrClosed
	// ErrTooLarge: the message's properties and headers do not fit in one
	// frame of the broker's negotiated frame_max. It was not sent and is not
	// retried.
	ErrTooLarge = confirm.ErrTooLarge
	// ErrClosed: the Publisher was closed.
	ErrClosed = errors.New("the publisher is closed")
)

// Config configures a Publisher. A nil *Config means all defaults.
type Config struct {
	// ConnectionName is the client-provided name of the publisher's broker
	// connection, shown by RabbitMQ. Default "idemq-publisher".
	ConnectionName string
	// AMQPConfig, when set, is the base of the connection's configuration
	// (TLS, SASL, heartbeat...); its connection name is replaced by
	// ConnectionName.
	AMQPConfig *amqp.Config
	// DialTimeout bounds opening a connection (TCP, TLS and AMQP
	// handshakes), within the context of the Publish that opens it.
	// Default 10s.
	DialTimeout time.Duration
	// ConfirmTimeout bounds the wait for the confirm of one attempt. A
	// confirm that does not come in time counts as a lost connection: the
	// connection is opened anew and the message published again, with the
	// same message id. Default 10s.
	ConfirmTimeout time.Duration
	// RetryInitial and RetryMax bound the exponential backoff between
	// attempts. Defaults 100ms and 10s.
	RetryInitial, RetryMax time.Duration
	// Logger receives a WARN line per failed attempt (never the key or the
	// broker URL). Default slog.Default().
	Logger *slog.Logger
	// TracerProvider makes the publish span (SpanKindProducer), one per
	// Publish whatever its attempts. Default otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagator writes the publish span's context into the message
	// headers (traceparent, tracestate), so that the consumer's processing
	// joins the publisher's trace. Default otel.GetTextMapPropagator().
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c *Config) WithDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	out.ConnectionName = cmp.Or(out.ConnectionName, DefaultConnectionName)
	out.DialTimeout = cmp.Or(out.DialTimeout, DefaultDialTimeout)
	out.ConfirmTimeout = cmp.Or(out.ConfirmTimeout, DefaultConfirmTimeout)
	out.RetryInitial = cmp.Or(out.RetryInitial, DefaultRetryInitial)
	out.RetryMax = cmp.Or(out.RetryMax, DefaultRetryMax)
	out.Logger = cmp.Or(out.Logger, slog.Default())
	out.TracerProvider = cmp.Or[trace.TracerProvider](out.TracerProvider, otel.GetTracerProvider())
	out.Propagator = cmp.Or[propagation.TextMapPropagator](out.Propagator, otel.GetTextMapPropagator())
	return out
}

func (c Config) validate() error {
	for name, d := range map[string]time.Duration{
		"dial timeout": c.DialTimeout, "confirm timeout": c.ConfirmTimeout,
		"retry initial": c.RetryInitial, "retry max": c.RetryMax,
	} {
		if d < 0 {
			return fmt.Errorf("%s %s must not be negative", name, d)
		}
	}
	if c.RetryMax < c.RetryInitial {
		return fmt.Errorf("retry max %s is shorter than retry initial %s", c.RetryMax, c.RetryInitial)
	}
	return nil
}

// Message is what Publish sends. The key given to Publish becomes its
// message_id.
type Message struct {
	// Exchange and RoutingKey say where it goes. "" is the default
	// exchange, where RoutingKey names a queue.
	Exchange, RoutingKey string
	// Headers are published as AMQP headers.
	Headers amqp.Table
	Body    []byte
	// ContentType and ContentEncoding are the MIME properties.
	ContentType, ContentEncoding string
	// DeliveryMode is amqp.Persistent (the default, when zero) or amqp.Transient.
	DeliveryMode uint8
	// Priority is the AMQP priority, 0 to 9 in practice.
	Priority uint8
	// Timestamp is the AMQP timestamp property (none when zero).
	Timestamp time.Time
	// CorrelationID, ReplyTo, Expiration, Type and AppID are the AMQP properties of those names.
	CorrelationID, ReplyTo, Expiration, Type, AppID string
}

func (m Message) publishing(key string) amqp.Publishing {
	return amqp.Publishing{
		MessageId:       key,
		Headers:         maps.Clone(m.Headers),
		Body:            m.Body,
		ContentType:     m.ContentType,
		ContentEncoding: m.ContentEncoding,
		DeliveryMode:    cmp.Or(m.DeliveryMode, amqp.Persistent),
		Priority:        m.Priority,
		Timestamp:       m.Timestamp,
		CorrelationId:   m.CorrelationID,
		ReplyTo:         m.ReplyTo,
		Expiration:      m.Expiration,
		Type:            m.Type,
		AppId:           m.AppID,
	}
}

// Publisher publishes messages with publisher confirms over one broker
// connection, which it opens when first needed and opens again whenever it
// is lost. It is safe for concurrent use.
type Publisher struct {
	addrs  amqpdial.Addrs
	cfg    Config
	log    *slog.Logger
	tracer trace.Tracer

	// lock is held (a token in it) while the session is read or replaced;
	// a channel, so that waiting for it honours a context.
	lock   chan struct{}
	sess   *confirm.Session
	closed bool
}

// New returns a publisher to the broker at url: one AMQP URL, or several
// separated by commas (the nodes of a cluster), of which each connect takes
// the first that answers, tried in a fresh random order. It does not connect: the
// first Publish does, so that a broker that is down when the program starts
// is waited for within that Publish's context.
func New(url string, cfg *Config) (*Publisher, error) {
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("publish: new publisher: %w", err)
	}
	addrs, err := amqpdial.Parse(url)
	if err != nil {
		return nil, fmt.Errorf("publish: new publisher: %w", err)
	}
	return &Publisher{
		addrs:  addrs,
		cfg:    c,
		log:    c.Logger.With("component", "idemq-publisher"),
		tracer: c.TracerProvider.Tracer(instrumentationName),
		lock:   make(chan struct{}, 1),
	}, nil
}

// Publish sends msg with message_id set to key, and returns nil once the
// broker has confirmed it and not returned it: it is then in a queue.
//
// A lost connection, a closed channel, a confirm that does not come within
// ConfirmTimeout and a nack are retried with exponential backoff, on a new
// connection where needed, always with the same message id, so a consumer
// deduplicating on message_id recognises every copy that did arrive. ctx
// bounds the whole operation: when it ends, Publish returns the context's
// error wrapped with the last attempt's. A message no queue takes
// (ErrUnroutable), one too large for a frame (ErrTooLarge) and a key that
// dedup.ValidateKey refuses (dedup.ErrKeyRequired, dedup.ErrKeyInvalid)
// end the publish at once.
//
// One producer span covers the whole Publish; its context is written into
// the message headers (traceparent, tracestate) by Config.Propagator. The
// caller's msg.Headers map is not changed.
//
// The key is the operation's: make it once, before the first call (see
// NewKey), and pass the same key again if the caller itself retries.
func (p *Publisher) Publish(ctx context.Context, key string, msg Message) error {
	if err := dedup.ValidateKey(key); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	ctx, span := msgspan.StartPublish(ctx, p.tracer, msgspan.Publish{Exchange: msg.Exchange, RoutingKey: msg.RoutingKey})
	defer span.End()
	pub := msg.publishing(key)
	if pub.Headers == nil {
		pub.Headers = amqp.Table{}
	}
	p.cfg.Propagator.Inject(ctx, msgspan.Headers(pub.Headers))
	if len(pub.Headers) == 0 {
		pub.Headers = nil
	}
	attempts, err := p.publish(ctx, msg.Exchange, msg.RoutingKey, pub)
	span.SetAttributes(attribute.Int("idemq.publish.attempts", attempts))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "publish failed")
	}
	return err
}

// publish runs the attempts and returns how many it made.
func (p *Publisher) publish(ctx context.Context, exchange, routingKey string, pub amqp.Publishing) (int, error) {
	bo := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(p.cfg.RetryInitial),
		backoff.WithMaxInterval(p.cfg.RetryMax),
		backoff.WithMaxElapsedTime(0),
	)
	for attempt := 1; ; attempt++ {
		err := p.attempt(ctx, exchange, routingKey, pub)
		if err == nil {
			return attempt, nil
		}
		var final *finalError
		if errors.As(err, &final) {
			return attempt, fmt.Errorf("publish: %w", final.err)
		}
		if ctx.Err() != nil {
			return attempt, fmt.Errorf("publish: %w (last attempt: %w)", context.Cause(ctx), err)
		}
		wait := bo.NextBackOff()
		p.log.Warn("publish attempt failed; retrying with the same message id",
			"exchange", exchange, "routing_key", routingKey, "attempt", attempt,
			"err", redact.Error(err), "in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return attempt, fmt.Errorf("publish: %w (last attempt: %w)", context.Cause(ctx), err)
		case <-t.C:
		}
	}
}

// finalError marks an attempt's failure that retrying will not fix.
type finalError struct{ err error }

func (e *finalError) Error() string { return e.err.Error() }
func (e *finalError) Unwrap() error { return e.err }

// attempt publishes once and waits for the result.
func (p *Publisher) attempt(ctx context.Context, exchange, routingKey string, msg amqp.Publishing) error {
	s, err := p.session(ctx)
	if err != nil {
		return err
	}
	if err := checkExchange(s, exchange); err != nil {
		if !errors.Is(err, ErrUnroutable) {
			p.drop(s)
		}
		return err
	}
	pd, err := s.Publisher().Publish(ctx, exchange, routingKey, msg)
	if err != nil {
		if errors.Is(err, ErrTooLarge) {
			return &finalError{err}
		}
		p.drop(s)
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, p.cfg.ConfirmTimeout)
	defer cancel()
	select {
	case <-pd.Done():
	case <-wctx.Done():
		if ctx.Err() == nil {
			// The broker is silent: open the connection anew.
			p.drop(s)
			return fmt.Errorf("no publisher confirm within %s", p.cfg.ConfirmTimeout)
		}
		return fmt.Errorf("wait for publisher confirm: %w", context.Cause(ctx))
	}
	err = pd.Err()
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrUnroutable):
		return &finalError{err}
	case errors.Is(err, ErrChannelClosed):
		p.drop(s)
		if d := s.Err(); d != nil {
			return fmt.Errorf("%w: %s", err, d)
		}
	}
	return err
}

// session returns the live session, opening one if there is none.
func (p *Publisher) session(ctx context.Context) (*confirm.Session, error) {
	select {
	case p.lock <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for the broker connection: %w", context.Cause(ctx))
	}
	defer func() { <-p.lock }()
	if p.closed {
		return nil, &finalError{ErrClosed}
	}
	if p.sess != nil && p.sess.Alive() {
		return p.sess, nil
	}
	if p.sess != nil {
		p.sess.Close()
		p.sess = nil
	}
	s, err := connect(ctx, p.addrs, p.cfg)
	if err != nil {
		return nil, err
	}
	p.sess = s
	return s, nil
}

// drop closes s, if it is still the current session, so that the next
// attempt opens a new one.
func (p *Publisher) drop(s *confirm.Session) {
	p.lock <- struct{}{}
	if p.sess == s {
		p.sess = nil
	}
	<-p.lock
	s.Close()
}

// Close closes the broker connection. Publishes still in flight fail with
// ErrClosed (or with the context's error); later ones fail with ErrClosed.
// Closing twice is safe.
func (p *Publisher) Close() error {
	p.lock <- struct{}{}
	defer func() { <-p.lock }()
	p.closed = true
	if p.sess != nil {
		p.sess.Close()
		p.sess = nil
	}
	return nil
}
