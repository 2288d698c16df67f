package cli

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/bench"
	"github.com/idemq/idemq/cmd/idemq/internal/demo"
	"github.com/idemq/idemq/cmd/idemq/internal/ui"
)

func (a *app) demoCommand() *cobra.Command {
	var (
		o      demo.Options
		noKill bool
		withUI bool
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

With --ui the web UI (idemq ui, docs/ui.md) stays up at the end on the demo's
schema and queue, on --ui-listen, with one worker to handle what is replayed,
until SIGINT or SIGTERM.

Exits 1 when the scenario cannot run or its invariant does not hold. The global
--schema is not used: the demo has its own (--demo-schema), which it drops and
recreates.`,
		Example: `  idemq demo
  idemq demo --payments 500 --workers 2
  idemq demo --payments 500 --ui
  IDEMQ_JAEGER_URL=http://127.0.0.1:16686 OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 idemq demo`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := a.checkURLs(); err != nil {
				return err
			}
			o.PostgresURL, o.AMQPURL = a.postgresURL, a.amqpURL
			if noKill {
				o.KillAt = -1
			}
			if !withUI {
				o.UIListen = ""
			} else if err := ui.CheckListen(o.UIListen, false); err != nil {
				return usagef("--ui-listen: %w", err)
			}
			// The scenario and its workers (this command again) trace when
			// OTEL_EXPORTER_OTLP_ENDPOINT is set.
			if err := a.startTelemetry(cmd.Context(), "", nil); err != nil {
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
	f.IntVar(&o.HTTPPayments, "http-payments", demo.DefaultHTTPPayments, "unique payments of the HTTP part, POSTed through idemq gateway by clients that time out and retry (negative: skip it)")
	f.IntVar(&o.Workers, "workers", demo.DefaultWorkers, "worker processes")
	f.IntVar(&o.Concurrency, "concurrency", demo.DefaultConcurrency, "handlers per worker")
	f.Float64Var(&o.KillAt, "kill-at", demo.DefaultKillAt, "fraction of the messages settled when one worker is killed")
	f.BoolVar(&noKill, "no-kill", false, "kill no worker")
	f.Int64Var(&o.Seed, "seed", 0, "seed of the scenario, for a reproducible run (0: random, printed)")
	f.DurationVar(&o.Timeout, "timeout", demo.DefaultTimeout, "how long to wait for every message to settle")
	f.StringVar(&o.Schema, "demo-schema", demo.DefaultSchema, "Postgres schema of the demo, dropped and recreated (must contain \"demo\")")
	f.StringVar(&o.Queue, "queue", demo.DefaultQueue, "work queue of the demo, deleted and redeclared (must contain \"demo\")")
	f.StringVar(&o.LogDir, "log-dir", "", "directory for the workers' logs (default: a new temporary directory)")
	f.BoolVar(&withUI, "ui", false, "at the end, leave the web UI (idemq ui) running on the demo's data, with one worker, until Ctrl-C")
	f.StringVar(&o.UIListen, "ui-listen", DefaultUIListen, "loopback address of the UI of --ui")
	return cmd
}

func (a *app) benchCommand() *cobra.Command {
	var (
		o    bench.Options
		full bool
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Run the benchmark of docs/benchmarks.md",
		Long: `Measure idemq against a bare RabbitMQ consumer on the Postgres and RabbitMQ of
--postgres-url and --amqp-url, each consumer in a process of its own (this
binary again): throughput per scenario (per-message transactions, group commit,
batch handlers, with and without duplicates), its ratio to the bare consumer,
publish-to-ack latency (p50, p99), peak memory, and CPU per message of the
consumer, of the Postgres and RabbitMQ servers, and of the three together.

In the same run: the reference consumers of --benchref (the transactional
floor without dedup, and minimal hand-written dedup consumers; built from
their module and run as they are), the peers of --watermill-dir and
--river-dir, and the publishing side: the outbox relay draining a backlog
against a bare publisher with confirms (quorum and classic queues), and the
forwarding stage of 'idemq forward' against a bare consume-and-publish pipe;
and the HTTP front door, loaded by wrk (32 connections, a new Idempotency-Key
per request): a handler writing one row against the same handler behind the
idemhttp middleware, and a server publishing with confirms against 'idemq
gateway', with the open-loop latency of the guarded handler at half its rate;
and the outbox commits of 16 writers with the relays woken by a NOTIFY in the
transaction (the old trigger), after the commit, or not at all ('--only
"outbox commits"').
Then print the tables (see docs/benchmarks.md). It uses its own schemas
(idemq_bench, idemq_bench_ref, idemq_bench_river, idemq_bench_wake_N) and
queues, which it resets.`,
		Example: `  idemq bench
  idemq bench --full                     # the issue's run: 50,000 messages, prefetch 1024
  idemq bench --messages 5000 --max-duration 10s --no-publish --no-http
  idemq bench --only 'http|gateway' --http-duration 5s   # the HTTP front door only
  idemq bench --pgbouncer-url "$(deploy/local/ensure-pgbouncer.sh)"
  idemq bench --sweep --plot docs/img/group-commit.svg`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if err := a.checkURLs(); err != nil {
				return err
			}
			o.PostgresURL, o.AMQPURL = a.postgresURL, a.amqpURL
			if full {
				f := cmd.Flags()
				if !f.Changed("messages") {
					o.Messages = 50000
				}
				if !f.Changed("prefetch") {
					o.Prefetch = 1024
				}
				if !f.Changed("max-duration") {
					o.MaxDuration = time.Minute
				}
				if !f.Changed("http-duration") {
					o.HTTPDuration = 20 * time.Second
				}
			}
			_, err := bench.Run(cmd.Context(), o, a.stdout)
			return err
		}),
	}
	f := cmd.Flags()
	f.BoolVar(&full, "full", false, "the full run of docs/benchmarks.md: --messages 50000 --prefetch 1024 --max-duration 1m --http-duration 20s (flags given explicitly win)")
	f.IntVar(&o.Messages, "messages", 20000, "messages preloaded per throughput scenario")
	f.IntVar(&o.BodySize, "body-size", 200, "message body size in bytes")
	f.IntVar(&o.Concurrency, "concurrency", 8, "handlers of every consumer")
	f.IntVar(&o.Prefetch, "prefetch", 256, "prefetch of every consumer, the bare one included")
	f.DurationVar(&o.MaxDuration, "max-duration", 15*time.Second, "bound of one throughput scenario")
	f.IntVar(&o.Paced, "paced", 300, "messages per scenario for the publish-to-ack latency")
	f.IntVar(&o.PacedRate, "paced-rate", 200, "publish rate of the latency messages, per second")
	f.BoolVar(&o.Sweep, "sweep", false, "also run group commit at several group sizes")
	f.StringVar(&o.PlotPath, "plot", "", "write an SVG plot of the results (and the sweep) to this path")
	f.StringVar(&o.BenchrefDir, "benchref", "../shared/benchref", "module of the reference consumers (relative: to the working directory, else to the project root); when absent or empty, their rows say so")
	f.StringVar(&o.WatermillDir, "watermill-dir", "bench/watermill", "module of the Watermill peer (relative: as --benchref); empty leaves its rows out")
	f.StringVar(&o.RiverDir, "river-dir", "bench/river", "module of the River peer (relative: as --benchref); empty leaves its row out")
	f.IntVar(&o.RiverWorkers, "river-workers", 100, "River's MaxWorkers")
	f.BoolVar(&o.NoPublish, "no-publish", false, "leave out the publishing side (relay, forward)")
	f.StringVar(&o.PgBouncerURL, "pgbouncer-url", "", "the database of --postgres-url through PgBouncer in transaction mode (default_query_exec_mode=cache_describe): the default mode and the batch handler also run through it, in rows of their own (deploy/local/ensure-pgbouncer.sh prints one)")
	f.StringVar(&o.Only, "only", "", "run only the rows whose name matches this regular expression (with the bare rows of their table, which the ratios need; a table with no other row matching is left out)")
	f.DurationVar(&o.HTTPDuration, "http-duration", 10*time.Second, "how long wrk loads each row of the HTTP front door (and the open-loop latency phase lasts)")
	f.BoolVar(&o.NoHTTP, "no-http", false, "leave out the HTTP front door (wrk rows)")
	return cmd
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
