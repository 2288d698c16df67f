package ui

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/hostguard"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// Defaults used where Config leaves a field zero.
const (
	DefaultRefresh     = 10 * time.Second
	DefaultLetterLimit = 500
	DefaultBodyLimit   = 4096
	// DefaultListen is the address the server listens on, where
	// Config.Listen leaves it empty.
	DefaultListen = "127.0.0.1:8089"
)

// Queue is a work queue the UI shows, with the consumer scope its messages
// claim their keys in (so that a dead letter's key hash is the one in the
// logs; "" when unknown). A partitioned queue (Topology.Partitions) is shown
// partition by partition, and each partition is a queue of the UI with the
// same Consumer: its dead letters have their page, and are replayed to it.
type Queue struct {
	Topology consumer.Topology
	Consumer string
}

// Config configures a Server.
type Config struct {
	// Pool reaches the key store and the outbox, in Schema.
	Pool   *pgxpool.Pool
	Schema string
	// HashKeys: the store keeps hashed keys (forward --hash-keys).
	HashKeys bool
	// Dial opens a broker connection; the server keeps one and dials
	// again when it is lost.
	Dial func() (*amqp.Connection, error)
	// Queues are the work queues shown.
	Queues []Queue
	// JaegerURL, when set, is the Jaeger whose query API the Duplicates
	// and trace pages read (its base URL, e.g. http://127.0.0.1:16686),
	// and links a key's first processing to its trace.
	JaegerURL string
	// Listen is the address the server listens on (host:port, as given to
	// net.Listen). With AllowHosts it decides which Host values the server
	// answers to, against DNS rebinding (package hostguard): its IP (any
	// loopback IP for a loopback address, any IP for every interface), its
	// host name, and localhost. Default DefaultListen.
	Listen string
	// AllowHosts are host names beyond those of Listen that the server
	// answers to, each exact ("ui.example.com") or a wildcard for the names
	// under a domain ("*.example.com"); a value may be a comma-separated
	// list. A request naming another host gets 421 Misdirected Request.
	AllowHosts []string
	// Token, when set, is required of every request (bearer or session
	// cookie set by the login form), as one of Tokens, named
	// DefaultTokenName.
	Token string
	// Tokens, when set, are the tokens of which every request must carry
	// one; a change is recorded in the audit under its token's name.
	Tokens []Token
	// ReadOnly refuses every change (replay, unpark).
	ReadOnly bool
	// ShowKeys shows raw keys (message_id, Idempotency-Key) where the UI
	// otherwise shows their hashes.
	ShowKeys bool
	// KeyHeader is the header a key is read from when a message has no
	// message_id. Default consumer.DefaultKeyHeader.
	KeyHeader string
	// KeyFrom is the consumers' key preset (consumer.Config.KeyFrom): where
	// a dead letter's key is read from (a MassTransit envelope, a
	// CloudEvent's source and id). Default message_id.
	KeyFrom consumer.KeyPreset
	// TenantHeader is the header a tenant is read from. Default consumer.DefaultTenantHeader.
	TenantHeader string
	// Refresh is the overview's refresh interval. Default DefaultRefresh.
	Refresh time.Duration
	// LetterLimit bounds the dead letters read for one page. Default DefaultLetterLimit.
	LetterLimit int
	// BodyLimit bounds the bytes of a body shown. Default DefaultBodyLimit.
	BodyLimit int
	// KeyRetention is the key store's retention (idemq gc --retention): a
	// dead letter older than it is marked, and replayed only when the
	// operator ticks it (its key may be gone: it would run again). Default
	// dedup.DefaultRetention.
	KeyRetention time.Duration
	// Health bounds what the overview and /api/health flag as backing up.
	Health HealthLimits
	// Logger receives the server's logs. Default slog.Default().
	Logger *slog.Logger
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Server serves the UI. It is an http.Handler.
type Server struct {
	cfg    Config
	store  *dedup.Store
	outbox *outbox.Outbox
	// queues are the queues with a DLQ, by name: those given and the
	// partitions of those partitioned.
	queues map[string]Queue
	// shown are the queues given, by name.
	shown   []Queue
	pages   map[string]*template.Template
	handler http.Handler
	guard   *hostguard.Guard
	secrets secrets
	// sessions are the browsers logged in with the token.
	sessions *sessions
	log      *slog.Logger

	connMu sync.Mutex
	conn   *amqp.Connection

	jobs *jobs
	ops  *onceTokens

	readMu sync.Mutex
	reads  map[string]*sync.Mutex // by DLQ: see readLetters

	// arrivals are the dead letters seen coming into each DLQ.
	arrivals arrivals
	// audit records what the operators change.
	audit *audit.Recorder

	// jaeger reads Config.JaegerURL's query API (nil without one).
	jaeger *jaeger.Client
}

// New returns the server cfg describes.
func New(cfg Config) (*Server, error) {
	if cfg.Pool == nil || cfg.Dial == nil {
		return nil, errors.New("ui: a pool and a broker dialer are required")
	}
	cfg.Refresh = cmp.Or(cfg.Refresh, DefaultRefresh)
	cfg.LetterLimit = cmp.Or(cfg.LetterLimit, DefaultLetterLimit)
	cfg.BodyLimit = cmp.Or(cfg.BodyLimit, DefaultBodyLimit)
	cfg.KeyHeader = cmp.Or(cfg.KeyHeader, consumer.DefaultKeyHeader)
	cfg.TenantHeader = cmp.Or(cfg.TenantHeader, consumer.DefaultTenantHeader)
	cfg.Listen = cmp.Or(cfg.Listen, DefaultListen)
	cfg.KeyRetention = cmp.Or(cfg.KeyRetention, dedup.DefaultRetention)
	if _, err := consumer.ParseKeyPreset(string(cfg.KeyFrom)); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	s := &Server{cfg: cfg, queues: map[string]Queue{}, log: cmp.Or(cfg.Logger, slog.Default()),
		sessions: newSessions(time.Now), jobs: newJobs(), ops: newOnceTokens(), reads: map[string]*sync.Mutex{}}
	var err error
	if s.guard, err = hostguard.New(cfg.Listen, cfg.AllowHosts); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	if s.store, err = dedup.NewStore(cfg.Pool, &dedup.Config{Schema: cfg.Schema, HashKeys: cfg.HashKeys}); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	if s.outbox, err = outbox.New(cfg.Pool, &outbox.Config{Schema: cfg.Schema}); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	s.audit = audit.New(cfg.Pool, s.store.Config().Schema)
	for _, q := range cfg.Queues {
		for _, p := range q.Topology.Partitions {
			s.queues[p.Queue] = Queue{Topology: p, Consumer: q.Consumer}
		}
		if len(q.Topology.Partitions) == 0 {
			s.queues[q.Topology.Queue] = q
		}
	}
	byName := func(a, b Queue) int { return strings.Compare(a.Topology.Queue, b.Topology.Queue) }
	s.shown = slices.CompactFunc(slices.SortedStableFunc(slices.Values(cfg.Queues), byName),
		func(a, b Queue) bool { return byName(a, b) == 0 })
	if s.jaeger, err = newJaeger(cfg.JaegerURL); err != nil {
		return nil, fmt.Errorf("ui: --jaeger-url: %w", err)
	}
	tokens := slices.Clone(cfg.Tokens)
	if cfg.Token != "" {
		tokens = append(tokens, Token{Name: DefaultTokenName, Secret: cfg.Token})
	}
	if s.secrets, err = newSecrets(tokens); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	if s.pages, err = parsePages(); err != nil {
		return nil, fmt.Errorf("ui: %w", err)
	}
	s.handler = s.routes()
	s.jobs.wg.Go(func() { s.sample(s.jobs.ctx) })
	return s, nil
}

// ServeHTTP serves the UI.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// Close closes the server's broker connection and waits for the replays
// in flight to end (each stops after the message in hand when ctx ends)
// and for the DLQ sampler to stop.
func (s *Server) Close(ctx context.Context) {
	s.jobs.stop(ctx)
	if s.jaeger != nil {
		s.jaeger.Close()
	}
	s.connMu.Lock()
	defer s.connMu.Unlock()
	if s.conn != nil {
		_ = s.conn.Close()
		s.conn = nil
	}
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(staticFS, "static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /login", s.loginPage)
	mux.HandleFunc("POST /login", s.login)
	mux.HandleFunc("POST /logout", s.logout)
	mux.HandleFunc("GET /{$}", s.overview)
	mux.HandleFunc("GET /api/health", s.healthAPI)
	mux.HandleFunc("GET /dlq", s.deadLetters)
	mux.HandleFunc("GET /dlq/letter", s.letter)
	mux.HandleFunc("POST /dlq/replay/confirm", s.changing(s.replayConfirm))
	mux.HandleFunc("POST /dlq/replay", s.changing(s.replay))
	mux.HandleFunc("GET /jobs", s.job)
	mux.HandleFunc("GET /keys", s.keyLookup)
	mux.HandleFunc("POST /keys", s.keyLookup)
	mux.HandleFunc("GET /outbox", s.outboxPage)
	mux.HandleFunc("GET /audit", s.auditPage)
	mux.HandleFunc("GET "+jaeger.DuplicatesPath, s.duplicates)
	mux.HandleFunc("GET "+jaeger.TracePath, s.tracePage)
	mux.HandleFunc("POST /outbox/unpark/confirm", s.changing(s.unparkConfirm))
	mux.HandleFunc("POST /outbox/unpark", s.changing(s.unpark))
	cop := http.NewCrossOriginProtection()
	// The Host check comes first: a page of another name (rebound to this
	// address) is answered nothing, not even the login page or a style sheet.
	return s.guard.Handler(securityHeaders(cop.Handler(s.authenticate(s.checkCSRF(mux)))))
}

// changing marks a handler that changes state: refused when read-only.
func (s *Server) changing(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.cfg.ReadOnly {
			s.fail(w, r, http.StatusForbidden, errors.New("the UI is read-only (--read-only): nothing can be changed from it"))
			return
		}
		h(w, r)
	}
}

// securityHeaders keeps the pages out of frames, caches and referrers, and
// lets them load nothing but the UI's own style sheet.
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Frame-Options", "DENY")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// amqpConn returns the server's broker connection, dialling it when there is
// none or it was lost.
func (s *Server) amqpConn() (*amqp.Connection, error) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	if s.conn != nil && !s.conn.IsClosed() {
		return s.conn, nil
	}
	conn, err := s.cfg.Dial()
	if err != nil {
		return nil, err
	}
	s.conn = conn
	return conn, nil
}

// errText is an error as a page shows it: without credentials.
func errText(err error) string { return redact.Error(err) }

// Serve serves s on ln until ctx ends, then shuts down: the requests in
// flight get shutdownTimeout to finish, the replays in flight stop after the
// message in hand.
func Serve(ctx context.Context, ln net.Listener, s *Server) error {
	hs := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		s.Close(context.Background())
		return fmt.Errorf("ui: serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	err := hs.Shutdown(sctx)
	s.Close(sctx)
	if err != nil {
		return fmt.Errorf("ui: shut down: %w", err)
	}
	return nil
}

// shutdownTimeout bounds Serve's shutdown.
const shutdownTimeout = 10 * time.Second
