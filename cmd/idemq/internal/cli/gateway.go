package cli

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/gateway"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/hostguard"
	"github.com/idemq/idemq/outbox"
)

// DefaultGatewayListen is where the gateway listens unless told otherwise.
const DefaultGatewayListen = "127.0.0.1:8080"

func (a *app) gatewayCommand() *cobra.Command {
	var (
		listen          string
		allowHosts      []string
		name            string
		toExchange      string
		routingKey      string
		allowKeys       []string
		readTimeout     time.Duration
		maxClients      int
		tenantHeader    string
		tokensFile      string
		docURL          string
		lease           time.Duration
		maxBody         int64
		maxConns        int
		hashKeys        bool
		shutdownTimeout time.Duration
		drainTimeout    time.Duration
		metricsAddr     string
	)
	cmd := &cobra.Command{
		Use:   "gateway --listen ADDR --consumer NAME --to-exchange X",
		Short: "Serve an HTTP endpoint that accepts a message for RabbitMQ once per Idempotency-Key",
		Long: `Serve POST /messages[?routing_key=K]: the body and its Content-Type become a
message to exchange X whose message_id is the request's Idempotency-Key. The
key is reserved in Postgres under the scope --consumer before anything runs;
the message goes into the outbox in the transaction that completes the key,
and a relay in this process publishes it with publisher confirms. The answer
is 202 {"message_id": KEY, "status": "accepted"}, sent after COMMIT; a retry
with the same key and body replays it (Idempotent-Replayed: true) and
publishes nothing more.

  400  missing or invalid key, or routing key (RFC 9457 problem body)
  401  no known bearer token (with --tokens)
  403  a routing key that --allow-routing-key does not allow
  409  a request with this key is in progress (Retry-After)
  421  a Host that is not this server's (see --allow-host)
  422  the key was first used for another request (body, query)
  503  Postgres out of reach: retry with the same key

GET /healthz answers 200 while Postgres answers. A message is accepted once it
is in the outbox, whether or not the broker is up: the gateway starts while
RabbitMQ is out of reach, and the relay publishes once it is back.

The routing key is --routing-key's; a request may name another in
?routing_key= only where an --allow-routing-key pattern matches it, written as
a topic exchange's binding keys ("*" one word, "#" zero or more: orders.*,
audit.#). The patterns hold for every tenant.

A request is answered only when its Host names this server: the --listen
address, localhost, an IP literal it is reached at, or a name of
--allow-host (exactly, or *.example.com): a web page whose name an attacker
points at this address (DNS rebinding) gets 421.

Tenants scope the keys and travel in the message's x-tenant-id header. With
--tokens FILE (one "TOKEN TENANT" per line) a request needs
"Authorization: Bearer TOKEN"; without it the gateway listens only on a
loopback address. --tenant-header H takes the tenant from a header: only for
deployments where every client is trusted. Runs until SIGINT or SIGTERM, then
finishes the requests in hand, flushes the outbox and exits 0.`,
		Example: `  idemq gateway --consumer orders-api --to-exchange orders
  curl -i -X POST localhost:8080/messages -H 'Idempotency-Key: 7f3c1e8a' -H 'Content-Type: application/json' -d '{"amount":4990}'
  idemq gateway --listen :8443 --allow-host gw.example.com --tokens /etc/idemq/tokens --consumer orders-api --to-exchange orders --routing-key created --allow-routing-key 'refunds.*'`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := nonEmpty(cmd.Flags(), "consumer", "listen"); err != nil {
				return err
			}
			if err := a.checkURLs(); err != nil {
				return err
			}
			switch {
			case toExchange == "" && routingKey == "" && len(allowKeys) == 0:
				return usagef("--to-exchange \"\" (the default exchange) needs --routing-key naming a queue, or --allow-routing-key patterns of the queues requests may name")
			case tokensFile != "" && tenantHeader != "":
				return usagef("--tokens and --tenant-header exclude each other: the tenant comes from the token")
			case lease != 0 && lease < time.Second:
				return usagef("--lease %s must be at least 1s", lease)
			case maxBody < 1 || maxConns < 4:
				return usagef("--max-body must be positive and --max-conns at least 4")
			case shutdownTimeout <= 0 || drainTimeout <= 0:
				return usagef("--shutdown-timeout and --drain-timeout must be positive")
			case readTimeout <= 0:
				return usagef("--read-timeout %s must be positive", readTimeout)
			case maxClients < 1:
				return usagef("--max-clients %d must be at least 1", maxClients)
			}
			if _, err := hostguard.New(listen, allowHosts); err != nil {
				return usagef("--allow-host: %v", err)
			}
			if err := gateway.CheckRoutingKeys(allowKeys); err != nil {
				return usagef("--allow-routing-key: %v", err)
			}
			var tokens map[string]string
			if tokensFile != "" {
				f, err := os.Open(tokensFile)
				if err != nil {
					return usagef("--tokens: %v", err)
				}
				tokens, err = gateway.ReadTokens(f)
				f.Close()
				if err != nil {
					return usagef("--tokens %s: %v", tokensFile, err)
				}
			} else if err := loopbackOnly(listen); err != nil {
				return err
			}
			ctx := cmd.Context()
			// Traces (a span per guarded request, continuing the client's
			// traceparent) and metrics, from the OTEL_* variables.
			if err := a.startTelemetryOn(ctx, metricsServer{addr: metricsAddr, allowHosts: allowHosts}, nil); err != nil {
				return err
			}
			// Postgres only: a message is accepted once it is in the
			// outbox, and the relay reaches the broker when it can.
			pool, err := a.openStorePool(ctx, int32(maxConns))
			if err != nil {
				return err
			}
			defer pool.Close()
			store, err := dedup.NewStore(pool, &dedup.Config{Schema: a.schema, Lease: lease, HashKeys: hashKeys})
			if err != nil {
				return err
			}
			direct, err := a.directConfig()
			if err != nil {
				return err
			}
			g, err := gateway.New(store, gateway.Config{
				Consumer:         name,
				Exchange:         toExchange,
				RoutingKey:       routingKey,
				AllowRoutingKeys: allowKeys,
				Listen:           listen,
				AllowHosts:       allowHosts,
				ReadTimeout:      readTimeout,
				MaxClients:       maxClients,
				Tokens:           tokens,
				TenantHeader:     tenantHeader,
				AMQPURL:          a.amqpURL,
				Relay:            outbox.RelayConfig{ConnectionName: "idemq-gateway-" + name + "-relay", ListenConfig: direct},
				Middleware:       idemhttp.Config{DocURL: docURL, MaxBody: maxBody},
				DrainTimeout:     drainTimeout,
				ShutdownTimeout:  shutdownTimeout,
				Logger:           a.log,
			})
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("listen on %s: %w", listen, err)
			}
			return g.Serve(ctx, ln)
		}),
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", DefaultGatewayListen, "host:port to serve on; without --tokens a loopback address only")
	f.StringVar(&name, "consumer", "", "stable name of this gateway: its keys are unique per (consumer, tenant, key) (required)")
	f.StringVar(&toExchange, "to-exchange", "", "exchange the messages are published to; \"\" is the default exchange (required)")
	f.StringVar(&routingKey, "routing-key", "", "routing key of the messages; a request may name another in ?routing_key= only where --allow-routing-key allows it")
	f.StringArrayVar(&allowKeys, "allow-routing-key", nil, "a pattern of the routing keys a request may name in ?routing_key=, as a topic binding key (\"*\" one word, \"#\" zero or more: orders.*, audit.#); repeatable (default: --routing-key only)")
	f.StringSliceVar(&allowHosts, "allow-host", nil, "another name the gateway answers to in Host (exactly, or *.example.com); repeatable or comma-separated (default: the --listen address, localhost and IP literals only)")
	f.DurationVar(&readTimeout, "read-timeout", gateway.DefaultReadTimeout, "how long a client may take to send a whole request, body included")
	f.IntVar(&maxClients, "max-clients", gateway.DefaultMaxClients, "connections served at once; more wait until one closes")
	f.StringVar(&tenantHeader, "tenant-header", "", "request header carrying the tenant (trusted deployments only; default: every request in the default tenant)")
	f.StringVar(&tokensFile, "tokens", "", "file of bearer tokens, one \"TOKEN TENANT\" per line: a request needs one, and its tenant is the token's")
	f.StringVar(&docURL, "doc-url", "", "documentation of the API's idempotency rules, linked from problem bodies as DOC-URL#code")
	f.DurationVar(&lease, "lease", dedup.DefaultLease, "lease of a reserved key (extended while the request runs)")
	f.Int64Var(&maxBody, "max-body", idemhttp.DefaultMaxBody, "largest request body in bytes (413 beyond)")
	f.IntVar(&maxConns, "max-conns", 20, "Postgres connections at most (two per request in flight, plus the relay's)")
	f.BoolVar(&hashKeys, "hash-keys", false, "store a SHA-256 of each key instead of the key")
	f.DurationVar(&shutdownTimeout, "shutdown-timeout", gateway.DefaultShutdownTimeout, "how long the requests in hand may take after a signal")
	f.DurationVar(&drainTimeout, "drain-timeout", gateway.DefaultDrainTimeout, "how long the relay keeps publishing the outbox after the server stopped")
	f.StringVar(&metricsAddr, "metrics-addr", "", "host:port where Prometheus metrics (/metrics: idemq_http_requests_total and the relay's) are served, e.g. :9090 (default: none; the gateway's own GET /healthz is on --listen)")
	requireFlags(cmd, "consumer", "to-exchange")
	return cmd
}

// loopbackOnly refuses a listen address that is not a loopback one: a
// gateway without tokens must not be reachable from other hosts.
func loopbackOnly(listen string) error {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return usagef("--listen %q: %v", listen, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return usagef("--listen %s is not a loopback address: without --tokens FILE the gateway serves only this host", listen)
}
