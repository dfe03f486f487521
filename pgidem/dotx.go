package pgidem

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// lockTimeoutMax is the largest lock_timeout Postgres accepts: INT_MAX milliseconds, about
// 24.8 days. DoTx waits longer in successive waits of at most this long.
const lockTimeoutMax = time.Duration(math.MaxInt32) * time.Millisecond

// Advisory lock statements of DoTx. The lock is transaction-scoped: Postgres releases it at
// the caller's commit or rollback, after the commit has made the record visible.
const (
	// sqlTryLock tries the key's lock, unless the transaction is read-only (it could not
	// write the record): then it reports that instead of locking.
	sqlTryLock = `SELECT current_setting('transaction_read_only') = 'on',
	CASE WHEN current_setting('transaction_read_only') = 'on' THEN false ELSE pg_try_advisory_xact_lock($1) END`
	sqlLock = `SELECT pg_advisory_xact_lock($1)`
	// The wait for the lock is bounded by lock_timeout alone: the caller's
	// statement_timeout is lifted meanwhile (a shorter one would end the wait as a
	// cancelled statement) and both are put back after it.
	sqlGetLockTimeout = `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`
	// sqlIdleTimeout reads idle_in_transaction_session_timeout in milliseconds.
	sqlIdleTimeout    = `SELECT setting::bigint FROM pg_catalog.pg_settings WHERE name = 'idle_in_transaction_session_timeout'`
	sqlSetLockTimeout = `SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)`
	// sqlDeadlockTimeout reads the session's deadlock_timeout in whole milliseconds.
	sqlDeadlockTimeout = `SELECT (extract(epoch FROM current_setting('deadlock_timeout')::interval) * 1000)::bigint`
)

// dotxStatements holds DoTx's SQL with the table name quoted in.
type dotxStatements struct {
	read, upsert string
}

func newDotxStatements(schema string) dotxStatements {
	t := qualify(schema, "pgidem_record")
	r := strings.NewReplacer("{t}", t, "{cols}", rowColumns, "{released}", releasedCondition("r."))
	return dotxStatements{
		read: r.Replace(`SELECT {cols} FROM {t} WHERE namespace = $1 AND key = $2`),

		// Write the completed (or permanently failed) record in the caller's transaction.
		// An existing row is overwritten only when it counts as absent: expired, or in
		// progress under a lease that ran out (a Do holder that died; the row's owner token
		// changes, so that holder's late writes are refused). A live row — a Do holder that
		// reserved the key after DoTx read it — is left alone and nothing is returned. A
		// unique violation is never raised, so the caller's transaction is never aborted by
		// a duplicate; the primary key is the backstop behind the advisory lock.
		//
		// took_over (after {cols}) says whether it took over a Do holder that died (a
		// released row is no takeover), decided by this statement rather than by DoTx's
		// earlier read, which fn's whole run separates from the write. Under READ
		// COMMITTED (and READ UNCOMMITTED, which Postgres runs as READ COMMITTED) the old
		// row is locked, in the mode ON CONFLICT DO UPDATE locks it, and read first
		// (locked, evaluated before the insert through the count), so the verdict is about
		// the very version ON CONFLICT then updates, even when another writer commits while
		// the statement waits; a row deleted meanwhile is just skipped. Under REPEATABLE READ and SERIALIZABLE it is
		// read from the snapshot (old's second branch), which is what ON CONFLICT acts on
		// there (a newer version raises a serialization failure), without a lock: locking a
		// row deleted after the snapshot (an expired record swept) would fail although the
		// upsert treats it as absent.
		upsert: r.Replace(`
WITH locked AS (
	SELECT r.expires_at, r.status, r.lease_expires_at, r.updated_at
	FROM {t} AS r WHERE r.namespace = $1 AND r.key = $2
		AND current_setting('transaction_isolation') NOT IN ('repeatable read', 'serializable')
	FOR NO KEY UPDATE
), old AS (
	SELECT r.expires_at <= statement_timestamp() AS was_expired, ({released}) AS was_released
	FROM (SELECT * FROM locked
		UNION ALL
		SELECT r.expires_at, r.status, r.lease_expires_at, r.updated_at
		FROM {t} AS r WHERE r.namespace = $1 AND r.key = $2
			AND current_setting('transaction_isolation') IN ('repeatable read', 'serializable')) AS r
)
INSERT INTO {t} AS r (namespace, key, status, owner, attempts, fingerprint, result, error,
	lease_expires_at, expires_at, created_at, updated_at, completed_at)
SELECT $1, $2, $3, $4, 1, $5, $6::jsonb, $7::jsonb, NULL,
	statement_timestamp() + $8 * interval '1 microsecond',
	statement_timestamp(), statement_timestamp(), statement_timestamp()
FROM (SELECT count(*) FROM old) AS read_first
ON CONFLICT (namespace, key) DO UPDATE SET
	status = excluded.status,
	owner = excluded.owner,
	attempts = CASE WHEN r.expires_at <= statement_timestamp() THEN 1
		WHEN {released} THEN r.attempts
		ELSE r.attempts + 1 END,
	fingerprint = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.fingerprint
		ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
	result = excluded.result,
	error = excluded.error,
	lease_expires_at = NULL,
	expires_at = excluded.expires_at,
	created_at = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.created_at
		ELSE r.created_at END,
	updated_at = excluded.updated_at,
	completed_at = excluded.completed_at
WHERE r.expires_at <= statement_timestamp()
	OR (r.status = 'in_progress' AND r.lease_expires_at <= statement_timestamp()
		AND (excluded.fingerprint IS NULL OR r.fingerprint IS NULL
			OR r.fingerprint = excluded.fingerprint))
RETURNING {cols}, coalesce((SELECT NOT was_expired AND NOT was_released FROM old), false) AS took_over`),
	}
}

// lockKey returns the advisory lock id of (namespace, key): the FNV-1a 64-bit hash of
// "pgidem", a zero byte, the namespace's length in bytes as a uvarint, the namespace and
// the key. The length prefix keeps ("a", "bc") and ("ab", "c") apart. Applications that
// take their own pg_advisory_xact_lock(bigint) locks share this id space; a collision only
// serialises two unrelated transactions, it never breaks correctness.
func lockKey(namespace, key string) int64 {
	h := fnv.New64a()
	var n [binary.MaxVarintLen64]byte
	h.Write([]byte("pgidem\x00"))
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(namespace)))])
	h.Write([]byte(namespace))
	h.Write([]byte(key))
	return int64(h.Sum64())
}

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
		return Result[T]{}, invalidArgument("DoTx: the coordinator, tx and fn must not be nil")
	}
	cl, err := c.newCall(namespace, key, ttl, opts)
	if err == nil {
		err = checkNotHeld(ctx, "DoTx", c.config.Schema, namespace, key, false)
	}
	if err != nil {
		c.emitInvalid(ctx, namespace)
		return Result[T]{}, err
	}
	res, _, err := doTx(ctx, c, tx, cl, fn)
	return res, err
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
	var zero Result[T]
	if c == nil || fn == nil {
		return zero, invalidArgument("DoInTx: the coordinator and fn must not be nil")
	}
	cl, err := c.newCall(namespace, key, ttl, opts)
	if err == nil {
		err = checkNotHeld(ctx, "DoInTx", c.config.Schema, namespace, key, false)
	}
	if err != nil {
		c.emitInvalid(ctx, namespace)
		return zero, err
	}
	if err := ctx.Err(); err != nil {
		return zero, err
	}
	// READ WRITE explicitly: a pool whose sessions default to read-only transactions
	// still records, and a server that refuses writes (a hot standby) fails the BEGIN as
	// a store error, not as the caller's read-only transaction.
	tx, err := c.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		return zero, c.logStoreError(ctx, cl, storeError("begin", err))
	}
	committed := false
	defer func() {
		if !committed { // error or panic: nothing of this call may commit
			c.rollbackDetached(ctx, tx)
		}
	}()
	res, failureStored, err := doTx(ctx, c, tx, cl, fn)
	if err != nil && !failureStored {
		return res, err
	}
	if commitErr := tx.Commit(ctx); commitErr != nil {
		committed = true // Commit ended the transaction either way
		if refused := commitRefused("DoInTx", commitErr); refused != nil {
			return zero, refused
		}
		return zero, c.logStoreError(ctx, cl, storeError("commit", commitErr))
	}
	committed = true
	return res, err // err is nil, or fn's permanent failure, now stored
}

// savepointName names the savepoints DoTx opens in the caller's transaction. Nested DoTx
// calls (fn calling DoTx with its tx) reuse it: Postgres lets a newer savepoint shadow an
// older one of the same name and releases and rolls back to the newest.
const savepointName = "pgidem_dotx"

// savepoint is a savepoint DoTx opens in the caller's transaction, given to fn as its tx.
// Unlike pgx's nested transaction, rolling it back also releases it: ROLLBACK TO SAVEPOINT
// alone keeps the savepoint and its subtransaction open, so a caller looping over DoTx
// calls that fail would nest one more subtransaction per call, and past 64 of them
// Postgres's per-backend cache of subtransactions overflows, which slows every snapshot
// in the cluster while the transaction stays open. Everything else is the caller's tx
// (Begin makes a pgx savepoint inside this one).
//
// It counts as closed only once its release succeeded: a Commit or Rollback that failed (a
// cancelled ctx refuses the statement and keeps the connection) can be rolled back again on
// a detached context, so fn's writes never stay behind in an open savepoint.
type savepoint struct {
	pgx.Tx
	closed bool
}

func beginSavepoint(ctx context.Context, tx pgx.Tx) (*savepoint, error) {
	if _, err := tx.Exec(ctx, "SAVEPOINT "+savepointName); err != nil {
		return nil, err
	}
	return &savepoint{Tx: tx}, nil
}

// Commit releases the savepoint; its writes become the enclosing transaction's.
func (s *savepoint) Commit(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	_, err := s.Tx.Exec(ctx, "RELEASE SAVEPOINT "+savepointName)
	s.closed = err == nil
	return err
}

// Rollback undoes the savepoint's writes and releases it.
func (s *savepoint) Rollback(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	if _, err := s.Tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepointName); err != nil {
		return err
	}
	_, err := s.Tx.Exec(ctx, "RELEASE SAVEPOINT "+savepointName)
	s.closed = err == nil
	return err
}

// rollbackDetached rolls tx (a transaction or a savepoint) back on a context detached from
// ctx, so a cancelled caller still releases what it holds.
func (c *Coordinator) rollbackDetached(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	_ = tx.Rollback(ctx) // the error, if any, is already the caller's; the conn is closed on failure
}

// doTx is DoTxResult after validation. failureStored is true when fn returned a
// [Permanent] error and the failed record was written in tx (err is then fn's error): the
// one error after which tx holds something worth committing.
func doTx[T any](ctx context.Context, c *Coordinator, tx pgx.Tx, cl *call, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (res Result[T], failureStored bool, err error) {
	if err := ctx.Err(); err != nil {
		return res, false, err
	}
	start := time.Now()
	r, found, err := c.txLockAndRead(ctx, tx, cl, start, &res.Waited)
	if err != nil {
		return res, false, err
	}
	w := c.newWaiter(cl, start, res.Waited) // the lock wait spends the same budget
	races, idleChecked := 0, false
	for {
		if found {
			if err := c.checkFingerprint(ctx, cl, &r); err != nil {
				return res, false, err
			}
		}

		switch {
		case found && !r.available() && r.status != StatusInProgress:
			res.Replayed, res.Attempts = true, r.attempts
			c.emit(ctx, EventReplayed, cl.namespace, 1)
			return res, false, decodeReplay(cl, r, &res.Value)

		case found && !r.available():
			// In progress under a live lease: a Do holder is running the effect. tx stays
			// idle while DoTx sleeps between reads, so each sleep stays well inside the
			// session's idle_in_transaction_session_timeout, which would end tx.
			if cl.policy == InFlightWait && !idleChecked {
				idleChecked = true
				if w.maxSleep, err = c.txIdleBound(ctx, tx, cl); err != nil {
					return res, false, err
				}
			}
			err := w.inProgress(ctx, &r)
			res.Waited = w.waited
			if err != nil {
				return res, false, err
			}

		default:
			// Absent, expired, or a dead Do holder's lease ran out: run fn here.
			out, won, err := runTx(ctx, c, tx, cl, fn)
			if err != nil {
				return res, out.failureStored, err
			}
			if won {
				res.Value, res.Attempts, res.TookOver = out.value, out.row.attempts, out.row.tookOver
				if out.row.tookOver {
					c.config.Logger.WarnContext(ctx, "pgidem: took over expired lease in a transaction; the effect may run more than once",
						slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.Int("attempts", out.row.attempts))
					c.emit(ctx, EventTakenOver, cl.namespace, 1)
				}
				return res, false, nil
			}
			// A Do holder reserved the key after the read; fn's writes were rolled back and
			// nothing was recorded (not even a permanent failure).
			c.config.Logger.InfoContext(ctx, "pgidem: key reserved by Do while the transaction ran; rolled back to the savepoint",
				slog.String("namespace", cl.namespace), slog.String("key", cl.key))
			if races++; races > maxSnapshotRetries {
				return res, false, c.logStoreError(ctx, cl, &StoreError{Op: "complete",
					Err: errors.New("the record kept changing under the transaction")})
			}
		}

		r, found, err = c.txRead(ctx, tx, cl)
		if err != nil {
			return res, false, err
		}
	}
}

// txIdleBound returns a third of tx's idle_in_transaction_session_timeout, or 0 when it has
// none: how long DoTx may leave tx idle at a time.
func (c *Coordinator) txIdleBound(ctx context.Context, tx pgx.Tx, cl *call) (time.Duration, error) {
	var ms int64
	err := tx.QueryRow(ctx, sqlIdleTimeout).Scan(&ms)
	if err != nil {
		return 0, c.logStoreError(ctx, cl, storeError("lookup", err))
	}
	return time.Duration(ms) * time.Millisecond / 3, nil
}

// txRead reads the key's record in tx. found is false when there is no row.
func (c *Coordinator) txRead(ctx context.Context, tx pgx.Tx, cl *call) (r row, found bool, err error) {
	err = tx.QueryRow(ctx, c.sql.dotx.read, cl.namespace, cl.key).Scan(r.scanTargets(false)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	if err != nil {
		return r, false, c.logStoreError(ctx, cl, storeError("lookup", err))
	}
	return r, true, nil
}

// txLockAndRead takes the key's advisory lock in tx following the in-flight policy, then
// reads the record. The uncontended case is one round trip: the try-lock and the read are
// pipelined, and the server runs the read (taking its snapshot) only after the lock
// statement finished, so the read sees every commit of the lock's previous holder. When
// another transaction holds the lock but that read shows a finished record, the record is
// returned without the lock: replaying it needs none.
func (c *Coordinator) txLockAndRead(ctx context.Context, tx pgx.Tx, cl *call, start time.Time, waited *bool) (row, bool, error) {
	id := lockKey(cl.namespace, cl.key)
	var r row
	batch := &pgx.Batch{}
	batch.Queue(sqlTryLock, id)
	batch.Queue(c.sql.dotx.read, cl.namespace, cl.key)
	br := tx.SendBatch(ctx, batch)
	var readOnly, locked, found bool
	err := br.QueryRow().Scan(&readOnly, &locked)
	if err == nil {
		err = br.QueryRow().Scan(r.scanTargets(false)...)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if txErr := unusableTx("DoTx", err); txErr != nil { // fn was not run
		c.emitInvalid(ctx, cl.namespace)
		return r, false, txErr
	}
	if err != nil {
		return r, false, c.logStoreError(ctx, cl, storeError("lock", err))
	}
	if readOnly {
		c.emitInvalid(ctx, cl.namespace)
		return r, false, invalidArgument("DoTx: the transaction is read-only, so it cannot hold the record; fn was not run")
	}
	if locked || (found && r.finished()) {
		// A finished record is final until it expires (only Forget or an operator's SQL
		// removes it sooner), so it replays without the lock: a transaction holding the
		// lock, perhaps only to replay too, does not delay the caller.
		return r, found, nil
	}

	inProgress := &InProgressError{Namespace: cl.namespace, Key: cl.key, RetryAfter: c.config.PollIntervalMax}
	if cl.policy == InFlightRaise {
		c.emit(ctx, EventInProgress, cl.namespace, 1)
		return r, false, inProgress
	}
	*waited = true
	inProgress.Waited = true
	c.emit(ctx, EventWaited, cl.namespace, 1)
	// Postgres looks for a deadlock only once a lock wait has lasted deadlock_timeout, so
	// every slice of the wait outlasts it twice over: two transactions that take two keys
	// in opposite order are then reported as a deadlock (SQLSTATE 40P01) instead of both
	// waiting out their whole budget.
	var deadlockMS int64
	if err := tx.QueryRow(ctx, sqlDeadlockTimeout).Scan(&deadlockMS); err != nil {
		return r, false, c.logStoreError(ctx, cl, storeError("lock", err))
	}
	slice := max(c.config.PollIntervalMax, 2*time.Duration(deadlockMS)*time.Millisecond)
	for {
		remaining := cl.waitTimeout - time.Since(start)
		if remaining <= 0 {
			c.emit(ctx, EventInProgress, cl.namespace, 1)
			return r, false, inProgress
		}
		// The lock is waited for in slices (lock_timeout has a ceiling too), reading the
		// record between them: the lock's holder may keep it long after the record
		// finished (a transaction that replayed and stays open), and a finished record
		// replays without the lock.
		wait := min(remaining, lockTimeoutMax, slice)
		err := c.txWaitLock(ctx, tx, cl, id, wait)
		if err == nil {
			return c.txRead(ctx, tx, cl)
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != sqlstateLockNotAvailable {
			return r, false, c.logStoreError(ctx, cl, storeError("lock", err))
		}
		if wait == remaining { // the whole budget was waited for
			c.emit(ctx, EventInProgress, cl.namespace, 1)
			return r, false, inProgress
		}
		r, found, err := c.txRead(ctx, tx, cl)
		if err != nil || (found && r.finished()) {
			return r, found, err
		}
	}
}

// txWaitLock blocks on the advisory lock for at most timeout, inside a savepoint so that a
// lock timeout (which raises an error) does not abort the caller's transaction. It sets
// lock_timeout (and lifts statement_timeout) with SET LOCAL semantics and restores the
// caller's values afterwards; rolling back to the savepoint restores them too.
func (c *Coordinator) txWaitLock(ctx context.Context, tx pgx.Tx, cl *call, id int64, timeout time.Duration) error {
	sp, err := beginSavepoint(ctx, tx)
	if err != nil {
		return err
	}
	// Postgres counts lock_timeout in whole milliseconds, treats 0 as "no timeout" and
	// accepts at most lockTimeoutMax.
	ms := min(max((timeout+time.Millisecond-1)/time.Millisecond, 1), lockTimeoutMax/time.Millisecond)
	batch := &pgx.Batch{}
	batch.Queue(sqlGetLockTimeout)
	batch.Queue(sqlSetLockTimeout, fmt.Sprintf("%dms", ms), "0")
	batch.Queue(sqlLock, id)
	br := sp.SendBatch(ctx, batch)
	var previousLock, previousStatement string
	err = br.QueryRow().Scan(&previousLock, &previousStatement)
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil {
		_, err = br.Exec()
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		c.rollbackDetached(ctx, sp)
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		return err
	}
	if _, err := sp.Exec(ctx, sqlSetLockTimeout, previousLock, previousStatement); err != nil {
		c.rollbackDetached(ctx, sp)
		return err
	}
	// Releasing the savepoint keeps the lock: it passes to the enclosing transaction.
	if err := sp.Commit(ctx); err != nil {
		c.rollbackDetached(ctx, sp)
		return err
	}
	return nil
}

// txOutcome is what runTx produced when its record write won.
type txOutcome[T any] struct {
	value T
	row   row
	// failureStored: fn returned a permanent error and the failed record was written.
	failureStored bool
}

// runTx runs fn inside a savepoint of tx and upserts the completed record there (a
// permanent failure: in tx, after rolling the savepoint back). won is false when a live
// record appeared meanwhile (a Do holder): fn's writes are then rolled back, nothing is
// recorded, and the caller decides again.
func runTx[T any](ctx context.Context, c *Coordinator, tx pgx.Tx, cl *call, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (out txOutcome[T], won bool, err error) {
	sp, err := beginSavepoint(ctx, tx)
	if err != nil {
		return out, false, c.logStoreError(ctx, cl, storeError("savepoint", err))
	}
	released := false
	defer func() {
		if !released { // error, lost race or panic: undo fn's writes
			c.rollbackDetached(ctx, sp)
		}
	}()

	c.emit(ctx, EventExecuted, cl.namespace, 1)
	value, fnErr := fn(withKey(ctx, c.config.Schema, cl.namespace, cl.key, false), sp)
	if sp.closed {
		// fn released or rolled back its savepoint itself: nothing can be recorded with
		// its writes any more, and they cannot be undone (a release merged them into tx).
		// Whatever fn returned, the caller must roll tx back.
		released = true
		err := fmt.Errorf("pgidem: DoTx: fn ended the transaction it was given (Commit or Rollback), which it must not: "+
			"nothing was recorded, and fn's writes may be in tx: roll tx back: %w", ErrInvalidArgument)
		if fnErr != nil {
			err = fmt.Errorf("%w (fn returned: %w)", err, fnErr)
		}
		return out, true, err
	}
	if fnErr != nil {
		var permanent *PermanentError
		if !errors.As(fnErr, &permanent) {
			return out, true, fnErr
		}
		// Undo fn's writes, then store the failure for replay in a savepoint of its own:
		// when a live record blocks the write, the upsert has still locked that row (ON
		// CONFLICT DO UPDATE locks the conflicting row even when its WHERE is false), and
		// only rolling the savepoint back releases the lock — otherwise tx would hold it
		// while the caller waits for that record's holder, whose heartbeat it would block
		// until the holder's lease ran out and tx took over a live holder.
		notStored := func(err error) error { return &FailureNotStoredError{Err: fnErr, Cause: err} }
		if err := sp.Rollback(ctx); err != nil {
			// The deferred rollback, on a detached context, undoes fn's writes.
			return out, true, notStored(c.logStoreError(ctx, cl, storeError("release", err)))
		}
		failure, _ := json.Marshal(storedFailure{Message: storableMessage(permanent.Error())})
		if sp, err = beginSavepoint(ctx, tx); err != nil {
			released = true
			return out, true, notStored(c.logStoreError(ctx, cl, storeError("savepoint", err)))
		}
		_, won, err := c.txUpsert(ctx, sp, cl, StatusFailed, nil, failure)
		if err != nil {
			// The deferred rollback undoes the write; fn's error must not be lost.
			return out, true, notStored(err)
		}
		if !won {
			return out, false, nil // the deferred rollback releases the row lock
		}
		if err := sp.Commit(ctx); err != nil { // releasing the savepoint keeps the lock in tx
			return out, true, notStored(c.logStoreError(ctx, cl, storeError("complete", err)))
		}
		released = true
		out.failureStored = true
		return out, true, fnErr
	}

	// A panicking MarshalJSON unwinds through the deferred rollback: the effect is undone.
	result, encErr := encodeValue(value, c.config.MaxValueBytes)
	if encErr != nil {
		// fn's writes are undone with the savepoint, so the effect did not happen.
		return out, true, fmt.Errorf("%w: %v (the transaction's effect was rolled back)", ErrResultNotStorable, encErr)
	}
	r, won, err := c.txUpsert(ctx, sp, cl, StatusCompleted, result, nil)
	if err != nil || !won {
		return out, won, err
	}
	if err := sp.Commit(ctx); err != nil {
		return out, true, c.logStoreError(ctx, cl, storeError("complete", err))
	}
	released = true
	return txOutcome[T]{value: value, row: r}, true, nil
}

// txUpsert writes the finished record in db (tx or its savepoint). won is false when a live
// record blocked the write.
func (c *Coordinator) txUpsert(ctx context.Context, db executor, cl *call, status Status, result, failure []byte) (row, bool, error) {
	var r row
	err := db.QueryRow(ctx, c.sql.dotx.upsert, cl.namespace, cl.key, status, newOwner(), cl.fingerprint,
		jsonText(result), jsonText(failure), micros(cl.ttl)).Scan(append(r.scanTargets(false), &r.tookOver)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && isValueRefused(err) {
		// jsonb refused the result (an unpaired surrogate, a number beyond numeric's range,
		// nesting too deep): the caller's value, not the store, is at fault.
		return r, false, fmt.Errorf("%w: the database rejected it: %s (the transaction's effect was rolled back)",
			ErrResultNotStorable, pgErr.Message)
	}
	if abortErr := abortedByFn("DoTx", err); abortErr != nil {
		return r, false, abortErr
	}
	if err != nil {
		return r, false, c.logStoreError(ctx, cl, storeError("complete", err))
	}
	return r, true, nil
}
