package protocol

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// Lookup reads the record of (namespace, key) in db.
func (c *Engine) Lookup(ctx context.Context, db rowQuerier, namespace, key string) (*store.Record, error) {
	if err := c.validateKey(namespace, key); err != nil {
		return nil, err
	}
	r, err := c.sql.ReadRecord(ctx, db, namespace, key)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, c.reportStoreError(ctx, namespace, store.Wrap("lookup", err), slog.String("namespace", namespace), slog.String("key", key))
	}
	return r.Record(namespace, key), nil
}

// forgetAttempts bounds how often Forget retries a record that changed under it.
const forgetAttempts = 3

// Forget deletes the record for (namespace, key), so that the next call with the key runs
// its effect again: an operator's tool for replaying an effect by hand after an incident
// (the pgidem command's `records forget` sends the same statement). It
// returns the record as it was deleted. A record in progress under a live lease (and
// within its TTL) is refused with an [*InProgressError] (matching [ErrInProgress];
// RetryAfter is its remaining lease) unless opts.Force is set: its holder may be running
// the effect right now. The check and the delete are one statement, so a holder renewing
// or taking the record over at the same moment is never deleted without Force; a record
// that such writes keep making live again is refused the same way after three attempts,
// with a RetryAfter of 1 ms and no LeaseExpiresAt. A parked record is deleted like a
// completed one: forgetting it is how an operator lets the key run again.
// Cancelling ctx returns an error matching ctx's, not a store error.
//
// It returns an [*InvalidKeyError] for a key no call could have stored, [ErrNotFound]
// when there is no row, and a [*StoreError] for a database error. Inbox rows are not
// records: delete those with SQL (docs/inspect.md). Safe for concurrent use.
func (c *Engine) Forget(ctx context.Context, namespace, key string, force bool) (*store.Record, error) {
	if err := c.validateKey(namespace, key); err != nil {
		return nil, err
	}
	for attempt := 1; ; attempt++ {
		r, deleted, err := c.sql.ForgetRecord(ctx, c.pool, namespace, key, force)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return nil, ErrNotFound
		case store.IsSerializationFailure(err) && attempt < forgetAttempts:
			continue // a pool of REPEATABLE READ sessions: a concurrent write; read it again
		case err != nil:
			return nil, c.reportStoreError(ctx, namespace, store.Wrap("forget", err), slog.String("namespace", namespace), slog.String("key", key))
		case deleted:
			c.config.Logger.InfoContext(ctx, "pgidem: record forgotten; the next call with the key runs its effect again",
				slog.String("namespace", namespace), slog.String("key", key), slog.String("status", string(r.Status)),
				slog.Bool("forced", force))
			return r.Record(namespace, key), nil
		case r.Status == store.StatusInProgress && !r.LeaseExpired && !r.Expired:
			return nil, &InProgressError{Namespace: namespace, Key: key, RetryAfter: max(r.LeaseExpires.Time.Sub(r.DBNow), time.Millisecond),
				Attempts: r.Attempts, LeaseExpiresAt: r.LeaseExpires.Time}
		case attempt == forgetAttempts:
			// Each statement saw a deletable row that a concurrent write (a renewal, a
			// takeover) then made live again, or replaced.
			return nil, &InProgressError{Namespace: namespace, Key: key, RetryAfter: time.Millisecond, Attempts: r.Attempts}
		}
	}
}

// SweepOpts are a sweep's settings (pgidem.SweepOpts documents each).
type SweepOpts struct {
	BatchSize     int
	MaxBatches    int
	Pause         time.Duration
	RowsPerSecond int
}

// SweepResult counts the rows a sweep deleted and how fast.
type SweepResult struct {
	Records       int64
	Inbox         int64
	RowsPerSecond float64
}

const (
	// SweepBatchSizeDefault is the batch size when SweepOpts.BatchSize is 0.
	SweepBatchSizeDefault = 1000
	// SweepRowsPerSecondDefault is the pace when SweepOpts.RowsPerSecond is 0.
	SweepRowsPerSecondDefault = 5000
	// SweepUnpaced as SweepOpts.RowsPerSecond sweeps without a pace.
	SweepUnpaced = -1
)

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
// [SweepOpts] field (RowsPerSecond: below SweepUnpaced) returns an error matching [ErrInvalidArgument] and deletes nothing.
// Full batches are paced (sweepPace.wait). Safe for concurrent use.
func (c *Engine) Sweep(ctx context.Context, opts *SweepOpts) (*SweepResult, error) {
	if opts == nil {
		opts = &SweepOpts{}
	}
	if opts.BatchSize < 0 || opts.MaxBatches < 0 || opts.Pause < 0 || opts.RowsPerSecond < SweepUnpaced {
		return &SweepResult{}, InvalidArgument("SweepOpts.BatchSize %d, MaxBatches %d and Pause %s must not be negative, "+
			"and RowsPerSecond %d must not be below -1", opts.BatchSize, opts.MaxBatches, opts.Pause, opts.RowsPerSecond)
	}
	p := sweepPace{batch: cmp.Or(opts.BatchSize, SweepBatchSizeDefault), maxBatches: opts.MaxBatches,
		pause: opts.Pause, rate: cmp.Or(opts.RowsPerSecond, SweepRowsPerSecondDefault)}
	res := &SweepResult{}
	start := c.clock.Now()
	defer func() {
		if d := c.clock.Now().Sub(start); d > 0 {
			res.RowsPerSecond = float64(res.Records+res.Inbox) / d.Seconds()
		}
	}()
	n, err := c.sweepTable(ctx, c.sql.SweepRecords, &p)
	res.Records += n
	if err != nil {
		return res, err
	}
	n, err = c.sweepTable(ctx, c.sql.SweepInbox, &p)
	res.Inbox += n
	if err == nil {
		c.config.Logger.DebugContext(ctx, "pgidem: sweep done", slog.Int64("records", res.Records), slog.Int64("inbox", res.Inbox))
	}
	return res, err
}

// sweepPace is how a sweep goes: rows per batch, batches per table (0: no bound), the
// pause between batches, and the most rows per second (SweepUnpaced: no bound).
type sweepPace struct {
	batch, maxBatches int
	pause             time.Duration
	rate              int
}

// wait is how long to wait after a batch that deleted n rows in took before the next:
// the pause, or longer when the batch came in faster than the rate allows.
func (p *sweepPace) wait(n int64, took time.Duration) time.Duration {
	if p.rate <= 0 {
		return p.pause
	}
	return max(p.pause, time.Duration(n)*time.Second/time.Duration(p.rate)-took)
}

func (c *Engine) sweepTable(ctx context.Context, sql string, p *sweepPace) (int64, error) {
	var total int64
	var wait time.Duration
	for i := 0; p.maxBatches == 0 || i < p.maxBatches; i++ {
		if wait > 0 {
			if err := c.clock.Sleep(ctx, wait); err != nil {
				return total, err
			}
		}
		start := c.clock.Now()
		n, err := c.sweepBatch(ctx, sql, p.batch)
		if err != nil {
			// ctx ending mid-statement is the caller's doing, which reportStoreError
			// returns as such (the batch rolled back; the earlier ones stay deleted).
			return total, c.reportStoreError(ctx, "", store.Wrap("sweep", err), slog.Int64("deleted", total))
		}
		total += n
		if n > 0 {
			c.emit(ctx, EventSwept, "", n)
		}
		if n < int64(p.batch) {
			break
		}
		wait = p.wait(n, c.clock.Now().Sub(start))
	}
	return total, nil
}

// sweepBatch deletes one batch of expired rows with sql in a READ COMMITTED, READ WRITE
// transaction of its own, whatever the pool's sessions default to. Under REPEATABLE READ
// or SERIALIZABLE, a row that a concurrent sweep (or a takeover) changed after the
// statement's snapshot fails the whole statement with a serialization failure. READ
// COMMITTED skips it or checks it again, so concurrent sweeps split the rows as the docs
// say. And sessions that default to read-only transactions would refuse the delete.
func (c *Engine) sweepBatch(ctx context.Context, sql string, batch int) (int64, error) {
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
