package cli

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
	"github.com/idemq/idemq/cmd/idemq/internal/keys"
	"github.com/idemq/idemq/dedup"
)

func (a *app) keysCommand() *cobra.Command {
	var (
		name, tenant string
		hashed       bool
		asJSON       bool
		uiURL        string
	)
	inspect := &cobra.Command{
		Use:   "inspect --consumer C [--tenant T] KEY",
		Short: "Show the state of one idempotency key",
		Long: `Show the row of KEY in the scope (--consumer, --tenant): its state (in_progress,
released with the reason it was given up for, or completed), attempts, lease
(locked until, still valid?), outcome, stored response code, rejection reason
and size, recovery point and committed steps, creation and
completion times, and the trace id of its first processing. With --ui-url
(or IDEMQ_UI_URL), the base URL of a running idemq ui started with
--jaeger-url, the trace is given as a link to that UI's trace page,
<ui-url>/trace?id=<trace id>, which shows it from any Jaeger's query API.
When the environment variable IDEMQ_JAEGER_URL is set (e.g.
http://localhost:16686), the trace is also given as a link into Jaeger's own
UI, $IDEMQ_JAEGER_URL/trace/<trace id> (which only a Jaeger that serves its UI
opens; the local one of make jaeger serves none).

Give --hashed when the store keeps hashed keys (forward --hash-keys): KEY is
then hashed the same way before the lookup. The raw key is never printed; its
short hash is. Exits 1 with "key not found" and the scope it looked in when
the key has no row.`,
		Example: `  idemq keys inspect --consumer charge order-42
  idemq keys inspect --consumer charge --tenant acme --json order-42
  idemq keys inspect --consumer charge --ui-url http://127.0.0.1:8089 order-42
  IDEMQ_JAEGER_URL=http://localhost:16686 idemq keys inspect --consumer charge order-42`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usagef("keys inspect takes exactly one KEY, got %d arguments", len(args))
			}
			return nil
		},
		RunE: run(func(cmd *cobra.Command, args []string) error {
			if err := nonEmpty(cmd.Flags(), "consumer"); err != nil {
				return err
			}
			key := args[0]
			if err := dedup.ValidateKey(key); err != nil {
				return usagef("KEY: %v", err)
			}
			uiURL = cmp.Or(uiURL, a.getenv("IDEMQ_UI_URL"))
			if u, err := url.Parse(uiURL); uiURL != "" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "") {
				return usagef("--ui-url %q: want the UI's base URL, e.g. http://127.0.0.1:8089", uiURL)
			}
			ctx := cmd.Context()
			pool, err := a.openStorePool(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			store, err := dedup.NewStore(pool, &dedup.Config{Schema: a.schema, HashKeys: hashed})
			if err != nil {
				return err
			}
			scope := dedup.Scope{Consumer: name, Tenant: tenant, Key: key}
			r, _, err := keys.Lookup(ctx, store, scope, a.getenv("IDEMQ_JAEGER_URL"))
			if err != nil {
				return err
			}
			r.UITraceURL = jaeger.TracePageURL(uiURL, r.TraceID)
			if asJSON {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(r)
			}
			printKey(a, r)
			return nil
		}),
	}
	f := inspect.Flags()
	f.StringVar(&name, "consumer", "", "the consumer (stage) name whose scope holds the key: its consumer.Config.Name, the --consumer of forward (required)")
	f.StringVar(&tenant, "tenant", "", "the tenant of the key (default: the default tenant, empty)")
	f.BoolVar(&hashed, "hashed", false, "the store keeps SHA-256 hashes of keys (forward --hash-keys)")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	f.StringVar(&uiURL, "ui-url", "", "base URL of a running idemq ui, to link the trace to its trace page (env IDEMQ_UI_URL)")
	requireFlags(inspect, "consumer")
	return group("keys", "Inspect idempotency keys", "", inspect)
}

func printKey(a *app, r keys.Report) {
	w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	line := func(k, format string, args ...any) { fmt.Fprintf(w, "%s:\t"+format+"\n", append([]any{k}, args...)...) }
	ts := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	line("consumer", "%s", r.Consumer)
	if r.Tenant == "" {
		line("tenant", "(default)")
	} else {
		line("tenant", "%s", r.Tenant)
	}
	line("key hash", "%s", r.KeyHash)
	if r.State == keys.StateReleased && r.ReleaseReason != "" {
		line("state", "%s (%s)", r.State, r.ReleaseReason)
	} else {
		line("state", "%s", r.State)
	}
	line("attempts", "%d", r.Attempts)
	switch {
	case r.LockedUntil == nil:
		line("lease", "none")
	case r.State == keys.StateReleased:
		line("lease", "released at %s", ts(r.LockedUntil))
	case r.LeaseValid:
		line("lease", "valid, locked until %s", ts(r.LockedUntil))
	default:
		line("lease", "expired, was locked until %s", ts(r.LockedUntil))
	}
	if r.ResponseReason != "" {
		line("outcome", "%s: %s", r.Outcome, r.ResponseReason)
	} else {
		line("outcome", "%s", dash(r.Outcome))
	}
	if r.ResponseCode != nil {
		if len(r.ResponseHeaders) > 0 {
			line("response", "code %d, %d bytes, headers %s", *r.ResponseCode, *r.ResponseSize, strings.Join(r.ResponseHeaders, ", "))
		} else {
			line("response", "code %d, %d bytes", *r.ResponseCode, *r.ResponseSize)
		}
	} else {
		line("response", "-")
	}
	line("recovery point", "%s", dash(r.RecoveryPoint))
	line("steps", "%s", dash(strings.Join(r.Steps, ", ")))
	line("created", "%s", ts(&r.CreatedAt))
	line("completed", "%s", ts(r.CompletedAt))
	line("trace id", "%s", dash(r.TraceID))
	if r.UITraceURL != "" {
		line("ui trace", "%s", r.UITraceURL)
	}
	if r.TraceURL != "" {
		line("trace", "%s", r.TraceURL)
	}
	_ = w.Flush()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
