package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgidem/pgidem/pgidem"
)

// sweepJSON is the --json output of sweep.
type sweepJSON struct {
	Records int64 `json:"records"`
	// Inbox is null when the database has no inbox table.
	Inbox *int64 `json:"inbox"`
}

// sweepInterrupted reports a sweep that err, after an interrupt, ended once it had deleted
// what deleted says. Each batch is a transaction of its own, and the earlier ones stay
// deleted. The batch in flight was rolled back when the server answered the cancel request
// (the statement, or the COMMIT's deferred work, was cancelled) or when the statement was
// never sent. Without an answer within interruptGrace (pgconn then reports a bare
// context.Canceled, as the pool does for an interrupted Acquire, between batches) nothing
// is known of it: a COMMIT the server had received may have completed.
func sweepInterrupted(err error, deleted string) error {
	var pgErr *pgconn.PgError
	if pgconn.SafeToRetry(err) || (errors.As(err, &pgErr) && pgErr.Code == pgerrcode.QueryCanceled) {
		return interruptedf("pgidem: sweep: interrupted after deleting %s (the batch in flight, if any, was rolled back)", deleted)
	}
	return interruptedf("pgidem: sweep: interrupted after deleting %s; the server did not confirm that the batch in flight, "+
		"if any, was cancelled, so it may or may not have been deleted too (sweeping again is harmless)", deleted)
}

func (a *app) sweepCommand() *cobra.Command {
	var batchSize, rate int
	cmd := &cobra.Command{
		Use:   "sweep",
		Short: "Delete expired records and inbox rows in batches (for cron, where River's periodic sweep is not used)",
		Long: `Deletes records past their TTL and inbox rows past their retention, in batches,
until none is left. Expired records
already behave like no record, so sweeping only reclaims space; records in progress under
a live lease are never deleted. Concurrent sweeps (two cron hosts, cron and River) split
the rows instead of blocking each other. It runs pgidem.Coordinator.Sweep.

A database without the inbox table (its migration was not applied) only has its records
swept; --json then reports "inbox": null, as stats does. When the sweep fails part way,
or is interrupted, the error says how many rows it had deleted. Interrupted (Ctrl-C),
it asks the server to cancel the batch it is running, which is then rolled back; only
when the server does not answer within a few seconds is that batch's fate unknown (it
may have been deleted), and the message says so. Sweeping again is harmless.`,
		Example: "  pgidem sweep --batch-size 5000\n  # crontab: */10 * * * * pgidem sweep --database-url ...",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			// No upper bound: the batch size is a bigint LIMIT.
			if batchSize < 1 {
				return usagef("--batch-size must be >= 1, got %d", batchSize)
			}
			if rate < pgidem.SweepUnpaced {
				return usagef("--rows-per-second must be >= -1, got %d", rate)
			}
			ctx := cmd.Context()
			pool, err := a.connectPool(ctx)
			if ie := (*interruptedError)(nil); errors.As(err, &ie) {
				return interruptedf("%s; nothing was deleted", ie.msg)
			}
			if err != nil {
				return err
			}
			defer closePool(ctx, pool)
			coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Schema: a.schema})
			if err != nil {
				return err
			}
			res, err := coord.Sweep(ctx, &pgidem.SweepOpts{BatchSize: batchSize, RowsPerSecond: rate})
			if res == nil {
				res = &pgidem.SweepResult{}
			}
			deleted := count(res.Records, "expired record", "expired records") + " and " +
				count(res.Inbox, "expired inbox row", "expired inbox rows")
			if err != nil && ctx.Err() != nil {
				return sweepInterrupted(err, deleted)
			}
			// noInbox: the database has no inbox table; inboxName names it, schema included.
			noInbox, inboxName, err := a.sweepError(ctx, pool, err)
			if err != nil && res.Records+res.Inbox > 0 {
				return fmt.Errorf("%w (before failing, the sweep deleted %s)", err, deleted)
			}
			if err != nil {
				return err
			}
			return a.printSweep(res, deleted, noInbox, inboxName)
		}),
	}
	cmd.Flags().IntVar(&batchSize, "batch-size", pgidem.SweepBatchSizeDefault, "rows deleted per statement")
	cmd.Flags().IntVar(&rate, "rows-per-second", pgidem.SweepRowsPerSecondDefault, "most rows deleted per second, pausing between batches; -1 for no pace")
	return cmd
}

// sweepError interprets the error of a sweep that was not interrupted. A database without
// the inbox table (noInbox, named by inboxName) had its records swept, which is no error.
// A missing record table gets the other commands' message, and a database error their
// wording.
func (a *app) sweepError(ctx context.Context, pool *pgxpool.Pool, err error) (noInbox bool, inboxName string, _ error) {
	if err == nil {
		return false, "", nil
	}
	s := newStore(pool, a.schema)
	if missing, checkErr := s.inboxMissing(ctx, err); checkErr == nil && missing {
		// The records were swept; the inbox's migration was not applied.
		return true, s.qualifiedInbox(ctx), nil
	}
	if missing := s.missingTable(ctx, "sweep", err); missing != nil {
		return false, "", missing
	}
	if se := (*pgidem.StoreError)(nil); errors.As(err, &se) {
		// The library's "store unavailable" fits an outage, not an error the server
		// answered with (permission denied, say): report it as the other commands do.
		return false, "", fmt.Errorf("pgidem: sweep: %w", se.Err)
	}
	return false, "", err
}

// printSweep reports what a sweep deleted (deleted says it in words); with noInbox, the
// database has no inbox table (inboxName) and --json reports "inbox": null.
func (a *app) printSweep(res *pgidem.SweepResult, deleted string, noInbox bool, inboxName string) error {
	a.changed = "sweep deleted " + deleted
	inbox := &res.Inbox
	if noInbox {
		a.changed = "sweep deleted " + count(res.Records, "expired record", "expired records")
		inbox = nil
	}
	if a.json {
		return printJSON(a.stdout, sweepJSON{Records: res.Records, Inbox: inbox})
	}
	if noInbox {
		fmt.Fprintf(a.stdout, "swept %s (no inbox table %s)\n", count(res.Records, "expired record", "expired records"), inboxName)
		return nil
	}
	fmt.Fprintf(a.stdout, "swept %s\n", deleted)
	return nil
}
