package protocol

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// txIdleBound returns a third of tx's idle_in_transaction_session_timeout, or 0 when it has
// none: how long DoTx may leave tx idle at a time.
func (c *Engine) txIdleBound(ctx context.Context, tx Tx, cl *Call) (time.Duration, error) {
	var ms int64
	err := tx.QueryRow(ctx, store.IdleTimeout).Scan(&ms)
	if err != nil {
		return 0, c.logStoreError(ctx, cl, store.Wrap("lookup", err))
	}
	return time.Duration(ms) * time.Millisecond / 3, nil
}

// txRead reads the key's record in tx. found is false when there is no row.
func (c *Engine) txRead(ctx context.Context, tx Tx, cl *Call) (r store.Row, found bool, err error) {
	err = tx.QueryRow(ctx, c.sql.TxRead, cl.namespace, cl.key).Scan(r.ScanTargets(false)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	if err != nil {
		return r, false, c.logStoreError(ctx, cl, store.Wrap("lookup", err))
	}
	return r, true, nil
}

// txLockAndRead takes the key's advisory lock in tx following the in-flight policy, then
// reads the record. The uncontended case is one round trip: the try-lock and the read are
// pipelined, and the server runs the read (taking its snapshot) only after the lock
// statement finished, so the read sees every commit of the lock's previous holder. When
// another transaction holds the lock but that read shows a finished record, the record is
// returned without the lock: replaying it needs none.
func (c *Engine) txLockAndRead(ctx context.Context, tx Tx, cl *Call, start time.Time, waited *bool) (store.Row, bool, error) {
	id := store.LockKey(cl.namespace, cl.key)
	var r store.Row
	batch := &pgx.Batch{}
	batch.Queue(store.TryLock, id)
	batch.Queue(c.sql.TxRead, cl.namespace, cl.key)
	br := tx.sendBatch(ctx, batch)
	var readOnly, locked, found bool
	err := br.QueryRow().Scan(&readOnly, &locked)
	if err == nil {
		err = br.QueryRow().Scan(r.ScanTargets(false)...)
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
		return r, false, c.logStoreError(ctx, cl, store.Wrap("lock", err))
	}
	if readOnly {
		c.emitInvalid(ctx, cl.namespace)
		return r, false, InvalidArgument("DoTx: the transaction is read-only, so it cannot hold the record; fn was not run")
	}
	if locked || (found && r.Finished()) {
		// A finished record is final until it expires (only Forget or an operator's SQL
		// removes it sooner), so it replays without the lock: a transaction holding the
		// lock, perhaps only to replay too, does not delay the caller.
		return r, found, nil
	}

	return c.txAwaitLock(ctx, tx, cl, id, start, waited)
}

// txAwaitLock follows the in-flight policy when another transaction holds the key's
// advisory lock: InFlightRaise returns an [*InProgressError] at once; InFlightWait waits
// for the lock within the call's wait budget, reading the record between slices of the
// wait, and returns the record once it holds the lock or the record finished.
func (c *Engine) txAwaitLock(ctx context.Context, tx Tx, cl *Call, id int64, start time.Time, waited *bool) (store.Row, bool, error) {
	var r store.Row
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
	if err := tx.QueryRow(ctx, store.DeadlockTimeout).Scan(&deadlockMS); err != nil {
		return r, false, c.logStoreError(ctx, cl, store.Wrap("lock", err))
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
		wait := min(remaining, store.LockTimeoutMax, slice)
		err := c.txWaitLock(ctx, tx, cl, id, wait)
		if err == nil {
			return c.txRead(ctx, tx, cl)
		}
		if !store.IsLockNotAvailable(err) {
			return r, false, c.logStoreError(ctx, cl, store.Wrap("lock", err))
		}
		if wait == remaining { // the whole budget was waited for
			c.emit(ctx, EventInProgress, cl.namespace, 1)
			return r, false, inProgress
		}
		r, found, err := c.txRead(ctx, tx, cl)
		if err != nil || (found && r.Finished()) {
			return r, found, err
		}
	}
}

// txWaitLock blocks on the advisory lock for at most timeout, inside a savepoint so that a
// lock timeout (which raises an error) does not abort the caller's transaction. It sets
// lock_timeout (and lifts statement_timeout) with SET LOCAL semantics and restores the
// caller's values afterwards; rolling back to the savepoint restores them too.
func (c *Engine) txWaitLock(ctx context.Context, tx Tx, cl *Call, id int64, timeout time.Duration) error {
	sp, err := beginSavepoint(ctx, tx)
	if err != nil {
		return err
	}
	// Postgres counts lock_timeout in whole milliseconds, treats 0 as "no timeout" and
	// accepts at most store.LockTimeoutMax.
	ms := min(max((timeout+time.Millisecond-1)/time.Millisecond, 1), store.LockTimeoutMax/time.Millisecond)
	batch := &pgx.Batch{}
	batch.Queue(store.GetLockTimeout)
	batch.Queue(store.SetLockTimeout, fmt.Sprintf("%dms", ms), "0")
	batch.Queue(store.Lock, id)
	br := sp.sendBatch(ctx, batch)
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
	if _, err := sp.Exec(ctx, store.SetLockTimeout, previousLock, previousStatement); err != nil {
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
