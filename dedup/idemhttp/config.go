package idemhttp

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/textproto"
	"slices"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

// Defaults used where a Config leaves a field zero.
const (
	// DefaultHeader is the request header that carries the key.
	DefaultHeader = "Idempotency-Key"
	// DefaultMaxBody bounds the request body read for the fingerprint.
	DefaultMaxBody = 1 << 20
	// DefaultRetryAfter is what a 409 asks the client to wait.
	DefaultRetryAfter = time.Second
	// DefaultTimeout bounds a guarded handler.
	DefaultTimeout = time.Minute
	// ReplayedHeader marks a response replayed from the store.
	ReplayedHeader = "Idempotent-Replayed"
)

// DefaultMethods are the methods guarded when Config.Methods is nil: the
// ones that are not idempotent by their definition (RFC 9110, 9.2.2).
var DefaultMethods = []string{http.MethodPost, http.MethodPatch}

// DefaultOmittedHeaders are the response headers never stored nor
// replayed: those that describe one connection or one transfer rather than
// the result (hop-by-hop headers, Date, Content-Length, which is computed
// again), cookies (a session secret has no place in the key table) and the
// replay marker itself.
var DefaultOmittedHeaders = []string{
	"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Connection", "Te", "Trailer",
	"Transfer-Encoding", "Upgrade", "Date", "Content-Length", "Set-Cookie", ReplayedHeader,
}

// Config configures a Middleware. Consumer is required; the rest has defaults.
type Config struct {
	// Consumer is the stable name of the API whose keys these are: keys are
	// unique per (Consumer, tenant, key), in the same table as the message
	// consumers' keys, so a name of its own ("payments-api") keeps the
	// API's keys apart from theirs. Required.
	Consumer string
	// Header is the request header carrying the key: an RFC 8941
	// sf-string ("k", as the Idempotency-Key draft has it) or a bare value
	// (k), the same key k; Key gives it to the handler. Default
	// DefaultHeader.
	Header string
	// Methods are the guarded methods; requests with any other method pass
	// through untouched. Default DefaultMethods.
	Methods []string
	// Tenant returns the tenant of a request: the authenticated principal
	// (from a verified token, a client certificate, a session), never a
	// header the client may set freely, unless the deployment is trusted.
	// An error answers 401 and runs nothing; a tenant that
	// dedup.ValidateTenant refuses (the consumer's rule: over 255 bytes,
	// not UTF-8, control characters) answers 400 tenant_invalid, before
	// anything is reserved. Default: every request is in the default
	// tenant "".
	Tenant func(r *http.Request) (string, error)
	// Fingerprint computes the fingerprint of a request from its body.
	// Default: SHA-256 of the method, the path with its query and the
	// body (RequestFingerprint); FieldsFingerprint fingerprints named JSON
	// fields instead. An error answers 400 and runs nothing.
	Fingerprint func(r *http.Request, body []byte) (dedup.Fingerprint, error)
	// DocURL is the documentation of the API's idempotency rules: a
	// problem's "type" is DocURL#<code> (code: idempotency_key_required,
	// …), so that a client that reads the answer finds what to do.
	// Default: none ("about:blank", as RFC 9457 says).
	DocURL string
	// MaxBody bounds the request body, read whole for the fingerprint; a
	// larger one answers 413. Default DefaultMaxBody.
	MaxBody int64
	// Stored decides, from the status of the handler's response, whether
	// the response is the operation's result (stored with the key in the
	// handler's transaction, replayed to every retry) or not (the
	// transaction rolls back, the key is released and a retry runs again).
	// A handler may decide for one response with Keep or Discard. Default
	// DefaultStored.
	Stored func(status int) bool
	// StoredHeaders, when set, are the only response headers stored and
	// replayed. Default: all but DefaultOmittedHeaders.
	StoredHeaders []string
	// SeparateReservations reserves each key with a statement and a commit
	// of its own before the handler's transaction begins: the key is in
	// progress for everyone to see (idemq keys, the UI) while the handler
	// runs, under a lease the middleware extends (the heartbeat). Default
	// false: the key is reserved in the handler's transaction, which holds
	// it until it ends and commits it with the effects and the result, one
	// commit per request; a concurrent request with the key still gets 409
	// at once (docs/http.md, "Held and separate reservations").
	SeparateReservations bool
	// Lease overrides the store's lease of a key reserved separately
	// (SeparateReservations). The middleware extends it every third of it
	// while the handler runs (the heartbeat), so it only bounds how long a
	// crashed server's key stays in progress.
	Lease time.Duration
	// Timeout bounds the handler: its context ends after it, and a handler
	// that returns after that has its response discarded and its key
	// released (the client gets 503). A client that goes away does not end
	// the handler's context: the operation finishes and its result is
	// stored for the client's retry. Default DefaultTimeout.
	Timeout time.Duration
	// RetryAfter is the Retry-After of a 409 (rounded up to whole seconds).
	// Default DefaultRetryAfter.
	RetryAfter time.Duration
	// Outbox, when set, is put into every guarded handler's context, so
	// that outbox.Enqueue(r.Context(), Tx(r), msg) writes into it; messages
	// without a MessageID then get ids derived from the request's key, the
	// same on every retry. Default: the outbox of the store's schema.
	Outbox *outbox.Outbox
	// Logger receives the failures the client cannot see (a release that
	// failed, a panic). Keys never appear in it; their KeyHash does.
	// Default slog.Default().
	Logger *slog.Logger
	// TracerProvider and MeterProvider receive the span of every guarded
	// request ("idemq request", a child of the request's context: under
	// the server span of an instrumented server) and the counter
	// idemq.http.requests by outcome (docs/observability.md, "HTTP front
	// door"). nil means the global ones.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	// Propagator reads the trace context of a request from its headers
	// (traceparent) when its context carries no span yet (a server
	// without otelhttp, idemq gateway), so that the trace goes on from the
	// client through the handler and its outbox messages to the workers.
	// nil means the global propagator once a program has set one, else W3C
	// Trace Context + Baggage, as the consumer's.
	Propagator propagation.TextMapPropagator
}

// DefaultStored is the default Config.Stored: a response is a result when
// the operation produced it, a success (2xx, 3xx) or a business
// rejection that a retry would not change (402 Payment Required: the card
// was declined). Every other 4xx is taken for a request refused before the
// operation ran (validation, authorisation, a missing resource), and every
// 5xx for a failure a retry may get past: neither is stored. Stored never
// sees a 1xx: an informational answer goes to the client as it is written
// and the final status that follows is the one decided on, and a 101
// Switching Protocols is refused (500, key released).
func DefaultStored(status int) bool {
	return status < 400 || status == http.StatusPaymentRequired
}

// withDefaults returns a copy of c with every zero field set to its default.
func (c *Config) withDefaults(store *dedup.Store) (Config, error) {
	var out Config
	if c != nil {
		out = *c
	}
	out.Header = textproto.CanonicalMIMEHeaderKey(cmp.Or(out.Header, DefaultHeader))
	if out.Methods == nil {
		out.Methods = DefaultMethods
	}
	out.Methods = slices.Clone(out.Methods)
	if out.Tenant == nil {
		out.Tenant = func(*http.Request) (string, error) { return "", nil }
	}
	if out.Fingerprint == nil {
		out.Fingerprint = RequestFingerprint
	}
	out.MaxBody = cmp.Or(out.MaxBody, DefaultMaxBody)
	if out.Stored == nil {
		out.Stored = DefaultStored
	}
	out.RetryAfter = cmp.Or(out.RetryAfter, DefaultRetryAfter)
	out.Timeout = cmp.Or(out.Timeout, DefaultTimeout)
	if out.Lease == 0 {
		out.Lease = store.Config().Lease
	}
	if out.Outbox == nil {
		ob, err := outbox.New(store.Pool(), &outbox.Config{Schema: store.Config().Schema})
		if err != nil {
			return out, err
		}
		out.Outbox = ob
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.TracerProvider == nil {
		out.TracerProvider = otel.GetTracerProvider()
	}
	if out.MeterProvider == nil {
		out.MeterProvider = otel.GetMeterProvider()
	}
	return out, out.validate()
}

func (c Config) validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("empty Consumer: name the API whose keys these are")
	case c.MaxBody < 0:
		return fmt.Errorf("MaxBody %d is negative", c.MaxBody)
	case c.Lease < time.Second:
		return fmt.Errorf("lease %s is shorter than 1s", c.Lease)
	case c.Timeout < 0 || c.RetryAfter < 0:
		return errors.New("negative Timeout or RetryAfter")
	}
	return nil
}
