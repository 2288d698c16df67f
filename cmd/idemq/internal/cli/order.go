package cli

import (
	"cmp"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemq/idemq/cmd/idemq/internal/audit"
	"github.com/idemq/idemq/internal/ordering"
)

func (a *app) orderCommand() *cobra.Command {
	var (
		consumerName, tenant, key string
		limit                     int
	)
	status := &cobra.Command{
		Use:   "status [--consumer NAME] [--key K [--tenant T]]",
		Short: "List the partitions' active consumers and the blocked ordering keys, or show one key's place",
		Long: `List the active consumer of each partition, as the consumers record it (the
connection name, host and process that last got the partition's deliveries,
since when, and when it last said so: at most every 10 seconds while
deliveries come; an old "last seen" is an idle partition or a worker gone).
Then list the ordering keys that are blocked (a message of theirs was dead-lettered,
often sequence_gap: a sequence before it never came), longest blocked first:
the consumer, the tenant, the ordering key, the last sequence applied, the
sequence that was dead-lettered, why, and since when. A blocked key's later
messages wait (then go to the DLQ, sequence_gap) until the sequence after the
last applied one arrives (replayed from the DLQ, or sent again by the
publisher), or until an operator skips ('idemq order skip').

With --key, show that key's row: its last applied sequence, and its block if
any. Ordering keys are the publishers' entity ids (x-ordering-key), not
idempotency keys: they are shown as they are.`,
		Example: `  idemq order status
  idemq order status --consumer ledger
  idemq order status --consumer ledger --key acct-42`,
		Args: noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			pool, err := a.openStorePool(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			defer w.Flush()
			if key != "" {
				if consumerName == "" {
					return usagef("--key needs --consumer")
				}
				k, ok, err := ordering.Get(ctx, pool, a.schema, ordering.Scope{Consumer: consumerName, Tenant: tenant, Key: key})
				if err != nil {
					return err
				}
				if !ok {
					fmt.Fprintf(w, "ordering key %q of consumer %s (tenant %q): nothing applied yet\n", key, consumerName, tenant)
					return nil
				}
				fmt.Fprintf(w, "consumer\t%s\ntenant\t%q\nordering key\t%s\nlast applied\t%d\nupdated\t%s\n",
					k.Consumer, k.Tenant, k.Key, k.LastSequence, k.UpdatedAt.Format(time.RFC3339))
				if k.BlockedAt != nil {
					fmt.Fprintf(w, "blocked\tsince %s by sequence %d (%s); waits for sequence %d\n",
						k.BlockedAt.Format(time.RFC3339), k.BlockedSequence, k.BlockedReason, k.LastSequence+1)
				} else {
					fmt.Fprintf(w, "blocked\tno\n")
				}
				return nil
			}
			owners, err := ordering.Owners(ctx, pool, a.schema, consumerName)
			switch {
			case err != nil:
				fmt.Fprintf(w, "partition owners not read: %v\n\n", err)
			case len(owners) > 0:
				fmt.Fprintln(w, "PARTITION\tCONSUMER\tACTIVE CONSUMER\tSINCE\tLAST SEEN")
				now := time.Now()
				for _, o := range owners {
					fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s ago\n", o.Queue, o.Consumer, o.Owner, o.Since.Format(time.RFC3339),
						now.Sub(o.SeenAt).Round(time.Second))
				}
				fmt.Fprintln(w)
			}
			keys, err := ordering.Blocked(ctx, pool, a.schema, consumerName, limit)
			if err != nil {
				return err
			}
			if len(keys) == 0 {
				fmt.Fprintln(w, "no ordering key is blocked")
				return nil
			}
			fmt.Fprintln(w, "CONSUMER\tTENANT\tORDERING KEY\tLAST APPLIED\tWAITS FOR\tDEAD-LETTERED\tREASON\tBLOCKED SINCE")
			for _, k := range keys {
				fmt.Fprintf(w, "%s\t%q\t%s\t%d\t%d\t%d\t%s\t%s\n", k.Consumer, k.Tenant, k.Key, k.LastSequence, k.LastSequence+1,
					k.BlockedSequence, k.BlockedReason, k.BlockedAt.Format(time.RFC3339))
			}
			if len(keys) == limit {
				fmt.Fprintf(w, "(the first %d; --limit shows more)\n", limit)
			}
			return nil
		}),
	}
	sf := status.Flags()
	sf.StringVar(&consumerName, "consumer", "", "only this consumer's keys (its consumer.Config.Name)")
	sf.StringVar(&key, "key", "", "show this ordering key (x-ordering-key) only")
	sf.StringVar(&tenant, "tenant", "", "the tenant of --key")
	sf.IntVar(&limit, "limit", 100, "the most keys listed")

	var (
		skipConsumer, skipTenant, skipKey, by, note string
		to                                          int64
	)
	skip := &cobra.Command{
		Use:   "skip --consumer NAME --key K --to S [--tenant T] [--note TEXT]",
		Short: "Move an ordering key past a gap: its last applied sequence becomes S, and it is unblocked",
		Long: `Set the last applied sequence of ordering key K (of consumer NAME and tenant T)
to S and clear its block, in one transaction with a record of who did it and
why (the table ordering_skips). The sequences up to S are then duplicates:
they are acked without running. S+1 runs next; later sequences waiting in a
worker run as their turn comes, and those in the DLQ run when replayed.

A skip never goes backwards: what was applied stays applied. S equal to the
last applied sequence only unblocks the key. This is the operator's decision
that the missing sequences will never take effect.`,
		Example: `  idemq order skip --consumer ledger --key acct-42 --to 17 --note "17 was lost upstream (INC-311)"`,
		Args:    noArgs,
		RunE: run(func(cmd *cobra.Command, _ []string) error {
			if to < 0 {
				return usagef("--to %d must not be negative", to)
			}
			ctx := cmd.Context()
			pool, err := a.openStorePool(ctx, 2)
			if err != nil {
				return err
			}
			defer pool.Close()
			operator := cmp.Or(by, audit.OSUser())
			rec := audit.New(pool, a.schema)
			entry, err := rec.Begin(ctx, audit.Action{Actor: operator, Via: audit.ViaCLI, Action: audit.ActionSkip, Target: skipConsumer,
				What: fmt.Sprintf("ordering key %q (tenant %q) to %d", skipKey, skipTenant, to)})
			if err != nil {
				return err
			}
			from, err := ordering.Skip(ctx, pool, a.schema, ordering.Scope{Consumer: skipConsumer, Tenant: skipTenant, Key: skipKey}, to, operator, note)
			a.endAudit(rec, entry, 1, err, nil)
			if errors.Is(err, ordering.ErrSkipBackwards) {
				return usagef("ordering key %q: %v", skipKey, err)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "ordering key %q of consumer %s (tenant %q): last applied %d → %d, unblocked; recorded as skipped by %s\n",
				skipKey, skipConsumer, skipTenant, from, to, operator)
			return nil
		}),
	}
	kf := skip.Flags()
	kf.StringVar(&skipConsumer, "consumer", "", "the consumer (its consumer.Config.Name) (required)")
	kf.StringVar(&skipKey, "key", "", "the ordering key (x-ordering-key) (required)")
	kf.StringVar(&skipTenant, "tenant", "", "its tenant")
	kf.Int64Var(&to, "to", 0, "the sequence that counts as the last applied from now on (required)")
	kf.StringVar(&by, "by", "", "who skips, for the record and the audit (default: the OS user)")
	kf.StringVar(&note, "note", "", "why, for the record")
	requireFlags(skip, "consumer", "key", "to")
	return group("order", "See and unblock ordered keys (x-ordering-key, x-sequence)", "", status, skip)
}
