package cli

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/internal/demo"
)

func (a *app) demoCommand() *cobra.Command {
	var (
		o      demo.Options
		noKill bool
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the payments scenario end to end",
		Long: `Run the main job end to end on the Postgres and RabbitMQ of --postgres-url and
--amqp-url: reset a demo schema and a demo queue (their names must contain
"demo"), start worker processes (this binary again), publish thousands of card
payments with duplicates (including bursts of 20 concurrent copies of one key),
key reuse, poison messages, missing and invalid keys and injected infrastructure
failures, kill one worker with SIGKILL mid-run and start a replacement, wait
until everything settled, stop the workers with SIGTERM, and print a report:
published, unique keys, effects applied (must equal the keys processed),
duplicates suppressed, retries, dead letters by reason, and the trace of one
suppressed duplicate ($IDEMQ_JAEGER_URL/trace/<id> when IDEMQ_JAEGER_URL is set;
traces are exported when OTEL_EXPORTER_OTLP_ENDPOINT is set).

Exits 1 when the scenario cannot run or its invariant does not hold. The global
--schema is not used: the demo has its own (--demo-schema), which it drops and
recreates.`,
		Example: `  idemq demo
  idemq demo --payments 500 --workers 2
  IDEMQ_JAEGER_URL=http://127.0.0.1:16686 OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 idemq demo`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			o.PostgresURL, o.AMQPURL = a.postgresURL, a.amqpURL
			if noKill {
				o.KillAt = -1
			}
			// The scenario and its workers (this command again) trace when
			// OTEL_EXPORTER_OTLP_ENDPOINT is set.
			if err := a.startTelemetry(cmd.Context(), ""); err != nil {
				return err
			}
			rep, err := demo.Run(cmd.Context(), o, a.stdout)
			if err != nil {
				return err
			}
			if !rep.OK() {
				return errors.New("demo: the invariant does not hold (see the report)")
			}
			return nil
		}),
	}
	f := cmd.Flags()
	f.IntVar(&o.Payments, "payments", demo.DefaultPayments, "unique payments (duplicates, bursts and bad messages come on top)")
	f.IntVar(&o.Payments, "messages", demo.DefaultPayments, "same as --payments")
	_ = f.MarkHidden("messages")
	f.IntVar(&o.Workers, "workers", demo.DefaultWorkers, "worker processes")
	f.IntVar(&o.Concurrency, "concurrency", demo.DefaultConcurrency, "handlers per worker")
	f.Float64Var(&o.KillAt, "kill-at", demo.DefaultKillAt, "fraction of the messages settled when one worker is killed")
	f.BoolVar(&noKill, "no-kill", false, "kill no worker")
	f.Int64Var(&o.Seed, "seed", 0, "seed of the scenario, for a reproducible run (0: random, printed)")
	f.DurationVar(&o.Timeout, "timeout", demo.DefaultTimeout, "how long to wait for every message to settle")
	f.StringVar(&o.Schema, "demo-schema", demo.DefaultSchema, "Postgres schema of the demo, dropped and recreated (must contain \"demo\")")
	f.StringVar(&o.Queue, "queue", demo.DefaultQueue, "work queue of the demo, deleted and redeclared (must contain \"demo\")")
	f.StringVar(&o.LogDir, "log-dir", "", "directory for the workers' logs (default: a new temporary directory)")
	return cmd
}

func (a *app) benchCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "bench",
		Short: "Run the benchmark of docs/benchmarks.md",
		Long: `Run the benchmark described in docs/benchmarks.md. Until it is built into the
binary, this prints how to run the benchmarks with go test.`,
		Example: `  idemq bench`,
		Args:    noArgs,
		RunE: run(func(*cobra.Command, []string) error {
			fmt.Fprintln(a.stdout, `The benchmark is not built into this binary yet.
See docs/benchmarks.md, and run the Go benchmarks against local services:
  go test -run '^$' -bench . -benchmem ./dedup/ ./consumer/ ./outbox/`)
			return nil
		}),
	}
}

func (a *app) versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "version",
		Short:   "Print the version of idemq",
		Example: `  idemq version`,
		Args:    noArgs,
		RunE: run(func(*cobra.Command, []string) error {
			rev := ""
			if bi, ok := debug.ReadBuildInfo(); ok {
				for _, s := range bi.Settings {
					if s.Key == "vcs.revision" && len(s.Value) >= 12 {
						rev = " " + s.Value[:12]
					}
				}
			}
			fmt.Fprintf(a.stdout, "idemq %s%s (%s %s/%s)\n", Version, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
			return nil
		}),
	}
}
