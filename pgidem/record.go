package pgidem

import (
	"context"

	"github.com/pgidem/pgidem/internal/store"

	"github.com/jackc/pgx/v5"
)

// Status is a record's state.
type Status = store.Status

const (
	// StatusInProgress: a holder has reserved the key and its effect is running (or its
	// holder died and the lease will expire).
	StatusInProgress = store.StatusInProgress
	// StatusCompleted: the effect succeeded; the record holds its result for replay.
	StatusCompleted = store.StatusCompleted
	// StatusFailed: the effect failed permanently ([Permanent]); the failure is replayed.
	StatusFailed = store.StatusFailed
	// StatusParked: holders kept dying until the record's attempts reached the cap
	// ([Config.MaxAttempts]); calls get a [*ParkedError] until it is forgotten or expires.
	StatusParked = store.StatusParked
)

// Record is one row of pgidem_record, as returned by [Coordinator.Lookup].
type Record = store.Record

// Lookup reads the record for (namespace, key) without changing it. It returns an
// [*InvalidKeyError] for a key no call could have stored, [ErrNotFound] when there is no
// row, and the row (with Expired set) when it exists but has expired. Database errors are
// returned as [*StoreError]; cancelling ctx returns an error matching ctx's instead. Safe
// for concurrent use.
func (c *Coordinator) Lookup(ctx context.Context, namespace, key string) (*Record, error) {
	return c.engine.Lookup(ctx, c.engine.Pool(), namespace, key)
}

// LookupTx is [Coordinator.Lookup] inside the caller's transaction; like any statement on
// a pgx.Tx, not concurrently with other uses of tx.
func (c *Coordinator) LookupTx(ctx context.Context, tx pgx.Tx, namespace, key string) (*Record, error) {
	return c.engine.Lookup(ctx, tx, namespace, key)
}

// ForgetOpts are optional settings for [Coordinator.Forget]. A nil *ForgetOpts means
// defaults.
type ForgetOpts struct {
	// Force deletes a record even while it is in progress under a live lease. Its holder
	// may be running the effect at that moment, and the next call with the key runs it
	// again beside it; the holder's own completion then finds no row ([ErrLeaseLost]).
	// Default false: such a record is refused.
	Force bool
}

// Forget deletes the record for (namespace, key), so that the next call with the key runs
// its effect again: an operator's tool for replaying an effect by hand after an incident
// (the pgidem command's `records forget` sends the same statement). It
// returns the record as it was deleted. A record in progress under a live lease (and
// within its TTL) is refused with an [*InProgressError] (matching [ErrInProgress];
// RetryAfter is its remaining lease) unless opts.Force is set: its holder may be running
// the effect right now. The check and the delete are one statement, so a holder renewing
// or taking the record over at the same moment is never deleted without Force. A record
// that such writes keep making live again is refused the same way after three attempts,
// with a RetryAfter of 1 ms and no LeaseExpiresAt. A parked record ([StatusParked]) is
// deleted like a completed one: forgetting it is how an operator lets the key run again.
// Cancelling ctx returns an error matching ctx's, not a store error.
//
// It returns an [*InvalidKeyError] for a key no call could have stored, [ErrNotFound]
// when there is no row, and a [*StoreError] for a database error. Inbox rows are not
// records: delete those with SQL (docs/inspect.md). Safe for concurrent use.
func (c *Coordinator) Forget(ctx context.Context, namespace, key string, opts *ForgetOpts) (*Record, error) {
	return c.engine.Forget(ctx, namespace, key, opts != nil && opts.Force)
}
