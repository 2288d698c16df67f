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

	"github.com/idemq/idemq/cmd/idemq/internal/relayrun"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/outbox"
)

// Defaults used where a Config leaves a field zero.
const (
	DefaultDrainTimeout    = 10 * time.Second
	DefaultShutdownTimeout = 10 * time.Second
)

// Config configures a Gateway.
type Config struct {
	// Consumer scopes the gateway's keys (required).
	Consumer string
	// Exchange and RoutingKey are where messages go; a request's
	// routing_key query parameter overrides RoutingKey.
	Exchange, RoutingKey string
	// Tokens maps bearer tokens to tenants (see ReadTokens). When set, a
	// request without a known token gets 401.
	Tokens map[string]string
	// TenantHeader, when set and Tokens is not, is the request header the
	// tenant is read from. Only for deployments where every client is trusted.
	TenantHeader string
	// AMQPURL is the broker the relay publishes to.
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
	// DrainTimeout bounds the final flush of the outbox at shutdown.
	DrainTimeout time.Duration
	// ShutdownTimeout bounds how long the requests in hand may take after
	// the context ends.
	ShutdownTimeout time.Duration
	// Logger, default slog.Default().
	Logger *slog.Logger
}

// Gateway is the HTTP front door: the middleware, the /messages handler
// and the relay of its outbox.
type Gateway struct {
	cfg    Config
	store  *dedup.Store
	outbox *outbox.Outbox
	relay  *outbox.Relay
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
	if cfg.Consumer == "" {
		return nil, errors.New("gateway: empty consumer name")
	}
	cfg.DrainTimeout = cmp.Or(cfg.DrainTimeout, DefaultDrainTimeout)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, DefaultShutdownTimeout)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ob, err := outbox.New(store.Pool(), &outbox.Config{Schema: store.Config().Schema})
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	g := &Gateway{cfg: cfg, store: store, outbox: ob, log: cfg.Logger.With("consumer", cfg.Consumer, "to_exchange", cfg.Exchange)}
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
	g.mux.Handle("POST /messages", mw.Require(accept))
	g.mux.HandleFunc("GET /healthz", g.healthz)
	return g, nil
}

// Handler returns the gateway's HTTP handler (POST /messages, GET /healthz).
func (g *Gateway) Handler() http.Handler { return g.mux }

var errNoToken = errors.New("no known bearer token")

// tenant is the tenant of a request: its token's, its tenant header's, or "".
func (g *Gateway) tenant(r *http.Request) (string, error) {
	if g.tokens != nil {
		tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok {
			return "", errNoToken
		}
		tenant, ok := g.tokens[sha256.Sum256([]byte(strings.TrimSpace(tok)))]
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
	key := r.Header.Get(idemhttp.DefaultHeader)
	if h := g.cfg.Middleware.Header; h != "" {
		key = r.Header.Get(h)
	}
	msg := outbox.Message{
		Exchange:    g.cfg.Exchange,
		RoutingKey:  cmp.Or(r.URL.Query().Get("routing_key"), g.cfg.RoutingKey),
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
// flushes the outbox (DrainTimeout) and returns nil.
func (g *Gateway) Serve(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{
		Handler:           g.mux,
		ReadHeaderTimeout: 10 * time.Second,
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
	err := relayrun.Run(ctx, g.outbox, g.relay, g.cfg.DrainTimeout, g.log, work)
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
