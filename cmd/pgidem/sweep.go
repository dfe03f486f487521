package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/pgidem/pgidem/pgidem"
)

func (a *app) sweepCommand() *cobra.Command {
	var batchSize int
	cmd := &cobra.Command{
		Use:   "sweep",
		Short: "Delete expired records and inbox rows in batches (for cron, where River's periodic sweep is not used)",
		Long: `Deletes records past their TTL and inbox rows past their retention, in batches,
until none is left. Expired records
already behave like no record, so sweeping only reclaims space; records in progress under
a live lease are never deleted. Concurrent sweeps (two cron hosts, cron and River) split
the rows instead of blocking each other. It runs pgidem.Coordinator.Sweep.`,
		Example: "  pgidem sweep --batch-size 5000\n  # crontab: */10 * * * * pgidem sweep --database-url ...",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			if batchSize < 1 {
				return usagef("--batch-size must be >= 1, got %d", batchSize)
			}
			ctx := cmd.Context()
			pool, err := a.connectPool(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Schema: a.schema})
			if err != nil {
				return err
			}
			res, err := coord.Sweep(ctx, &pgidem.SweepOpts{BatchSize: batchSize})
			if err != nil {
				if missing := newStore(pool, a.schema).missingTable("sweep", err); missing != nil {
					return missing
				}
				return err
			}
			if a.json {
				return printJSON(a.stdout, map[string]int64{"records": res.Records, "inbox": res.Inbox})
			}
			fmt.Fprintf(a.stdout, "swept %d expired records and %d expired inbox rows\n", res.Records, res.Inbox)
			return nil
		}),
	}
	cmd.Flags().IntVar(&batchSize, "batch-size", pgidem.SweepBatchSizeDefault, "rows deleted per statement")
	return cmd
}
