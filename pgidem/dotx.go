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

// DoTxResult makes a database effect exactly-once: fn's writes and the key's completed
// record commit together in the caller's transaction tx, so the caller's commit makes both
// visible at once and a rollback leaves neither. Use it when the effect is rows in the same
// database as pgidem's tables; use [Do] for effects outside it (mail, HTTP, payments).
//
// Keys, namespaces, ttl and [DoOpts] follow [DoResult]: an invalid namespace or key returns
// an [*InvalidKeyError], a ttl below [Config.MinTTL] an [*InvalidTTLError]; fn is not run
// and tx is not touched. DoOpts.Lease is unused (there is no lease: the transaction holds
// the key) but is still validated.
//
// The record's ttl counts from DoTx's upsert statement (the database's
// statement_timestamp()), not from the caller's commit: time the transaction stays open
// afterwards is taken from the record's life, and a transaction held open longer than ttl
// commits a record that has already expired.
//
// # Protocol
//
// DoTx serialises transactions on the same key with a transaction-scoped advisory lock
// (pg_advisory_xact_lock) on a 64-bit hash of (namespace, key), held until tx ends. When
// the lock is free it is taken and the record read in one round trip. When another
// transaction holds it, the same round trip's read still counts: a completed record or a
// stored failure within its TTL is final, so it is replayed without the lock (a
// transaction that holds the lock only to replay, and stays open, does not hold up the
// key's replays). Otherwise the in-flight policy decides: [InFlightRaise] returns an
// [*InProgressError] at once; [InFlightWait] waits for the lock under SET LOCAL
// lock_timeout, inside a savepoint, in slices between which it reads the record again (a
// record that finished meanwhile replays at once), and returns an [*InProgressError] with
// Waited set when the wait timeout passes. A slice lasts [Config.PollIntervalMax] or twice
// the session's deadlock_timeout (Postgres's default 1 s), whichever is longer, because
// Postgres checks a lock wait for a deadlock only once it has lasted deadlock_timeout:
// two transactions that take two keys (or a key and a row) in opposite order are
// reported as a deadlock to one of them — a [*StoreError] for op "lock" that unwraps to a
// *pgconn.PgError with SQLSTATE 40P01; roll that transaction back and retry it — and the
// other goes on. Either way tx stays usable: the savepoint is rolled back and
// lock_timeout is restored to the caller's value. The RetryAfter hint of a lock conflict
// is [Config.PollIntervalMax] (there is no lease to measure), and its Attempts and
// LeaseExpiresAt are zero.
//
// The wait timeout is [DoOpts.WaitTimeout], else [Config.WaitTimeout] (default one
// minute); it is unused under Raise. It is one budget for the whole call, counted from
// when DoTx starts: the wait for the advisory lock and any polling of a Do holder's row
// (below) both draw on it, and ctx bounds it too. lock_timeout is set to what remains of
// it (or the slice, whichever is less), rounded up to whole milliseconds.
//
// Holding the lock, DoTx reads the record:
//   - completed (or a stored permanent failure) and not expired: the fingerprint is
//     checked ([ErrFingerprintMismatch]) and the stored value is replayed without running
//     fn; Result.Replayed is set.
//   - absent or expired: fn runs with tx's savepoint (see below) and a context carrying the
//     key ([KeyFromContext]); then the completed record, with fn's value as JSON, is
//     upserted in tx. An expired record behaves exactly like no record.
//
// fn runs inside a savepoint of tx and receives it as its tx; fn must not commit or roll it
// back (a fn that does gets an error matching [ErrInvalidArgument] and fn's own error, if
// any; nothing is recorded, and fn's writes may stay in tx: roll tx back). If fn returns an error, panics, or its value cannot be stored as JSON
// ([ErrResultNotStorable]), DoTx rolls back to the savepoint — fn's writes are undone,
// nothing is recorded, tx stays usable — and returns the error (a panic continues). A
// [Permanent] error is different: fn's writes are still undone, but a failed record is
// written in tx and fn's error returned unchanged; commit tx to keep it ([DoInTx] does),
// and later calls replay it as a [*StoredFailureError] matching [ErrPermanent] without
// running fn. Roll tx back instead and the next call runs fn again. When the failed record
// cannot be written, a [*FailureNotStoredError] is returned instead (nothing to commit). On success the savepoint is
// released; nothing is visible to others until the caller commits.
//
// # Meeting Do on one key
//
// [Do] does not take the advisory lock; the record row is what the two share.
//   - DoTx finds a record Do completed: it replays it (same JSON encoding, so use the same
//     T).
//   - DoTx finds Do's record in progress under a live lease: the in-flight policy applies —
//     Raise returns an [*InProgressError] with the lease's retry-after; Wait polls the
//     record (a fresh read per poll under READ COMMITTED) until Do completes (replay),
//     releases it (fn runs) or its lease runs out, bounded by the wait timeout.
//   - Do's holder died and its lease ran out: DoTx takes the record over, runs fn and writes
//     the completed record with attempts incremented (the foreign effect may have happened
//     too); Result.TookOver is set and the takeover is logged. The dead holder's owner
//     token no longer matches, so its late writes are refused ([ErrLeaseLost]).
//   - Do's holder died at the attempts cap ([Config.MaxAttempts], [DoOpts.MaxAttempts]):
//     DoTx parks the record in tx instead of taking it over and returns a [*ParkedError]
//     without running fn. Commit tx to keep the park ([DoInTx] commits it); rolled back,
//     the next call finds the dead holder's record and parks it again. A parked record
//     replays the same error.
//   - Do reserves the key while DoTx's fn runs: DoTx's upsert leaves Do's live row alone,
//     DoTx rolls back to its savepoint (fn's writes are undone) and decides again as above,
//     so the effect still happens once — Do's. The same holds when fn returned a
//     [Permanent] error: it is not recorded and not returned, and DoTx decides again.
//   - Do arrives after DoTx wrote the record but before the caller committed: Do's insert
//     waits for tx; if tx commits, Do replays DoTx's value, if it rolls back, Do runs. Do
//     holds a pool connection while it waits. That statement runs detached from Do's
//     context and is bounded by [Config.FinishTimeout] (default 10 s), not by Do's ctx: if
//     tx stays open longer, Do returns a [*StoreError] for op "reserve" without running
//     fn, also under [Config.FailOpen] (the store answered, so the reservation may exist).
//     Keep transactions that call DoTx short.
//   - In particular, never call Do on a key from the goroutine that holds DoTx's open
//     transaction on that key (after DoTx, before the commit): Do waits for a commit that
//     cannot come while the goroutine is blocked in Do — a deadlock across two connections
//     that Postgres cannot detect. Do blocks for the full [Config.FinishTimeout] whatever
//     its ctx, then fails as just described. Use DoTx again in tx instead: it replays.
//
// Prefer one mode per key: DoTx for rows, Do for foreign effects.
//
// # Isolation, cancellation, errors
//
// Use READ COMMITTED, Postgres's default: each of DoTx's statements then sees what
// committed before it, so a transaction that waited for the lock replays its predecessor.
// Under REPEATABLE READ or SERIALIZABLE the snapshot may predate the predecessor's commit;
// the upsert then fails with a serialization failure (SQLSTATE 40001, returned as a
// [*StoreError]) instead of a duplicate effect, and the caller retries its transaction as
// usual — the retry replays. Waiting for a Do holder does not work there: every poll reads
// the transaction's snapshot, which never shows Do finishing, so [InFlightWait] on a Do
// row in progress can only time out ([*InProgressError] with Waited set) — or, if the
// lease in the snapshot runs out first, take over: fn runs, then the upsert fails with a
// serialization failure and fn's writes are undone. Use [InFlightRaise] and retry the
// transaction, or READ COMMITTED.
//
// Cancelling ctx makes DoTx return ctx's error; like any pgx query cancelled mid-flight,
// pgx may close the connection, which ends tx (nothing commits). Database errors are
// returned as a [*StoreError]; after one, roll tx back. [Config.FailOpen] does not apply:
// the effect lives in the same database. A read-only tx (it could never write the record)
// returns an error matching [ErrInvalidArgument] before fn runs, as do a tx an earlier
// failed statement already aborted, a tx already committed or rolled back, nil arguments and
// a call for the key from within the fn of a call holding it, directly or through calls for
// other keys (in the same transaction it would find no record yet and run fn again and
// again). A fn that returns nil after one of its statements failed (the server then
// aborts the transaction) gets an error saying so, not a store error: its savepoint is
// rolled back, nothing of fn's or the record is written, and tx stays usable. tx must be
// on the coordinator's database: a record written elsewhere is not seen by its other
// calls. DoTx is safe for concurrent use on different transactions; a pgx.Tx itself
// is not safe for concurrent use.
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
// value was obtained. When DoTx returns an error (or fn panics) the transaction is rolled
// back, with one exception: when fn returns a [Permanent] error, the failed record DoTx
// wrote is committed (fn's writes are undone all the same) and fn's error is returned, so
// later calls replay it as a [*StoredFailureError] without running fn. A replay, including
// the replay of a stored failure, commits nothing new. A failed commit returns a
// [*StoreError] for op "commit" instead of fn's value or error (and a zero Result); fn's
// writes (or the failed record) are then not committed, although a connection lost during
// COMMIT leaves that uncertain — the next call replays if it did commit. A commit that
// fails by fn's doing returns an error saying so instead, neither logged nor counted as a
// store error: the server refused it for a deferred constraint fn's writes broke (SQLSTATE
// class 23; nothing is committed), or fn committed or rolled back tx itself, which it must
// not (matching [ErrInvalidArgument]). Safe for concurrent use.
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
