package cli

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/hostguard"
)

// DefaultUIListen is where `idemq ui` listens by default.
const DefaultUIListen = ui.DefaultListen

func (a *app) uiCommand() *cobra.Command {
	var (
		listen, tokenFile, jaegerURL string
		queues, allowHosts           []string
		topo                         topologyFlags
		readOnly, showKeys, hashKeys bool
		letterLimit                  int
		limits                       ui.HealthLimits
		keyRetention                 time.Duration
		keyFrom                      string
	)
	cmd := &cobra.Command{
		Use:   "ui [--listen ADDR] [--queue Q[=CONSUMER] ...]",
		Short: "Serve the operator's web UI: keys, queues, dead letters, outbox",
		Long: `Serve the operator's web UI (docs/ui.md) on --listen: an overview of each
consumer scope's keys, each --queue's depth, retry tiers and dead letters by
reason, and the outbox backlog; the dead letters of a queue with their headers
and bodies, replayed one, a selection or all of one reason (as idemq dlq replay
does); the row of one key (as idemq keys inspect shows it); the outbox's
pending and parked rows, unparked after a confirmation. With --jaeger-url, the
recent suppressed duplicates per consumer scope (/duplicates) and any trace
(/trace?id=TRACEID) as a timeline whose span links open the linked trace,
read from the query API of that Jaeger (v1 or v2, with or without its UI).

--queue Q=CONSUMER names the consumer scope whose keys Q's messages claim, so
that a dead letter's key hash is the key_hash of the logs and spans. Q's retry
tiers are named from --max-attempts and the --retry-* flags (those of
topology apply). With --partitions N each Q is a partitioned queue (topology
apply --partitions N): the overview shows each partition Q.p0 … Q.p{N-1}, its
depths, dead letters and active consumer, and CONSUMER's blocked ordering
keys; each partition's dead letters have their page (/dlq?queue=Q.p0).

The overview flags what needs the operator, the most urgent first: ready
messages with no consumer, a queue missing, keys in progress past their lease,
retry tiers holding more than --warn-retrying, parked outbox rows, an outbox
row pending longer than --warn-outbox-age, dead letters that came in within
the last hour, a stalled partition, blocked ordering keys. GET /api/health
gives the same checks as JSON (503 while one is critical), for scripts and
alerting, with the same token.

It listens on loopback unless --auth-token-file is given: the file holds the
tokens of which every request must carry one, one per line as "NAME TOKEN"
(or a lone TOKEN, named "token"; # starts a comment), as "Authorization:
Bearer <token>" or from the session cookie the login form sets; what an
operator changes is recorded in the audit (idemq audit) under the token's
name (a session ends at logout, after
an hour unused, 12 hours after the login, or when the UI stops). It answers
only requests whose Host is the listen address, localhost or an IP it is
reached at, or a name given with --allow-host; others get 421 (a page whose
name is rebound to the UI's address reads nothing). Every change is a POST
with a CSRF token; --read-only refuses them all. Letters whose reason cannot
succeed unchanged (a reused or missing key, ...) are not offered for a replay
of their reason, and letters older than --key-retention are marked; either is
replayed only when its box on the confirmation page is ticked. Raw keys are shown only where the
operator typed them, unless --show-keys. Runs until SIGINT or SIGTERM.`,
		Example: `  idemq ui --queue payments=charge
  idemq ui --listen 0.0.0.0:8089 --auth-token-file /run/secrets/idemq-ui --allow-host idemq-ui.internal --read-only --queue payments=charge
  idemq ui --queue payments=charge --jaeger-url http://127.0.0.1:16686
  idemq ui --queue ledger=project --partitions 4`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			var tokens []ui.Token
			if tokenFile != "" {
				b, err := os.ReadFile(tokenFile)
				if err != nil {
					return usagef("--auth-token-file: %w", err)
				}
				if tokens, err = parseTokens(string(b)); err != nil {
					return usagef("--auth-token-file %s: %w", tokenFile, err)
				}
			}
			if err := ui.CheckListen(listen, len(tokens) > 0); err != nil {
				return usagef("--listen: %w", err)
			}
			if _, err := hostguard.New(listen, allowHosts); err != nil {
				return usagef("--allow-host: %w", err)
			}
			preset, err := consumer.ParseKeyPreset(keyFrom)
			if err != nil {
				return usagef("--key-from: %v", err)
			}
			if limits.OutboxAge <= 0 || limits.Retrying <= 0 || keyRetention <= 0 {
				return usagef("--warn-outbox-age, --warn-retrying and --key-retention must be positive")
			}
			var qs []ui.Queue
			for _, spec := range queues {
				name, consumerName := spec, ""
				if i := strings.LastIndex(spec, "="); i >= 0 {
					name, consumerName = spec[:i], spec[i+1:]
				}
				topo.queue = name
				if err := topo.validate(); err != nil {
					return err
				}
				qs = append(qs, ui.Queue{Topology: consumer.NewTopology(topo.config()), Consumer: consumerName})
			}
			if jaegerURL = strings.TrimRight(cmp.Or(jaegerURL, a.getenv("IDEMQ_JAEGER_URL")), "/"); jaegerURL != "" {
				if _, err := jaeger.New(jaegerURL, nil); err != nil {
					return usagef("--jaeger-url: %w", err)
				}
			}
			if err := a.checkAMQPURL(); err != nil {
				return err
			}
			ctx := cmd.Context()
			pool, err := a.openStorePool(ctx, 8)
			if err != nil {
				return err
			}
			defer pool.Close()
			srv, err := ui.New(ui.Config{
				Pool: pool, Schema: a.schema, HashKeys: hashKeys,
				Dial:   func() (*amqp.Connection, error) { return a.dialAMQP("idemq-ui") },
				Queues: qs, JaegerURL: jaegerURL,
				Listen: listen, AllowHosts: allowHosts,
				Tokens: tokens, ReadOnly: readOnly, ShowKeys: showKeys, LetterLimit: letterLimit, Health: limits, KeyRetention: keyRetention, KeyFrom: preset, Logger: a.log,
			})
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("listen on %s: %w", listen, err)
			}
			fmt.Fprintf(a.stdout, "idemq ui: serving http://%s/\n", ln.Addr())
			if jaegerURL != "" {
				fmt.Fprintf(a.stdout, "  duplicates and traces from Jaeger at %s: http://%s%s\n", jaegerURL, ln.Addr(), jaeger.DuplicatesPath)
			}
			return ui.Serve(ctx, ln, srv)
		}),
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", DefaultUIListen, "address to listen on (host:port); anything but loopback needs --auth-token-file")
	f.StringArrayVar(&queues, "queue", nil, "a work queue to show, as Q or Q=CONSUMER (repeatable)")
	f.StringVar(&jaegerURL, "jaeger-url", "", "base URL of the Jaeger the workers export to (its query API, with or without its UI): the Duplicates and trace pages read it, the key page links to them (env IDEMQ_JAEGER_URL)")
	f.StringSliceVar(&allowHosts, "allow-host", nil, "a host name the UI answers to beyond its address and localhost, e.g. idemq-ui.internal or *.example.com (repeatable; requests naming another host get 421)")
	f.StringVar(&tokenFile, "auth-token-file", "", "file holding the token every request must carry (bearer, or the login form's cookie)")
	f.BoolVar(&readOnly, "read-only", false, "refuse every change (replay, unpark)")
	f.BoolVar(&showKeys, "show-keys", false, "show raw keys (message_id, Idempotency-Key) instead of their hashes")
	f.BoolVar(&hashKeys, "hash-keys", false, "the store keeps SHA-256 hashes of keys (forward --hash-keys)")
	f.IntVar(&letterLimit, "dlq-limit", ui.DefaultLetterLimit, "most dead letters read for one page")
	f.StringVar(&keyFrom, "key-from", string(consumer.KeyFromMessageID), "the consumers' --key-from: where a dead letter's key is read from (message-id, masstransit, nservicebus, wolverine, cloudevents; docs/interop.md)")
	f.DurationVar(&keyRetention, "key-retention", dedup.DefaultRetention, "the key store's retention (idemq gc --retention): older dead letters are marked, and replayed only when ticked")
	f.DurationVar(&limits.OutboxAge, "warn-outbox-age", ui.DefaultOutboxAge, "flag the outbox when its oldest pending row is older than this")
	f.IntVar(&limits.Retrying, "warn-retrying", ui.DefaultRetrying, "flag a queue with more messages than this in its retry tiers")
	f.IntVar(&topo.maxAttempts, "max-attempts", consumer.DefaultMaxAttempts, "the queues' --max-attempts (names their retry tiers)")
	f.DurationVar(&topo.retryInitial, "retry-initial", consumer.DefaultRetryInitial, "the queues' --retry-initial (names their retry tiers)")
	f.Float64Var(&topo.retryMultiplier, "retry-multiplier", consumer.DefaultRetryMultiplier, "the queues' --retry-multiplier (names their retry tiers)")
	f.DurationVar(&topo.retryMax, "retry-max", consumer.DefaultRetryMax, "the queues' --retry-max (names their retry tiers)")
	f.IntVar(&topo.partitions, "partitions", 0, "the queues' --partitions: show each of Q.p0 … Q.p{N-1}, its active consumer and the blocked ordering keys (0: not partitioned)")
	topo.deliveryLimit = consumer.DefaultDeliveryLimit
	return cmd
}

// parseTokens reads the UI's tokens file: one token per line, "NAME TOKEN"
// or a lone TOKEN (named ui.DefaultTokenName); blank lines and lines
// starting with # are skipped. Each token is at least 16 characters, and
// names and tokens are unique.
func parseTokens(text string) ([]ui.Token, error) {
	var out []ui.Token
	names, secrets := map[string]bool{}, map[string]bool{}
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		t := ui.Token{Name: ui.DefaultTokenName}
		switch f := strings.Fields(line); len(f) {
		case 1:
			t.Secret = f[0]
		case 2:
			t.Name, t.Secret = f[0], f[1]
		default:
			return nil, fmt.Errorf("line %d: want NAME TOKEN, or a lone TOKEN", i+1)
		}
		if len(t.Secret) < 16 {
			return nil, fmt.Errorf("line %d: the token must be at least 16 characters", i+1)
		}
		if names[t.Name] || secrets[t.Secret] {
			return nil, fmt.Errorf("line %d: a name or token given twice", i+1)
		}
		names[t.Name], secrets[t.Secret] = true, true
		out = append(out, t)
	}
	if len(out) == 0 {
		return nil, errors.New("no token in it")
	}
	return out, nil
}
