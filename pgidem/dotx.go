package pgidem

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/protocol"
)

// DoTx runs fn at most once per (namespace, key) within ttl, in the caller's transaction,
// and records the outcome in that same transaction. It is [DoTxResult] without the detail;
// see there for the protocol, errors and cancellation.
func DoTx[T any](ctx context.Context, c *Coordinator, tx pgx.Tx, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	res, err := DoTxResult(ctx, c, tx, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// DoTxResult makes a database effect exactly-once. fn's writes and the key's completed
// record commit together in the caller's transaction tx: the caller's commit makes both
// visible, a rollback leaves neither. Use it for rows in pgidem's database; use [Do] for
// effects outside it (mail, HTTP, payments). A transaction-scoped advisory lock serialises
// the key; a finished record is replayed, else fn runs in a savepoint and the record is
// upserted in tx.
// The package documentation explains the lock ("DoTx: lock and wait"), meeting [Do] ("DoTx
// and Do on one key") and isolation levels ("DoTx and isolation").
//
// Errors:
//   - keys, ttl and [DoOpts] are checked as in [DoResult]; fn is not run, tx not touched.
//   - a read-only, aborted, committed or rolled-back tx, nil arguments, or a call from
//     within the fn of a call holding the key: [ErrInvalidArgument] before fn runs.
//   - the key held elsewhere: an [*InProgressError] (after the wait under [InFlightWait]).
//   - Do's holder died at [Config.MaxAttempts]: a [*ParkedError]; commit tx to keep the park.
//   - fn's error, panic or unstorable value ([ErrResultNotStorable]): tx is rolled back to
//     the savepoint, nothing is recorded, tx stays usable, and the error is returned.
//   - a [Permanent] error: fn's writes are undone, a failed record is written in tx and
//     fn's error returned; commit tx to keep it. [*FailureNotStoredError] if not written.
//   - fn ended tx itself: an error matching [ErrInvalidArgument] (and fn's own, if any).
//     Nothing is recorded, and fn's writes may stay in tx: roll tx back.
//   - fn returned nil after one of its statements failed: an error saying so, not a store
//     error; the savepoint is rolled back and tx stays usable.
//   - a database error: a [*StoreError]; roll tx back. Cancelling ctx returns ctx's error,
//     and pgx may close the connection, which ends tx.
//
// Defaults: the wait timeout is [DoOpts.WaitTimeout], else [Config.WaitTimeout] (one
// minute). DoOpts.Lease is unused, [Config.FailOpen] does not apply, and ttl counts from
// DoTx's upsert. tx must be on the coordinator's database. Safe for concurrent use on
// different transactions; a pgx.Tx itself is not safe for concurrent use.
func DoTxResult[T any](ctx context.Context, c *Coordinator, tx pgx.Tx, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (Result[T], error) {
	if c == nil || tx == nil || fn == nil {
		return Result[T]{Outcome: OutcomeInvalid}, invalidArgument("DoTx: the coordinator, tx and fn must not be nil")
	}
	cl, err := c.engine.Prepare(ctx, "DoTx", namespace, key, ttl, opts.engineOpts())
	if err != nil {
		return Result[T]{Outcome: OutcomeInvalid}, err
	}
	ctx, o := c.observe(ctx, OpDoTx, namespace, key)
	defer o.closePanicked()
	var value T
	rep, err := c.engine.DoTx(ctx, protocol.PgxTx(tx), cl, o.txFn(txFunc(fn, &value)), func() ([]byte, error) { return encodeValue(value, c.config.MaxValueBytes) })
	res, err := txResult(namespace, key, rep, value, err)
	return observedResult(o, res, err)
}

// DoInTx is [DoTx] in a transaction of its own. It is [DoInTxResult] without the detail;
// see there.
func DoInTx[T any](ctx context.Context, c *Coordinator, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	res, err := DoInTxResult(ctx, c, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// DoInTxResult is [DoTxResult] in a transaction of its own: it begins a transaction on the
// coordinator's pool (READ COMMITTED), runs DoTx in it and commits, and reports how the
// value was obtained. A replay, including the replay of a stored failure, commits nothing
// new.
//
// When DoTx returns an error (or fn panics) the transaction is rolled back. The exception
// is a [Permanent] error from fn: the failed record DoTx wrote is committed (fn's writes
// are undone all the same) and fn's error is returned. Later calls replay it as a
// [*StoredFailureError] without running fn.
//
// A failed commit returns a [*StoreError] for op "commit" instead of fn's value or error,
// with a zero Result. fn's writes (or the failed record) are then not committed. A
// connection lost during COMMIT leaves that uncertain: the next call replays if it did
// commit. A commit that fails by fn's doing returns an error saying so instead, neither
// logged nor counted as a store error. That is a deferred constraint fn's writes broke
// (SQLSTATE class 23; nothing is committed), or fn committing or rolling back tx itself,
// which it must not (matching [ErrInvalidArgument]). Safe for concurrent use.
func DoInTxResult[T any](ctx context.Context, c *Coordinator, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (Result[T], error) {
	if c == nil || fn == nil {
		return Result[T]{Outcome: OutcomeInvalid}, invalidArgument("DoInTx: the coordinator and fn must not be nil")
	}
	cl, err := c.engine.Prepare(ctx, "DoInTx", namespace, key, ttl, opts.engineOpts())
	if err != nil {
		return Result[T]{Outcome: OutcomeInvalid}, err
	}
	ctx, o := c.observe(ctx, OpDoInTx, namespace, key)
	defer o.closePanicked()
	var value T
	rep, err := c.engine.DoInTx(ctx, cl, o.txFn(txFunc(fn, &value)), func() ([]byte, error) { return encodeValue(value, c.config.MaxValueBytes) })
	res, err := txResult(namespace, key, rep, value, err)
	return observedResult(o, res, err)
}

// txFunc adapts fn to the engine, keeping its value in value. Tx is pgx.Tx or *sql.Tx:
// what the engine gives fn for the transaction kind it runs in.
func txFunc[T, Tx any](fn func(ctx context.Context, tx Tx) (T, error), value *T) func(context.Context, any) error {
	return func(ctx context.Context, tx any) error {
		var err error
		*value, err = fn(ctx, tx.(Tx))
		return err
	}
}

// txResult is the Result of a transactional call the engine reported as rep with err:
// fn's value when it ran and was recorded, the record's when it replayed.
func txResult[T any](namespace, key string, rep protocol.Report, value T, err error) (Result[T], error) {
	if rep.Replayed() {
		res := result(rep, *new(T))
		return res, decodeReplay(namespace, key, &rep.Row, &res.Value)
	}
	if err != nil {
		value = *new(T)
	}
	return result(rep, value), err
}
