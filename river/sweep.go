package pgidemriver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/riverqueue/river"

	"github.com/pgidem/pgidem/pgidem"
)

// Sweep defaults.
const (
	// SweepKind is the River job kind of [SweepArgs]. The middleware never reserves a key
	// for it.
	SweepKind = "pgidem.sweep"

	// SweepIntervalDefault is the default [SweepPeriodicJobOpts.Interval].
	SweepIntervalDefault = 5 * time.Minute

	// SweepPauseDefault is the default [SweepConfig.Pause].
	SweepPauseDefault = 100 * time.Millisecond

	// SweepTimeoutDefault is the default [SweepConfig.Timeout].
	SweepTimeoutDefault = 4 * time.Minute
)

// SweepArgs are the args of the sweep job (kind [SweepKind]). It has no fields: what and
// how much to sweep is the worker's configuration.
type SweepArgs struct{}

// Kind returns [SweepKind].
func (SweepArgs) Kind() string { return SweepKind }

// SweepConfig configures a [SweepWorker]. The zero value is valid.
type SweepConfig struct {
	// BatchSize is how many rows one DELETE removes. Default
	// [pgidem.SweepBatchSizeDefault] (1000).
	BatchSize int
	// Pause is the sleep between batches, spreading the load. Default
	// [SweepPauseDefault] (100 ms); time.Duration(-1) (one nanosecond below zero, not
	// -1 * time.Millisecond, which is rejected) for none.
	Pause time.Duration
	// RowsPerSecond paces the sweep ([pgidem.SweepOpts.RowsPerSecond]). Default
	// [pgidem.SweepRowsPerSecondDefault] (5000); [pgidem.SweepUnpaced] (-1) for no pace.
	RowsPerSecond int
	// Timeout bounds one sweep job: it is the worker's River timeout
	// ([SweepWorker.Timeout]), after which River cancels the sweep's context. A sweep cut
	// short keeps what it deleted, returns nil, and the next run continues. Default
	// [SweepTimeoutDefault] (4 min), which stays below the default
	// [SweepPeriodicJobOpts.Interval] so one sweep ends before the next is due. There is
	// no "no timeout" setting: River's -1 (run without a timeout) and any other negative
	// value are rejected by [NewSweepWorker], because a sweep is always safe to cut short.
	Timeout time.Duration
	// Logger receives a line per sweep that deleted something (info), per sweep stopped by
	// its timeout or its job's cancellation (info), and per failure (error). A sweep stopped
	// by its timeout before its first batch finished is logged at warn: when one batch
	// takes longer than Timeout (a big BatchSize, a slow disk, a lock held on the table),
	// no run ever deletes anything. Default: the coordinator's logger.
	Logger *slog.Logger
}

// SweepWorker is the River worker of [SweepArgs]: it deletes expired pgidem records (and
// expired inbox rows) in batches through [pgidem.Coordinator.Sweep], logs what it removed,
// and records the counts as the job's output ([pgidem.SweepResult] as JSON). The
// coordinator's hook counts the rows ([pgidem.EventSwept]).
//
// Two clients sweeping at once (a leader handover, or a sweep run by hand beside the
// periodic one) split the rows with SKIP LOCKED instead of blocking or failing. Safe for
// concurrent use.
type SweepWorker struct {
	river.WorkerDefaults[SweepArgs]

	coord  *pgidem.Coordinator
	config SweepConfig
}

// NewSweepWorker returns a sweep worker for coord; config may be nil for defaults (it is
// copied). Register it with river.AddWorker and schedule it with [NewSweepPeriodicJob]. It
// returns an error matching [pgidem.ErrInvalidArgument] and naming the SweepConfig field
// when a setting is invalid: a negative BatchSize, a RowsPerSecond below -1, a Pause below time.Duration(-1), a negative Timeout (or
// a nil coord). It does not touch the database.
func NewSweepWorker(coord *pgidem.Coordinator, config *SweepConfig) (*SweepWorker, error) {
	if coord == nil {
		return nil, invalid("NewSweepWorker: coord is nil")
	}
	var cfg SweepConfig
	if config != nil {
		cfg = *config
	}
	cfg.Pause = cmp.Or(cfg.Pause, SweepPauseDefault)
	cfg.Timeout = cmp.Or(cfg.Timeout, SweepTimeoutDefault)
	if cfg.Logger == nil {
		cfg.Logger = coord.Config().Logger
	}
	switch {
	case cfg.BatchSize < 0:
		return nil, invalid("SweepConfig.BatchSize %d must not be negative", cfg.BatchSize)
	case cfg.RowsPerSecond < pgidem.SweepUnpaced:
		return nil, invalid("SweepConfig.RowsPerSecond %d must not be below -1 (no pace)", cfg.RowsPerSecond)
	case cfg.Pause < -1:
		return nil, invalid("SweepConfig.Pause %s must not be negative, except -1 for none", cfg.Pause)
	case cfg.Timeout < 0:
		return nil, invalid("SweepConfig.Timeout %s must not be negative (there is no \"no timeout\" setting; 0 means the default %s)", cfg.Timeout, SweepTimeoutDefault)
	}
	return &SweepWorker{coord: coord, config: cfg}, nil
}

// Timeout returns [SweepConfig.Timeout]; River cancels the sweep's context after it.
func (w *SweepWorker) Timeout(*river.Job[SweepArgs]) time.Duration { return w.config.Timeout }

// Work sweeps until no expired row is left, or until the job's timeout. A sweep cut short
// by its timeout returns nil: what it deleted stays deleted, and the next period
// continues. It is logged at info, or at warn when not one batch finished in time. A
// sweep whose job was cancelled (the client stopping with StopAndCancel) returns the
// context's error, logged at info: River puts the job back. A database error is returned,
// logged at error, and River retries the job.
func (w *SweepWorker) Work(ctx context.Context, job *river.Job[SweepArgs]) error {
	pause := max(w.config.Pause, 0)
	res, err := w.coord.Sweep(ctx, &pgidem.SweepOpts{BatchSize: w.config.BatchSize, Pause: pause,
		RowsPerSecond: w.config.RowsPerSecond})
	if res == nil {
		res = &pgidem.SweepResult{}
	}
	attrs := []any{slog.Int64("job_id", job.ID), slog.Int64("records", res.Records), slog.Int64("inbox", res.Inbox),
		slog.Float64("rows_per_second", res.RowsPerSecond)}
	if res.Records > 0 || res.Inbox > 0 {
		w.config.Logger.InfoContext(ctx, "pgidemriver: sweep deleted expired rows", attrs...)
	}
	if outErr := river.RecordOutput(ctx, res); outErr != nil {
		w.config.Logger.WarnContext(ctx, "pgidemriver: sweep could not record output", slog.String("error", outErr.Error()))
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() != nil && res.Records == 0 && res.Inbox == 0:
		// Not one batch finished in time. When that is because one batch takes longer than
		// the timeout, every run ends here and the table only grows: say so loudly.
		w.config.Logger.WarnContext(ctx, "pgidemriver: sweep stopped at its timeout before its first batch finished, so nothing was deleted; "+
			"if this repeats, raise SweepConfig.Timeout or lower SweepConfig.BatchSize",
			append(attrs, slog.Duration("timeout", w.config.Timeout), slog.Int("batch_size", cmp.Or(w.config.BatchSize, pgidem.SweepBatchSizeDefault)))...)
		return nil
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() != nil:
		w.config.Logger.InfoContext(ctx, "pgidemriver: sweep stopped at its timeout; the next run continues", attrs...)
		return nil
	case errors.Is(err, context.Canceled) && ctx.Err() != nil:
		// The client is stopping (StopAndCancel) or the job was cancelled: routine, and
		// River handles the returned context error itself.
		w.config.Logger.InfoContext(ctx, "pgidemriver: sweep stopped: its job was cancelled; the next run continues", attrs...)
		return fmt.Errorf("pgidemriver: sweep: %w", err)
	default:
		w.config.Logger.ErrorContext(ctx, "pgidemriver: sweep failed", append(attrs, slog.String("error", err.Error()))...)
		return fmt.Errorf("pgidemriver: sweep: %w", err)
	}
}

// SweepPeriodicJobOpts are optional settings for [NewSweepPeriodicJob]; nil means defaults.
type SweepPeriodicJobOpts struct {
	// Interval is the time between sweeps, at least one second (River's shortest unique
	// period, river.UniqueOpts.ByPeriod). Default [SweepIntervalDefault] (5 min).
	Interval time.Duration
	// Queue is the queue the sweep job is inserted in. Default river.QueueDefault.
	Queue string
	// RunOnStartDisabled stops the leader from inserting a sweep as soon as it is elected.
	// Default false: sweep on start (River's RunOnStart), as a hedge against leaders that
	// never live a whole interval.
	RunOnStartDisabled bool
}

// NewSweepPeriodicJob returns the periodic job that schedules [SweepArgs] every interval;
// add it to river.Config.PeriodicJobs of clients that also register a [SweepWorker].
// River's periodic enqueuer runs only on the elected leader, and the jobs are unique by
// period (river.UniqueOpts.ByPeriod = interval), so a leader handover inside one period
// does not insert a second sweep. A sweep job has 3 attempts (River's retry schedule
// between them); a failed sweep is harmless, since the next period's sweeps again.
//
// It returns an error matching [pgidem.ErrInvalidArgument] and naming the field when
// Interval is negative or below one second. River refuses a unique period that short when
// it inserts the job, so the leader would log an error every period (continuously, for a
// negative interval) and never sweep.
func NewSweepPeriodicJob(opts *SweepPeriodicJobOpts) (*river.PeriodicJob, error) {
	if opts == nil {
		opts = &SweepPeriodicJobOpts{}
	}
	if opts.Interval < 0 || (opts.Interval > 0 && opts.Interval < time.Second) {
		return nil, invalid("SweepPeriodicJobOpts.Interval %s must be at least 1s (0 means the default %s)", opts.Interval, SweepIntervalDefault)
	}
	interval := cmp.Or(opts.Interval, SweepIntervalDefault)
	queue := cmp.Or(opts.Queue, river.QueueDefault)
	return river.NewPeriodicJob(
		river.PeriodicInterval(interval),
		func() (river.JobArgs, *river.InsertOpts) {
			return SweepArgs{}, &river.InsertOpts{
				Queue:       queue,
				MaxAttempts: 3,
				UniqueOpts:  river.UniqueOpts{ByPeriod: interval},
			}
		},
		&river.PeriodicJobOpts{ID: SweepKind, RunOnStart: !opts.RunOnStartDisabled},
	), nil
}
