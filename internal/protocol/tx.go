package protocol

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgidem/pgidem/internal/store"
)

// DoInTx is [Engine.DoTx] in a transaction of its own: it begins a transaction on the
// coordinator's pool (READ COMMITTED), runs DoTx in it and commits. It is the engine of
// pgidem's DoInTxResult, whose comment describes the contract.
//
// When DoTx returns an error (or fn panics) the transaction is rolled back. The exception
// is a [Permanent] error from fn: the failed record DoTx wrote is committed (fn's writes
// are undone all the same) and fn's error is returned. A replay, including the replay of a
// stored failure, commits nothing new. A failed commit returns a [*StoreError] for op
// "commit", unless the failure is fn's doing ([commitRefused]). Safe for concurrent use.
func (c *Engine) DoInTx(ctx context.Context, cl *Call, fn func(ctx context.Context, tx any) error, encode func() ([]byte, error)) (Report, error) {
	var zero Report
	if err := ctx.Err(); err != nil {
		return zero, err
	}
	// READ WRITE explicitly: a pool whose sessions default to read-only transactions
	// still records, and a server that refuses writes (a hot standby) fails the BEGIN as
	// a store error, not as the caller's read-only transaction.
	tx, err := c.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		zero.Outcome = OutcomeStoreError
		return zero, c.logStoreError(ctx, cl, store.Wrap("begin", err))
	}
	committed := false
	defer func() {
		if !committed { // error or panic: nothing of this call may commit
			c.rollbackDetached(ctx, tx)
		}
	}()
	res, failureStored, err := c.doTx(ctx, PgxTx(tx), cl, fn, encode)
	if err != nil && !failureStored {
		return res, err
	}
	if commitErr := tx.Commit(ctx); commitErr != nil {
		committed = true // Commit ended the transaction either way
		if refused := commitRefused("DoInTx", commitErr); refused != nil {
			return zero, refused
		}
		zero.Outcome = OutcomeStoreError
		return zero, c.logStoreError(ctx, cl, store.Wrap("commit", commitErr))
	}
	committed = true
	return res, err // err is nil, or fn's permanent failure, now stored
}

// DoTx runs the protocol for cl in the caller's transaction tx: fn runs in a savepoint
// of tx and the finished record is written there, so the caller's commit makes both
// visible together. fn's tx is a pgx.Tx for a [PgxTx], the *sql.Tx for an [SQLTx]. A
// replayed record comes back in the report's Row.
func (c *Engine) DoTx(ctx context.Context, tx Tx, cl *Call, fn func(ctx context.Context, tx any) error, encode func() ([]byte, error)) (Report, error) {
	rep, _, err := c.doTx(ctx, tx, cl, fn, encode)
	return rep, err
}

// doTx is DoTx. failureStored is true when fn returned a [Permanent] error and the failed
// record was written in tx (err is then fn's error): the one error after which tx holds
// something worth committing.
func (c *Engine) doTx(ctx context.Context, tx Tx, cl *Call, fn func(ctx context.Context, tx any) error, encode func() ([]byte, error)) (res Report, failureStored bool, err error) {
	defer func() { res.failed(err) }()
	if err := ctx.Err(); err != nil {
		return res, false, err
	}
	start := time.Now()
	r, found, err := c.txLockAndRead(ctx, tx, cl, start, &res.Waited)
	if err != nil {
		return res, false, err
	}
	w := c.newWaiter(cl, start, res.Waited) // the lock wait spends the same budget
	defer w.done()
	races, idleChecked := 0, false
	for {
		if found {
			if err := c.checkFingerprint(ctx, cl, &r); err != nil {
				return res, false, err
			}
		}

		switch {
		case found && !r.Available() && r.Status != store.StatusInProgress:
			res.Row, res.Attempts, res.Outcome = r, r.Attempts, replayOutcome(&r, res.Waited)
			c.emit(ctx, EventReplayed, cl.namespace, 1)
			return res, false, nil

		case found && !r.Available():
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

		case found && r.AtCap(cl.maxAttempts):
			// A dead Do holder left the record at the attempts cap: park it in tx instead
			// of taking it over (read again when it changed meanwhile).
			if done, err := c.parkTx(ctx, tx, cl, &r, &res); done {
				return res, false, err
			}

		default:
			// Absent, expired, or a dead Do holder's lease ran out: run fn here.
			won, failureStored, err := c.runTxReported(ctx, tx, cl, fn, encode, &res)
			if err != nil || won {
				return res, failureStored, err
			}
			// A Do holder reserved the key after the read (or one died at the attempts cap:
			// the next read parks it); fn's writes were rolled back and nothing was
			// recorded (not even a permanent failure), so what the next read finds is the
			// outcome.
			res.Outcome = OutcomeNone
			c.config.Logger.InfoContext(ctx, "pgidem: key reserved by Do while the transaction ran; rolled back to the savepoint",
				slog.String("namespace", cl.namespace), slog.String("key", cl.key))
			if races++; races > maxSnapshotRetries {
				return res, false, c.logStoreError(ctx, cl, &store.Error{Op: "complete",
					Err: errors.New("the record kept changing under the transaction")})
			}
		}

		r, found, err = c.txRead(ctx, tx, cl)
		if err != nil {
			return res, false, err
		}
	}
}

// runTxReported runs fn in tx (runTx) and reports what happened in res. won is false
// when a live record appeared meanwhile: the caller reads the key again.
func (c *Engine) runTxReported(ctx context.Context, tx Tx, cl *Call, fn func(ctx context.Context, tx any) error, encode func() ([]byte, error), res *Report) (won, failureStored bool, err error) {
	out, won, err := c.runTx(ctx, tx, cl, fn, encode)
	if out.ran {
		res.Outcome = OutcomeExecuted
		if cl.notStored {
			res.Outcome = OutcomeNotStored
		}
	}
	if err != nil || !won {
		return won, out.failureStored, err
	}
	res.Attempts, res.TookOver = out.row.Attempts, out.row.TookOver
	if out.row.TookOver {
		res.Outcome = OutcomeTakenOver
		c.config.Logger.WarnContext(ctx, "pgidem: took over expired lease in a transaction; the effect may run more than once",
			slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.Int("attempts", out.row.Attempts))
		c.emit(ctx, EventTakenOver, cl.namespace, 1)
	}
	return true, false, nil
}

// txOutcome is what runTx produced.
type txOutcome struct {
	// ran: fn ran (its writes may since have been rolled back).
	ran bool
	// row is the record written, when the write won.
	row store.Row
	// failureStored: fn returned a permanent error and the failed record was written.
	failureStored bool
}

// runTx runs fn inside a savepoint of tx and upserts the completed record there (a
// permanent failure: in tx, after rolling the savepoint back). won is false when a live
// record appeared meanwhile (a Do holder): fn's writes are then rolled back, nothing is
// recorded, and the caller decides again.
func (c *Engine) runTx(ctx context.Context, tx Tx, cl *Call, fn func(ctx context.Context, tx any) error, encode func() ([]byte, error)) (out txOutcome, won bool, err error) {
	sp, err := beginSavepoint(ctx, tx)
	if err != nil {
		return out, false, c.logStoreError(ctx, cl, store.Wrap("savepoint", err))
	}
	released := false
	defer func() {
		if !released { // error, lost race or panic: undo fn's writes
			c.rollbackDetached(ctx, sp)
		}
	}()

	c.emit(ctx, EventExecuted, cl.namespace, 1)
	out.ran = true
	fnErr := fn(withKey(ctx, c.config.Schema, cl.namespace, cl.key, false), tx.fnTx(sp))
	if sp.closed {
		// fn released or rolled back its savepoint itself: nothing can be recorded with
		// its writes any more, and they cannot be undone (a release merged them into tx).
		// Whatever fn returned, the caller must roll tx back.
		released = true
		return out, true, fnEndedTx(fnErr)
	}
	if fnErr != nil {
		var permanent *PermanentError
		if !errors.As(fnErr, &permanent) {
			return out, true, fnErr
		}
		released = true // storeTxFailure rolls back what it must
		won, stored, err := c.storeTxFailure(ctx, tx, sp, cl, fnErr, permanent)
		out.failureStored = stored
		return out, won, err
	}

	// A panicking MarshalJSON unwinds through the deferred rollback: the effect is undone.
	result, encErr := encode()
	if encErr != nil {
		cl.notStored = true
		// fn's writes are undone with the savepoint, so the effect did not happen.
		return out, true, fmt.Errorf("%w: %v (the transaction's effect was rolled back)", ErrResultNotStorable, encErr)
	}
	r, won, err := c.txUpsert(ctx, sp, cl, store.StatusCompleted, result, nil)
	if err != nil || !won {
		return out, won, err
	}
	if err := sp.Commit(ctx); err != nil {
		return out, true, c.logStoreError(ctx, cl, store.Wrap("complete", err))
	}
	released = true
	out.row = r
	return out, true, nil
}

// storeTxFailure undoes fn's writes (rolling sp back), then stores fn's permanent failure
// for replay in a savepoint of its own. When a live record blocks the write, the upsert
// has still locked that row: ON CONFLICT DO UPDATE locks the conflicting row even when
// its WHERE is false. Only rolling the savepoint back releases the lock. Otherwise tx
// would hold it while the caller waits for that record's holder. tx would block the
// holder's heartbeat until its lease ran out, and then take over a live holder. It returns
// fn's error once stored; won is false when a live record blocked the write.
func (c *Engine) storeTxFailure(ctx context.Context, tx Tx, sp *savepoint, cl *Call, fnErr error, permanent *PermanentError) (won, stored bool, err error) {
	notStored := func(err error) error {
		cl.notStored = true
		return &FailureNotStoredError{Err: fnErr, Cause: err}
	}
	if err := sp.Rollback(ctx); err != nil {
		c.rollbackDetached(ctx, sp) // on a detached context: it undoes fn's writes
		return true, false, notStored(c.logStoreError(ctx, cl, store.Wrap("release", err)))
	}
	failure, _ := json.Marshal(store.StoredFailure{Message: storableMessage(permanent.Error())})
	fsp, err := beginSavepoint(ctx, tx)
	if err != nil {
		return true, false, notStored(c.logStoreError(ctx, cl, store.Wrap("savepoint", err)))
	}
	_, won, err = c.txUpsert(ctx, fsp, cl, store.StatusFailed, nil, failure)
	switch {
	case err != nil:
		c.rollbackDetached(ctx, fsp) // undoes the write; fn's error must not be lost
		return true, false, notStored(err)
	case !won:
		c.rollbackDetached(ctx, fsp) // releases the row lock
		return false, false, nil
	}
	if err := fsp.Commit(ctx); err != nil { // releasing the savepoint keeps the lock in tx
		c.rollbackDetached(ctx, fsp)
		return true, false, notStored(c.logStoreError(ctx, cl, store.Wrap("complete", err)))
	}
	return true, true, fnErr
}

// txUpsert writes the finished record in db (tx or its savepoint). won is false when a live
// record blocked the write.
func (c *Engine) txUpsert(ctx context.Context, db rowQuerier, cl *Call, status store.Status, result, failure []byte) (store.Row, bool, error) {
	var r store.Row
	err := db.QueryRow(ctx, c.sql.TxUpsert, cl.namespace, cl.key, status, store.NewOwner(), cl.fingerprint,
		store.JSONText(result), store.JSONText(failure), store.Micros(cl.ttl), cl.maxAttempts).Scan(append(r.ScanTargets(false), &r.TookOver)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false, nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && store.IsValueRefused(err) {
		// jsonb refused the result (an unpaired surrogate, a number beyond numeric's range,
		// nesting too deep): the caller's value, not the store, is at fault.
		return r, false, fmt.Errorf("%w: the database rejected it: %s (the transaction's effect was rolled back)",
			ErrResultNotStorable, pgErr.Message)
	}
	if abortErr := abortedByFn("DoTx", err); abortErr != nil {
		return r, false, abortErr
	}
	if errors.Is(err, pgx.ErrTxClosed) {
		// A *sql.Tx that fn committed or rolled back (a pgx fn can only end its savepoint,
		// which runTx checks before).
		return r, false, fnEndedTx(nil)
	}
	if err != nil {
		return r, false, c.logStoreError(ctx, cl, store.Wrap("complete", err))
	}
	return r, true, nil
}

// fnEndedTx is the error of a DoTx whose fn ended the transaction (or savepoint) it was
// given; fnErr is what fn returned.
func fnEndedTx(fnErr error) error {
	err := fmt.Errorf("pgidem: DoTx: fn ended the transaction it was given (Commit or Rollback), which it must not: "+
		"nothing was recorded, and fn's writes may be in tx: roll tx back: %w", ErrInvalidArgument)
	if fnErr != nil {
		err = fmt.Errorf("%w (fn returned: %w)", err, fnErr)
	}
	return err
}
