package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/dedup"
)

// keyReport is what `keys inspect` prints (also its --json form). Every
// field is always in the JSON, empty or null when the row has no value:
// docs/cli.md lists them, and a test holds the two together.
type keyReport struct {
	Consumer string `json:"consumer"`
	Tenant   string `json:"tenant"`
	KeyHash  string `json:"key_hash"`
	Hashed   bool   `json:"hashed"`
	// State is in_progress, released or completed (see stateOf).
	State string `json:"state"`
	// ReleaseReason says why a released key was given up.
	ReleaseReason  string     `json:"release_reason"`
	Attempts       int        `json:"attempts"`
	LockedUntil    *time.Time `json:"locked_until"`
	LeaseValid     bool       `json:"lease_valid"`
	Outcome        string     `json:"outcome"`
	ResponseCode   *int       `json:"response_code"`
	ResponseReason string     `json:"response_reason"`
	ResponseSize   *int       `json:"response_size"`
	// ResponseHeaders names the headers of a stored HTTP answer.
	ResponseHeaders []string   `json:"response_headers,omitempty"`
	RecoveryPoint   string     `json:"recovery_point"`
	RecoveryDataSz  int        `json:"recovery_data_size"`
	Steps           []string   `json:"steps"`
	Fingerprint     string     `json:"fingerprint"`
	TraceID         string     `json:"trace_id"`
	SpanID          string     `json:"span_id"`
	TraceURL        string     `json:"trace_url"`
	CreatedAt       time.Time  `json:"created_at"`
	UpdatedAt       time.Time  `json:"updated_at"`
	CompletedAt     *time.Time `json:"completed_at"`
}

// stateReleased is how keys inspect shows an in-progress row whose holder
// gave it up (dedup.Record.Released): no worker holds it, and the next
// delivery of the key takes it over.
const stateReleased = "released"

// stateOf is the state keys inspect shows: the row's, or released.
func stateOf(rec *dedup.Record) string {
	if rec.Released {
		return stateReleased
	}
	return string(rec.State)
}

func (a *app) keysCommand() *cobra.Command {
	var (
		name, tenant string
		hashed       bool
		asJSON       bool
	)
	inspect := &cobra.Command{
		Use:   "inspect --consumer C [--tenant T] KEY",
		Short: "Show the state of one idempotency key",
		Long: `Show the row of KEY in the scope (--consumer, --tenant): its state (in_progress,
released with the reason it was given up for, or completed), attempts, lease
(locked until, still valid?), outcome, stored response code, rejection reason
and size, recovery point and committed steps, creation and
completion times, and the trace id of its first processing. When the
environment variable IDEMQ_JAEGER_URL is set (e.g. http://localhost:16686), the
trace is also given as a link, $IDEMQ_JAEGER_URL/trace/<trace id>.

Give --hashed when the store keeps hashed keys (forward --hash-keys): KEY is
then hashed the same way before the lookup. The raw key is never printed; its
short hash is. Exits 1 with "key not found" and the scope it looked in when
the key has no row.`,
		Example: `  idemq keys inspect --consumer charge order-42
  idemq keys inspect --consumer charge --tenant acme --json order-42
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
			rec, err := store.Inspect(ctx, scope)
			if errors.Is(err, dedup.ErrNotFound) {
				return notFound(name, tenant)
			}
			if err != nil {
				return err
			}
			r := report(rec, scope.KeyHash(), hashed, a.getenv("IDEMQ_JAEGER_URL"))
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
	requireFlags(inspect, "consumer")
	return group("keys", "Inspect idempotency keys", "", inspect)
}

func report(rec *dedup.Record, keyHash string, hashed bool, jaeger string) keyReport {
	r := keyReport{
		Consumer:       rec.Consumer,
		Tenant:         rec.Tenant,
		KeyHash:        keyHash,
		Hashed:         hashed,
		State:          stateOf(rec),
		ReleaseReason:  rec.ReleaseReason,
		Attempts:       rec.Attempts,
		LockedUntil:    rec.LockedUntil,
		LeaseValid:     rec.LeaseValid,
		RecoveryPoint:  rec.RecoveryPoint,
		Steps:          rec.Steps,
		Fingerprint:    rec.Fingerprint.String(),
		TraceID:        rec.TraceID,
		SpanID:         rec.SpanID,
		CreatedAt:      rec.CreatedAt,
		UpdatedAt:      rec.UpdatedAt,
		CompletedAt:    rec.CompletedAt,
		RecoveryDataSz: len(rec.RecoveryData),
	}
	if r.Steps == nil {
		r.Steps = []string{}
	}
	if rec.Result != nil {
		r.Outcome, r.ResponseReason = string(rec.Result.Outcome), rec.Result.Reason
		code, size := rec.Result.Code, len(rec.Result.Response)
		r.ResponseCode, r.ResponseSize = &code, &size
		r.ResponseHeaders = slices.Sorted(maps.Keys(rec.Result.Headers))
	}
	if strings.Trim(r.TraceID, "0") == "" {
		// No tracer was installed when the key was first processed.
		r.TraceID, r.SpanID = "", ""
	}
	if jaeger != "" && r.TraceID != "" {
		r.TraceURL = strings.TrimRight(jaeger, "/") + "/trace/" + r.TraceID
	}
	return r
}

func printKey(a *app, r keyReport) {
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
	if r.State == stateReleased && r.ReleaseReason != "" {
		line("state", "%s (%s)", r.State, r.ReleaseReason)
	} else {
		line("state", "%s", r.State)
	}
	line("attempts", "%d", r.Attempts)
	switch {
	case r.LockedUntil == nil:
		line("lease", "none")
	case r.State == stateReleased:
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
	if r.TraceURL != "" {
		line("trace", "%s", r.TraceURL)
	}
	_ = w.Flush()
}

// notFound is the error of a key with no row, naming the scope looked in.
func notFound(consumer, tenant string) error {
	if tenant == "" {
		return fmt.Errorf("key not found (consumer %q, default tenant)", consumer)
	}
	return fmt.Errorf("key not found (consumer %q, tenant %q)", consumer, tenant)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
