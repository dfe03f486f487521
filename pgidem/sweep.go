package pgidem

import (
	"context"
	"time"

	"github.com/pgidem/pgidem/internal/protocol"
)

const (
	// SweepBatchSizeDefault is the default [SweepOpts.BatchSize].
	SweepBatchSizeDefault = protocol.SweepBatchSizeDefault
	// SweepRowsPerSecondDefault is the default [SweepOpts.RowsPerSecond]: 5000 rows per
	// second, about a fifth of what an unpaced sweep deletes on a 2-core server, so a
	// sweep leaves the calls running beside it most of the disk.
	SweepRowsPerSecondDefault = protocol.SweepRowsPerSecondDefault
	// SweepUnpaced as [SweepOpts.RowsPerSecond] sweeps as fast as the server deletes.
	SweepUnpaced = protocol.SweepUnpaced
)

// SweepOpts are optional settings for [Coordinator.Sweep]. A nil *SweepOpts means defaults.
type SweepOpts struct {
	// BatchSize is how many rows one DELETE removes, bounding lock time and WAL per
	// statement. Default [SweepBatchSizeDefault] (1000).
	BatchSize int
	// Pause is the shortest sleep between batches, to spread the load. Default 0.
	Pause time.Duration
	// RowsPerSecond paces the sweep: after each full batch it sleeps until the batch's
	// rows fit this rate (and at least Pause), so a large backlog is deleted at a steady
	// pace instead of taking the disk from concurrent calls. It bounds each table's
	// sweep. Default [SweepRowsPerSecondDefault] (5000); [SweepUnpaced] (-1) for no pace.
	RowsPerSecond int
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
	// RowsPerSecond is the rows deleted (both tables) per second of the sweep's wall
	// time, pauses included; 0 when nothing was deleted.
	RowsPerSecond float64 `json:"rows_per_second"`
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
// [SweepOpts] field (for RowsPerSecond, below [SweepUnpaced]) returns an error matching [ErrInvalidArgument] and deletes nothing.
// Full batches are paced ([SweepOpts.RowsPerSecond]). Safe for concurrent use.
func (c *Coordinator) Sweep(ctx context.Context, opts *SweepOpts) (*SweepResult, error) {
	var o protocol.SweepOpts
	if opts != nil {
		o = protocol.SweepOpts{BatchSize: opts.BatchSize, MaxBatches: opts.MaxBatches, Pause: opts.Pause,
			RowsPerSecond: opts.RowsPerSecond}
	}
	res, err := c.engine.Sweep(ctx, &o)
	return &SweepResult{Records: res.Records, Inbox: res.Inbox, RowsPerSecond: res.RowsPerSecond}, err
}
