package pgidem

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// SweepBatchSizeDefault is the default [SweepOpts.BatchSize].
const SweepBatchSizeDefault = 1000

// SweepOpts are optional settings for [Coordinator.Sweep]. A nil *SweepOpts means defaults.
type SweepOpts struct {
	// BatchSize is how many rows one DELETE removes, bounding lock time and WAL per
	// statement. Default [SweepBatchSizeDefault] (1000).
	BatchSize int
	// Pause is how long to sleep between batches, to spread the load. Default 0.
	Pause time.Duration
	// MaxBatches bounds the number of batches per table in one call. Default 0: until no
	// expired row is left.
	MaxBatches int
}

// SweepResult reports what a sweep deleted.
type SweepResult struct {
	// Records is the number of expired records deleted.
	Records int64 `json:"records"`
	// Inbox is the number of expired inbox rows deleted.
	Inbox int64 `json:"inbox"`
}

// Sweep deletes expired records, then inbox rows past their retention ([InboxOpts]), in
// batches until none is left (or MaxBatches per table is reached) and returns how many it
// deleted from each table. Expired rows already behave as absent, so sweeping only
// reclaims space; in-progress records under a live lease are never deleted. Concurrent
// sweeps (two River leaders during a handover, cron and a River job) split the rows with
// SKIP LOCKED instead of blocking; each batch is a READ COMMITTED transaction of its own,
// whatever isolation the pool's sessions default to. Cancelling ctx (or its deadline passing) stops the sweep,
// between batches or mid-statement (that batch rolls back), and returns what was deleted
// so far with ctx's error, neither logged nor counted as a store error. Database errors are
// returned as [*StoreError], logged at error and counted ([EventStoreError]). A negative
// [SweepOpts] field returns an error matching [ErrInvalidArgument] and deletes nothing.
// Safe for concurrent use.
func (c *Coordinator) Sweep(ctx context.Context, opts *SweepOpts) (*SweepResult, error) {
	if opts == nil {
		opts = &SweepOpts{}
	}
	if opts.BatchSize < 0 || opts.MaxBatches < 0 || opts.Pause < 0 {
		return &SweepResult{}, invalidArgument("SweepOpts.BatchSize %d, MaxBatches %d and Pause %s must not be negative", opts.BatchSize, opts.MaxBatches, opts.Pause)
	}
	batch := cmp.Or(opts.BatchSize, SweepBatchSizeDefault)
	res := &SweepResult{}
	n, err := c.sweepTable(ctx, c.sql.sweep, batch, opts)
	res.Records += n
	if err != nil {
		return res, err
	}
	n, err = c.sweepTable(ctx, c.sql.inbox.sweep, batch, opts)
	res.Inbox += n
	if err == nil {
		c.config.Logger.DebugContext(ctx, "pgidem: sweep done", slog.Int64("records", res.Records), slog.Int64("inbox", res.Inbox))
	}
	return res, err
}

func (c *Coordinator) sweepTable(ctx context.Context, sql string, batch int, opts *SweepOpts) (int64, error) {
	var total int64
	for i := 0; opts.MaxBatches == 0 || i < opts.MaxBatches; i++ {
		if i > 0 && opts.Pause > 0 {
			if err := sleepCtx(ctx, opts.Pause); err != nil {
				return total, err
			}
		}
		n, err := c.sweepBatch(ctx, sql, batch)
		if err != nil {
			// ctx ending mid-statement is the caller's doing, which reportStoreError
			// returns as such (the batch rolled back; the earlier ones stay deleted).
			return total, c.reportStoreError(ctx, "", storeError("sweep", err), slog.Int64("deleted", total))
		}
		total += n
		if n > 0 {
			c.emit(ctx, EventSwept, "", n)
		}
		if n < int64(batch) {
			break
		}
	}
	return total, nil
}

// sweepBatch deletes one batch of expired rows with sql in a READ COMMITTED, READ WRITE
// transaction of its own, whatever the pool's sessions default to: under REPEATABLE READ
// or SERIALIZABLE a row that a concurrent sweep (or a takeover) changed after the
// statement's snapshot fails the whole statement with a serialization failure, where READ
// COMMITTED skips it or checks it again, so concurrent sweeps split the rows as the docs
// say; and sessions that default to read-only transactions would refuse the delete.
func (c *Coordinator) sweepBatch(ctx context.Context, sql string, batch int) (int64, error) {
	tx, err := c.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		return 0, err
	}
	tag, err := tx.Exec(ctx, sql, batch)
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		c.rollbackDetached(ctx, tx)
		return 0, err
	}
	return tag.RowsAffected(), nil
}
