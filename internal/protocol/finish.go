package protocol

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgidem/pgidem/internal/store"
)

// complete stores the outcome of cl's held reservation (status completed with result, or
// failed with failure), sharing a statement with concurrent completions (batch.go). Its
// errors are finish's.
func (c *Engine) complete(ctx context.Context, cl *Call, owner pgtype.UUID, status store.Status, result, failure []byte) error {
	err := errBatchFallback
	if c.config.MaxBatch > 1 {
		_, err = c.completes.do(ctx, completeReq{cl: cl, Owner: owner, Status: status, Result: result, Failure: failure})
	}
	if err == errBatchFallback {
		err = c.finish(ctx, cl, owner, "complete", c.sql.Complete, status, store.JSONText(result), store.JSONText(failure), store.Micros(cl.ttl))
	}
	if err == nil {
		c.notifyDone(cl)
	}
	return err
}

// errFinishNoRow means the owner-conditional write matched no row: the lease was lost.
var errFinishNoRow = errors.New("pgidem: reservation no longer owned")

// finish runs an owner-conditional write on a context detached from the caller's, retrying
// store errors briefly. It returns errFinishNoRow when the row is no longer ours (except
// for a release retried after an attempt that may have committed: the missing row is that
// attempt's delete) and a *store.Error when the store kept failing (the lease expiry then
// lets a later delivery decide).
func (c *Engine) finish(ctx context.Context, cl *Call, owner pgtype.UUID, op, sql string, extra ...any) error {
	q := &heldConn{pool: c.pool}
	defer q.release()
	err := c.finishOn(ctx, q, cl, owner, op, sql, extra...)
	if err == nil && op == "release" {
		c.notifyDone(cl)
	}
	return err
}

// finishOn is finish with its first attempt on q's held connection, if any; a failed
// attempt gives it back, and later ones run on connections acquired from the pool (q
// holds the last one; the caller releases q).
func (c *Engine) finishOn(ctx context.Context, q *heldConn, cl *Call, owner pgtype.UUID, op, sql string, extra ...any) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	args := append([]any{cl.namespace, cl.key, owner}, extra...)
	// Pauses between attempts of a failing write: about a second in all.
	finishRetries := [...]time.Duration{50 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond}
	var err error
	maybeApplied := false // an earlier attempt may have reached the server and committed
	for attempt := 0; ; attempt++ {
		var tag pgconn.CommandTag
		if q.conn == nil {
			q.conn, err = c.poolConn(ctx)
		}
		if err == nil {
			tag, err = q.conn.Exec(ctx, sql, args...)
		}
		if err != nil {
			q.release()
		}
		if err == nil {
			if tag.RowsAffected() == 0 && !(op == "release" && maybeApplied) {
				// A release that finds no row after an attempt that may have committed was
				// done by that attempt, whose reply was lost (a first reservation
				// deleted); anything else means the reservation is no longer ours.
				return errFinishNoRow
			}
			return nil
		}
		maybeApplied = maybeApplied || store.MayHaveApplied(err)
		if store.IsValueRefused(err) {
			// A value the server refuses is refused again, and is the caller's to handle
			// (run stores it as not storable): not a store failure to log.
			return &store.Error{Op: op, Err: err}
		}
		if attempt >= len(finishRetries) || ctx.Err() != nil {
			break
		}
		time.Sleep(finishRetries[attempt])
	}
	// ctx is this write's own (FinishTimeout): its deadline passing is the store's doing.
	return c.logStoreError(context.WithoutCancel(ctx), cl, &store.Error{Op: op, Err: err})
}
