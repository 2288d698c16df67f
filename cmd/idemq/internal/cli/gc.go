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
		retention time.Duration
		batch     int
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Delete old completed keys, abandoned leases and published outbox rows",
		Long: `Retention: delete completed keys completed longer ago than --retention, leases
abandoned (expired) longer ago than --retention, and outbox rows published longer
ago than --retention. Each DELETE removes at most --batch rows, so no long lock is
held; key GC runs in one instance at a time (a second one reports it skipped).
Parked outbox rows are never deleted here.

The retention bounds how long a duplicate is recognised: keep it longer than
the longest redelivery of any queue feeding the key store.`,
		Example: `  idemq gc
  idemq gc --retention 72h --batch 5000`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if retention <= 0 {
				return usagef("--retention %s must be positive", retention)
			}
			if batch < 1 {
				return usagef("--batch %d must be at least 1", batch)
			}
			ctx := cmd.Context()
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
			keys, err := store.GC(ctx, retention)
			if err != nil {
				return err
			}
			rows, err := ob.GC(ctx, retention, batch)
			if err != nil {
				return err
			}
			if keys.Skipped {
				fmt.Fprintln(a.stdout, "keys: skipped, another gc holds the lock")
			} else {
				fmt.Fprintf(a.stdout, "keys: deleted %d completed, %d abandoned\n", keys.Completed, keys.Abandoned)
			}
			fmt.Fprintf(a.stdout, "outbox: deleted %d published\n", rows)
			return nil
		}),
	}
	cmd.Flags().DurationVar(&retention, "retention", dedup.DefaultRetention, "age beyond which completed keys, abandoned leases and published outbox rows are deleted")
	cmd.Flags().IntVar(&batch, "batch", dedup.DefaultGCBatchSize, "most rows one DELETE statement removes")
	return cmd
}
