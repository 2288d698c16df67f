// Package gateway is the HTTP front door behind `idemq gateway`: an
// endpoint that accepts a message for RabbitMQ exactly once per
// Idempotency-Key, so that a publisher in any language that speaks HTTP
// gets exactly-once publishing.
//
// # The endpoint
//
// POST /messages[?routing_key=K] runs behind the idemhttp middleware: the
// body and the Content-Type become a message whose message_id is the
// request's Idempotency-Key; the message goes into the outbox in the
// transaction that completes the key, and the relay that runs in the same
// process publishes it with publisher confirms. The answer is 202
// {"message_id": KEY, "status": "accepted"}; a retry with the same key and
// body replays that 202 (Idempotent-Replayed: true) and enqueues nothing;
// 400, 409 and 422 are the middleware's. A consumer downstream deduplicates
// by the same key, its message_id. GET /healthz answers 200 while Postgres
// answers: a message is accepted once it is in the outbox, whether or not
// the broker is up.
//
// # Who is at the door
//
// Every request first passes the Host check of internal/hostguard (421
// otherwise: DNS rebinding), then the bearer token when there are tokens
// (401, answered by the middleware), then the routing key: RoutingKey, or
// one a request names in ?routing_key= that AllowRoutingKeys allows (403,
// before the key is reserved, so nothing is stored). The server bounds how
// long a request may take to arrive (ReadTimeout) and how many connections
// it serves at once (MaxClients).
//
// # Tenants
//
// With a token file, a request needs "Authorization: Bearer TOKEN" and its
// tenant is the token's; with a tenant header (trusted deployments only:
// any client can set it) the tenant is that header; else every request is
// in the default tenant. The tenant scopes the key and travels with the
// message in the x-tenant-id header, which the consumers read by default.
package gateway

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"golang.org/x/net/netutil"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/hostguard"
	"github.com/idemq/idemq/outbox"
)

// Defaults used where a Config leaves a field zero.
const (
	DefaultDrainTimeout    = 10 * time.Second
	DefaultShutdownTimeout = 10 * time.Second
	// DefaultReadTimeout bounds the reading of a whole request, body
	// included: a client that never finishes its body is cut after it.
	DefaultReadTimeout = 30 * time.Second
	// DefaultReadHeaderTimeout bounds the reading of a request's headers.
	DefaultReadHeaderTimeout = 10 * time.Second
	// DefaultIdleTimeout bounds how long a kept-alive connection waits for
	// its next request.
	DefaultIdleTimeout = time.Minute
	// DefaultMaxClients bounds the connections served at once; more wait
	// in the listen backlog until one closes.
	DefaultMaxClients = 256
)

// Config configures a Gateway.
type Config struct {
	// Consumer scopes the gateway's keys (required).
	Consumer string
	// Exchange is the exchange messages go to ("" is the default
	// exchange, which routes by queue name).
	Exchange string
	// RoutingKey is the routing key of a request that names none in its
	// routing_key query parameter. With the default exchange, a request
	// with no routing key at all is refused (400).
	RoutingKey string
	// AllowRoutingKeys are the patterns of the other routing keys a
	// request may name in ?routing_key=, written as a topic exchange's
	// binding keys: words separated by dots, "*" for exactly one word, "#"
	// for zero or more ("orders.*", "audit.#"). Nil: a request may name
	// RoutingKey only. Any other routing key gets 403 before the request's
	// key is reserved. The list holds for every tenant.
	AllowRoutingKeys []string
	// Listen is the address the gateway listens on, as given to
	// net.Listen ("127.0.0.1:8080", ":8443", "gw.internal:8443"). With
	// AllowHosts it decides the Host headers the gateway answers to (the
	// defence against DNS rebinding of internal/hostguard: the listen
	// address, localhost, IP literals it is reached at); any other Host
	// gets 421 on every route. Default: the address of the listener Serve
	// is given.
	Listen string
	// AllowHosts are the other names the gateway answers to, exactly or
	// as "*.example.com" (names under example.com); an item may list
	// several, separated by commas.
	AllowHosts []string
	// Tokens maps bearer tokens to tenants (see ReadTokens). When set, a
	// request without a known token gets 401.
	Tokens map[string]string
	// TenantHeader, when set and Tokens is not, is the request header the
	// tenant is read from. Only for deployments where every client is trusted.
	TenantHeader string
	// AMQPURL is the broker the relay publishes to. The gateway starts and
	// accepts requests whether it answers or not; the relay publishes once
	// it does.
	AMQPURL string
	// Relay configures the relay.
	Relay outbox.RelayConfig
	// Middleware configures the idempotency middleware; its Consumer and
	// Tenant are the gateway's.
	Middleware idemhttp.Config
	// Around, when set, wraps the handler that enqueues the message, inside
	// the idempotency middleware: it runs only for a request that holds its
	// key, with the request's transaction (instrumentation; the demo slows
	// some requests down with it).
	Around func(http.Handler) http.Handler
	// ReadTimeout bounds the reading of a request, headers and body.
	// Default DefaultReadTimeout.
	ReadTimeout time.Duration
	// ReadHeaderTimeout bounds the reading of its headers. Default
	// DefaultReadHeaderTimeout (never more than ReadTimeout).
	ReadHeaderTimeout time.Duration
	// WriteTimeout bounds a request from the end of its headers to the end
	// of its answer. Default: ReadTimeout plus the middleware's handler
	// Timeout plus 10s, so that it never cuts a request the middleware
	// would still answer.
	WriteTimeout time.Duration
	// IdleTimeout bounds how long a kept-alive connection waits for its
	// next request. Default DefaultIdleTimeout.
	IdleTimeout time.Duration
	// MaxClients bounds the connections served at once (idle kept-alive
	// ones included); the next waits until one closes. Default
	// DefaultMaxClients.
	MaxClients int
	// DrainTimeout bounds the final flush of the outbox at shutdown.
	DrainTimeout time.Duration
	// ShutdownTimeout bounds how long the requests in hand may take after
	// the context ends.
	ShutdownTimeout time.Duration
	// Logger, default slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns c with its zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	c.DrainTimeout = cmp.Or(c.DrainTimeout, DefaultDrainTimeout)
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, DefaultShutdownTimeout)
	c.ReadTimeout = cmp.Or(c.ReadTimeout, DefaultReadTimeout)
	c.ReadHeaderTimeout = min(cmp.Or(c.ReadHeaderTimeout, DefaultReadHeaderTimeout), c.ReadTimeout)
	c.WriteTimeout = cmp.Or(c.WriteTimeout, c.ReadTimeout+cmp.Or(c.Middleware.Timeout, idemhttp.DefaultTimeout)+10*time.Second)
	c.IdleTimeout = cmp.Or(c.IdleTimeout, DefaultIdleTimeout)
	c.MaxClients = cmp.Or(c.MaxClients, DefaultMaxClients)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("empty consumer name")
	case c.ReadTimeout < 0 || c.ReadHeaderTimeout < 0 || c.WriteTimeout < 0 || c.IdleTimeout < 0:
		return errors.New("a negative timeout")
	case c.MaxClients < 1:
		return fmt.Errorf("max clients %d: want at least 1", c.MaxClients)
	}
	return nil
}

// Gateway is the HTTP front door: the middleware, the /messages handler
// and the relay of its outbox.
type Gateway struct {
	cfg    Config
	store  *dedup.Store
	outbox *outbox.Outbox
	relay  *outbox.Relay
	routes *routes
	mux    *http.ServeMux
	log    *slog.Logger
	tokens map[[32]byte]string
}

// New returns a gateway whose keys are store's and whose outbox is that of
// the store's schema.
func New(store *dedup.Store, cfg Config) (*Gateway, error) {
	if store == nil {
		return nil, errors.New("gateway: nil store")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	rt, err := newRoutes(cfg.Exchange, cfg.RoutingKey, cfg.AllowRoutingKeys)
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	if cfg.Listen != "" {
		// Checked here, where a bad name is the caller's to fix.
		if _, err := hostguard.New(cfg.Listen, cfg.AllowHosts); err != nil {
			return nil, fmt.Errorf("gateway: %w", err)
		}
	}
	ob, err := outbox.New(store.Pool(), &outbox.Config{Schema: store.Config().Schema})
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	g := &Gateway{cfg: cfg, store: store, outbox: ob, routes: rt, log: cfg.Logger.With("consumer", cfg.Consumer, "to_exchange", cfg.Exchange)}
	if cfg.Tokens != nil {
		// Looked up by hash, so that the lookup's time says nothing of
		// how much of a guessed token matches a real one.
		g.tokens = make(map[[32]byte]string, len(cfg.Tokens))
		for tok, tenant := range cfg.Tokens {
			g.tokens[sha256.Sum256([]byte(tok))] = tenant
		}
	}
	mcfg := cfg.Middleware
	mcfg.Consumer, mcfg.Tenant, mcfg.Outbox = cfg.Consumer, g.tenant, ob
	if mcfg.Logger == nil {
		mcfg.Logger = cfg.Logger
	}
	mw, err := idemhttp.New(store, &mcfg)
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	rcfg := cfg.Relay
	if rcfg.Logger == nil {
		rcfg.Logger = cfg.Logger
	}
	if cfg.AMQPURL != "" || rcfg.Dial != nil {
		if g.relay, err = outbox.NewRelay(ob, cfg.AMQPURL, &rcfg); err != nil {
			return nil, fmt.Errorf("gateway: %w", err)
		}
	}
	g.mux = http.NewServeMux()
	var accept http.Handler = http.HandlerFunc(g.accept)
	if cfg.Around != nil {
		accept = cfg.Around(accept)
	}
	g.mux.Handle("POST /messages", g.route(mw.Require(accept)))
	g.mux.HandleFunc("GET /healthz", g.healthz)
	return g, nil
}

var errNoToken = errors.New("no known bearer token")

// bearer is the token of an "Authorization: Bearer TOKEN" header; the
// scheme is matched without regard to case (RFC 9110, 11.1).
func bearer(authorization string) (string, bool) {
	scheme, tok, ok := strings.Cut(authorization, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimSpace(tok)
	return tok, tok != ""
}

// tenant is the tenant of a request: its token's, its tenant header's, or "".
func (g *Gateway) tenant(r *http.Request) (string, error) {
	if g.tokens != nil {
		tok, ok := bearer(r.Header.Get("Authorization"))
		if !ok {
			return "", errNoToken
		}
		tenant, ok := g.tokens[sha256.Sum256([]byte(tok))]
		if !ok {
			return "", errNoToken
		}
		return tenant, nil
	}
	if g.cfg.TenantHeader != "" {
		return r.Header.Get(g.cfg.TenantHeader), nil
	}
	return "", nil
}

// Accepted is the body of a 202.
type Accepted struct {
	MessageID string `json:"message_id"`
	Status    string `json:"status"`
}

// accept enqueues the request's body as a message in the request's
// transaction; the middleware completes the key in it and commits.
func (g *Gateway) accept(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "read body", http.StatusBadRequest)
		return
	}
	// The key as the middleware parsed it (an sf-string's content), never
	// the raw header.
	key := idemhttp.Key(r)
	msg := outbox.Message{
		Exchange:    g.cfg.Exchange,
		RoutingKey:  routingKey(r),
		Body:        body,
		ContentType: r.Header.Get("Content-Type"),
		MessageID:   key,
	}
	if tenant, _ := g.tenant(r); tenant != "" {
		msg.Headers = map[string]any{consumer.DefaultTenantHeader: tenant}
	}
	if err := g.outbox.Enqueue(r.Context(), idemhttp.Tx(r), msg); err != nil {
		g.log.Warn("enqueue", "err", err)
		http.Error(w, "the message could not be accepted; retry with the same key", http.StatusServiceUnavailable)
		return
	}
	b, _ := json.Marshal(Accepted{MessageID: key, Status: "accepted"})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write(append(b, '\n'))
}

func (g *Gateway) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	w.Header().Set("Content-Type", "application/json")
	if err := g.store.Pool().Ping(ctx); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, `{"status":"unavailable"}`)
		return
	}
	fmt.Fprintln(w, `{"status":"ok"}`)
}

// Serve serves on ln, with the relay running beside, until ctx ends; then
// it stops taking requests, lets those in hand finish (ShutdownTimeout),
// flushes the outbox (DrainTimeout) and returns nil. Every request passes
// the Host check first (Config.Listen, else ln's address, and AllowHosts);
// at most MaxClients connections of ln are served at once.
func (g *Gateway) Serve(ctx context.Context, ln net.Listener) error {
	guard, err := hostguard.New(cmp.Or(g.cfg.Listen, ln.Addr().String()), g.cfg.AllowHosts)
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	ln = netutil.LimitListener(ln, g.cfg.MaxClients)
	srv := &http.Server{
		Handler:           guard.Handler(g.mux),
		ReadTimeout:       g.cfg.ReadTimeout,
		ReadHeaderTimeout: g.cfg.ReadHeaderTimeout,
		WriteTimeout:      g.cfg.WriteTimeout,
		IdleTimeout:       g.cfg.IdleTimeout,
		ErrorLog:          slog.NewLogLogger(g.log.Handler(), slog.LevelWarn),
	}
	work := func(ctx context.Context) error {
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(ln) }()
		g.log.Info("serving", "addr", ln.Addr().String())
		select {
		case err := <-errc:
			return fmt.Errorf("serve: %w", err)
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), g.cfg.ShutdownTimeout)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			g.log.Warn("requests still in hand at shutdown", "err", err)
			_ = srv.Close()
		}
		<-errc
		return nil
	}
	if g.relay == nil {
		return work(ctx)
	}
	err = g.relay.RunBeside(ctx, g.cfg.DrainTimeout, work)
	g.log.Info("stopped")
	return err
}

// ReadTokens reads a token file: one "TOKEN TENANT" per line, separated by
// spaces or tabs; blank lines and lines starting with # are skipped.
func ReadTokens(r io.Reader) (map[string]string, error) {
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read tokens: %w", err)
	}
	out := map[string]string{}
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			return nil, fmt.Errorf("tokens line %d: want TOKEN TENANT", i+1)
		}
		if _, dup := out[f[0]]; dup {
			return nil, fmt.Errorf("tokens line %d: a token listed twice", i+1)
		}
		out[f[0]] = f[1]
	}
	if len(out) == 0 {
		return nil, errors.New("read tokens: no token in the file")
	}
	return out, nil
}
