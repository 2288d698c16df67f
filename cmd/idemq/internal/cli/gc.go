package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/outbox"
)

func (a *app) gcCommand() *cobra.Command {
	var (
		retention  time.Duration
		batch      int
		pause      time.Duration
		maxBatches int
		vacuum     bool
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Delete old completed keys, abandoned leases and published outbox rows",
		Long: `Retention: delete completed keys completed longer ago than --retention, leases
abandoned (expired) longer ago than --retention, and outbox rows published longer
ago than --retention, oldest first. Each DELETE removes at most --batch rows, so
no long lock is held, and GC waits --pause after each full batch, so that the
workers keep their latency while it works off a backlog; --max-batches bounds
one run. Key GC runs in one instance per schema at a time (a second one reports
it skipped). Parked outbox rows are never deleted here. With --vacuum, each
table is vacuumed after its rows are deleted (throttled like autovacuum; needs
the tables' owner), so that their space is reused at once: use it where
autovacuum is off or falls behind. GC compresses the WAL its own session
writes (wal_compression) where its role may set the parameter (a superuser, or
GRANT SET ON PARAMETER wal_compression on Postgres 15): the workers' commits
wait behind that WAL less (docs/operations.md).

Each table's line ends with how far its oldest row still due lies past the
horizon ("behind"): 0 when GC kept up. The same figures are exported as
metrics (idemq.gc.deleted, idemq.gc.batches, idemq.gc.behind; see
docs/observability.md).

The retention bounds how long a duplicate is recognised: keep it longer than
the longest redelivery of any queue feeding the key store.`,
		Example: `  idemq gc
  idemq gc --retention 72h
  idemq gc --vacuum --max-batches 500`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if retention <= 0 {
				return usagef("--retention %s must be positive", retention)
			}
			if batch < 1 {
				return usagef("--batch %d must be at least 1", batch)
			}
			if pause < 0 || maxBatches < 0 {
				return usagef("--pause %s and --max-batches %d must not be negative", pause, maxBatches)
			}
			ctx := cmd.Context()
			// The run's metrics leave over OTLP when OTEL_* says so,
			// flushed when the command returns.
			if err := a.startTelemetry(ctx, "", nil); err != nil {
				return err
			}
			pool, err := a.openStorePool(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			store, err := dedup.NewStore(pool, &dedup.Config{Schema: a.schema, GCBatchSize: batch})
			if err != nil {
				return err
			}
			ob, err := outbox.New(pool, &outbox.Config{Schema: a.schema})
			if err != nil {
				return err
			}
			direct, err := a.directConfig()
			if err != nil {
				return err
			}
			keys, err := store.GC(ctx, dedup.GCOptions{Retention: retention, Batch: batch, Pause: pause, MaxBatches: maxBatches, Vacuum: vacuum, Session: direct})
			if err != nil {
				return err
			}
			rows, err := ob.GC(ctx, dedup.GCOptions{Retention: retention, Batch: batch, Pause: pause, MaxBatches: maxBatches, Vacuum: vacuum, Session: direct})
			if err != nil {
				return err
			}
			if keys.Skipped {
				fmt.Fprintln(a.stdout, "keys: skipped, another gc holds the lock")
			} else {
				fmt.Fprintf(a.stdout, "keys: deleted %d completed, %d abandoned in %d batches%s; behind %s\n",
					keys.Completed, keys.Abandoned, keys.Batches, vacuumed(keys.Vacuumed), keys.Behind.Round(time.Second))
			}
			fmt.Fprintf(a.stdout, "outbox: deleted %d published in %d batches%s; behind %s\n",
				rows.Deleted, rows.Batches, vacuumed(rows.Vacuumed), rows.Behind.Round(time.Second))
			return nil
		}),
	}
	cmd.Flags().DurationVar(&retention, "retention", dedup.DefaultRetention, "age beyond which completed keys, abandoned leases and published outbox rows are deleted")
	cmd.Flags().IntVar(&batch, "batch", dedup.DefaultGCBatchSize, "most rows one DELETE statement removes")
	cmd.Flags().DurationVar(&pause, "pause", dedup.DefaultGCPause, "pause after each full batch (0: none)")
	cmd.Flags().IntVar(&maxBatches, "max-batches", 0, "most DELETE statements per table in this run (0: until nothing is due)")
	cmd.Flags().BoolVar(&vacuum, "vacuum", false, "VACUUM each table after deleting (needs the tables' owner)")
	return cmd
}

// vacuumed says how long a VACUUM took, "" when none ran.
func vacuumed(d time.Duration) string {
	if d <= 0 {
		return ""
	}
	return fmt.Sprintf(", vacuumed in %s", d.Round(time.Millisecond))
}
