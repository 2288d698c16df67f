package cli

import (
	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/scale"
	"github.com/idemq/idemq/dedup"
)

func (a *app) scaleCommand() *cobra.Command {
	var o scale.Options
	cmd := &cobra.Command{
		Use:    "scale",
		Hidden: true,
		Short:  "Measure retention at size: a day of keys, a steady worker and GC (make scale)",
		Long: `Load one simulated day of completed keys and published outbox rows (COPY,
into --scale-schema, dropped and created again with the migrations), then run a
worker at --rate operations a second for --cycles cycles of --cycle; in the
middle of each cycle GC retires as many of the oldest keys and outbox rows as
the worker added. Print, per cycle: the worker's throughput and p99 without
and with GC running, the longest lock wait of a worker statement, GC's rate,
how far GC is behind its horizon, and both tables' heap and index sizes, dead
tuples and autovacuum runs. See docs/operations.md.`,
		Example: `  idemq scale --keys 200000 --cycles 3 --cycle 20s
  idemq scale                           # 10,000,000 keys, 6 cycles of 1m`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if _, err := a.postgresConfig(); err != nil {
				return err
			}
			o.PostgresURL, o.Log = a.postgresURL, a.stderr
			_, err := scale.Run(cmd.Context(), o, a.stdout)
			return err
		}),
	}
	f := cmd.Flags()
	f.StringVar(&o.Schema, "scale-schema", scale.DefaultSchema, "Postgres schema of the run, dropped and recreated (must contain \"scale\")")
	f.IntVar(&o.Keys, "keys", scale.DefaultKeys, "keys of the simulated day, loaded before the cycles")
	f.IntVar(&o.Outbox, "outbox", 0, "published outbox rows loaded (default: as many as keys)")
	f.IntVar(&o.Cycles, "cycles", scale.DefaultCycles, "cycles to run")
	f.DurationVar(&o.Cycle, "cycle", scale.DefaultCycle, "length of one cycle; GC runs from its middle")
	f.IntVar(&o.Rate, "rate", scale.DefaultRate, "worker operations per second")
	f.IntVar(&o.Concurrency, "concurrency", scale.DefaultConcurrency, "worker connections")
	f.Float64Var(&o.Duplicates, "duplicates", scale.DefaultDuplicates, "share of operations that repeat a stored key")
	f.IntVar(&o.GCBatch, "batch", 0, "GC batch size (default the library's)")
	f.DurationVar(&o.GCPause, "gc-pause", dedup.DefaultGCPause, "pause of GC after each full batch (idemq gc --pause)")
	f.IntVar(&o.SchemaVersion, "schema-version", 0, "migrate the schema only this far (0: all the way), to measure an earlier design")
	f.BoolVar(&o.GCVacuum, "vacuum", false, "GC vacuums each table after deleting (idemq gc --vacuum)")
	f.BoolVar(&o.Keep, "keep", false, "keep the schema after the run")
	f.BoolVar(&o.Reuse, "reuse", false, "go on with the day a run with --keep left in the schema, if it has as many keys, instead of loading again (with --keep)")
	return cmd
}
