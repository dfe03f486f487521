package protocol

import (
	"context"
	"errors"
	"log/slog"
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
	return err
}

// errFinishNoRow means the owner-conditional write matched no row: the lease was lost.
var errFinishNoRow = errors.New("pgidem: reservation no longer owned")

// finish runs an owner-conditional write on a context detached from the caller's, retrying
// store errors (see finishOn). It returns errFinishNoRow when the row is no longer ours
// (except for a release retried after an attempt that may have committed: the missing row
// is that attempt's delete) and a *store.Error when the store kept failing (the lease
// expiry then lets a later delivery decide).
func (c *Engine) finish(ctx context.Context, cl *Call, owner pgtype.UUID, op, sql string, extra ...any) error {
	q := &heldConn{pool: c.pool}
	defer q.release()
	return c.finishOn(ctx, q, cl, owner, op, sql, extra...)
}

// finishPauses are the pauses between attempts of a failing finishing write; the last
// repeats.
var finishPauses = [...]time.Duration{50 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond, time.Second}

// finishShortRetries is how many times a finishing write is sent again after failures
// other than the server being unavailable, within FinishTimeout.
const finishShortRetries = 3

// finishOn is finish with its first attempt on q's held connection, if any; a failed
// attempt gives it back, and later ones run on connections acquired from the pool (q
// holds the last one; the caller releases q).
//
// The first attempts share a deadline FinishTimeout after the first. A failed write is
// sent again up to finishShortRetries times within it, whatever the lease. The answer
// tells the caller whether the record was taken over (errFinishNoRow) rather than leaving
// it with a store error. The write is conditional on owner, so it cannot change a record
// another caller took over.
//
// A write that keeps failing because the server is unavailable (store.IsServerUnavailable:
// restarting, failing over, unreachable) is then sent again, a second apart. That goes on
// for as long as the lease cl holds allows (cl.held, which the heartbeat moves on while it
// renews), each attempt with FinishTimeout of its own. No such retry is sent within a
// tenth of a lease of the lease's end as the holder knows it. The holder counts from the
// send time of the statement that granted or last renewed it, before the server starts
// counting. So none is sent once another caller could take the key over. And none is sent
// more than one lease after the first attempt, should renewals succeed meanwhile. Without a known lease (a reservation released before fn ran) only the short
// retries are made.
func (c *Engine) finishOn(ctx context.Context, q *heldConn, cl *Call, owner pgtype.UUID, op, sql string, extra ...any) error {
	detached := context.WithoutCancel(ctx)
	first := time.Now()
	deadline := first.Add(c.config.FinishTimeout)
	args := append([]any{cl.namespace, cl.key, owner}, extra...)
	var err error
	maybeApplied := false // an earlier attempt may have reached the server and committed
	warned := false       // the retries while the lease lasts were logged
	for attempt := 0; ; attempt++ {
		var tag pgconn.CommandTag
		tag, err = c.finishAttempt(detached, deadline, q, sql, args)
		if err == nil {
			if warned {
				c.config.Logger.LogAttrs(detached, slog.LevelInfo, "pgidem: finishing write succeeded after retrying",
					slog.String("op", op), slog.String("namespace", cl.namespace), slog.String("key", cl.key),
					slog.Int("attempts", attempt+1), slog.Duration("retried_for", time.Since(first)))
			}
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
		pause := finishPauses[min(attempt, len(finishPauses)-1)]
		var retry, extended bool
		if retry, extended, deadline = c.finishRetry(cl, attempt, first, deadline, time.Now().Add(pause), err); !retry {
			break
		}
		if extended && !warned {
			warned = true
			c.config.Logger.LogAttrs(detached, slog.LevelWarn, "pgidem: store unavailable for the finishing write; retrying while the lease lasts",
				slog.String("op", op), slog.String("namespace", cl.namespace), slog.String("key", cl.key),
				slog.Time("lease_ends", cl.held.until()), slog.String("error", err.Error()))
		}
		time.Sleep(pause)
	}
	// The deadline is this write's own (FinishTimeout): its passing is the store's doing.
	return c.logStoreError(detached, cl, &store.Error{Op: op, Err: err})
}

// finishAttempt sends a finishing write once, on q's connection or one acquired from the
// pool, bounded by deadline. A failed attempt gives the connection back.
func (c *Engine) finishAttempt(ctx context.Context, deadline time.Time, q *heldConn, sql string, args []any) (pgconn.CommandTag, error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	var tag pgconn.CommandTag
	var err error
	if q.conn == nil {
		q.conn, err = c.poolConn(ctx)
	}
	if err == nil {
		tag, err = q.conn.Exec(ctx, sql, args...)
	}
	if err != nil {
		q.release()
	}
	return tag, err
}

// finishRetry reports whether a finishing write that failed with err on attempt (from 0),
// first sent at first, is sent again at next (see finishOn), whether that retry is one of
// those made while the lease lasts (extended), and the deadline of that attempt.
func (c *Engine) finishRetry(cl *Call, attempt int, first, deadline, next time.Time, err error) (retry, extended bool, _ time.Time) {
	if attempt < finishShortRetries && next.Before(deadline) {
		return true, false, deadline
	}
	leaseEnd := cl.held.until()
	switch {
	case leaseEnd.IsZero() || !store.IsServerUnavailable(err):
		return false, false, deadline
	case !next.Before(leaseEnd.Add(-cl.lease/10)) || !next.Before(first.Add(cl.lease)):
		return false, false, deadline // another caller may take the key over soon
	}
	return true, true, later(deadline, next.Add(c.config.FinishTimeout))
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
