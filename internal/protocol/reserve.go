package protocol

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/pgidem/internal/store"
)

// acquisition is the outcome of acquire: either this caller holds the reservation (held),
// or row is a completed, failed or parked record to replay.
type acquisition struct {
	held     bool
	row      store.Row
	waited   bool
	tookOver bool
	parked   bool // this call parked row, a record at the attempts cap
	answered bool // the store answered a read: failing open is no longer allowed
	// prevLeaseExpiry is when the lease of the holder taken over ran out (zero: it
	// released the key, or there was none).
	prevLeaseExpiry time.Time
}

// maxSnapshotRetries is how many times the reserve statement is re-run at once after
// finding a row committed after its snapshot (resolved by the next statement in practice)
// before pausing for a poll interval.
const maxSnapshotRetries = 10

// acquire reserves the key, takes over an available record, or waits/raises for an
// in-progress one (the reservation protocol of the package docs). It writes only when it
// inserts or takes over; reading an existing record never writes.
func (c *Engine) acquire(ctx context.Context, cl *Call) (acquisition, error) {
	var acq acquisition
	w := c.newWaiter(cl, time.Time{}, false)
	defer w.done()
	snapshotRetries := 0
	for round := 0; ; round++ {
		if err := ctx.Err(); err != nil {
			return acq, err
		}
		// Under ReserveFirst the first round goes straight to the reserving insert, which
		// reads an existing row itself.
		r, held, err := c.readOrReserve(ctx, cl, round == 0 && cl.reserveFirst, &acq)
		if round == 0 && err == nil {
			c.orders.observe(cl.namespace, !r.Inserted)
		}
		if err == errReadAgain {
			// A row committed after the statement's snapshot: run it again, pausing if
			// the key churns.
			if snapshotRetries++; snapshotRetries%maxSnapshotRetries == 0 {
				if err := sleepCtx(ctx, jitter(c.config.PollIntervalMin)); err != nil {
					return acq, err
				}
			}
			continue
		}
		if err != nil {
			return acq, err
		}
		if r.Inserted {
			ok, err := c.keepReservation(ctx, held, cl, &r)
			if err == nil && !ok {
				continue // taken over before fn started: read again
			}
			acq.held, acq.row = ok, r
			return acq, err
		}
		acq.answered = true

		if err := c.checkFingerprint(ctx, cl, &r); err != nil {
			return acq, err
		}
		if r.AtCap(cl.maxAttempts) {
			parked, err := c.parkRecord(ctx, cl, &r)
			if parked || err != nil {
				acq.row, acq.parked = r, parked
				return acq, err
			}
			continue // the record changed since it was read: read again
		}
		if r.Available() {
			if done, err := c.takeOver(ctx, cl, &r, &acq); done || err != nil {
				return acq, err
			}
			continue // another caller took it over first (or it was deleted): read again
		}
		if r.Status != store.StatusInProgress {
			acq.row = r
			return acq, nil
		}

		// In progress under a live lease.
		err = w.inProgress(ctx, &r)
		acq.waited = w.waited
		if err != nil {
			return acq, err
		}
	}
}

// errReadAgain tells acquire to read the key again: a statement's snapshot missed a row
// committed after it (or the server refused it with a serialization failure).
var errReadAgain = errors.New("pgidem: read the key again")

// readOrReserve reads the key's record and, when there is none, runs the reserving insert,
// which returns either this call's reservation (r.Inserted, made on held when not nil) or
// the existing row. skipRead goes straight to the insert. It sets acq.answered once the
// store answered: from then on failing open is not allowed.
func (c *Engine) readOrReserve(ctx context.Context, cl *Call, skipRead bool, acq *acquisition) (r store.Row, held *pgxpool.Conn, err error) {
	err = pgx.ErrNoRows
	if !skipRead {
		// A plain indexed read first: a replay, the path that must stay cheap, costs one
		// read (a record in progress or expired, two; a waiter's polls, one); reads
		// never write.
		r, err = c.probe(ctx, cl)
		// The store answered. From here on a failure is not "unreachable": the
		// reserving insert may be blocked behind another transaction's uncommitted
		// record for the key (an open DoTx), and failing open would run fn beside it.
		if err == nil || errors.Is(err, pgx.ErrNoRows) {
			acq.answered = true
		}
		if store.IsSerializationFailure(err) { // chosen as a victim under SERIALIZABLE
			acq.answered = true
			return r, nil, errReadAgain
		}
	}
	detached := false // err is the reserving write's, not the read's
	if errors.Is(err, pgx.ErrNoRows) {
		var refused bool
		r, held, refused, err = c.reserveWrite(ctx, c.sql.Reserve, cl)
		detached = true
		if err == nil || refused || !store.IsConnectError(err) {
			// The statement reached the store: it may have reserved the key or found
			// (or waited for) another caller's record. Never fail open after this.
			acq.answered = true
		}
		if errors.Is(err, pgx.ErrNoRows) || store.IsSerializationFailure(err) {
			// The conflicting row committed after the statement's snapshot (or was
			// deleted in between; under a stricter default isolation the server says
			// so with a serialization failure).
			return r, nil, errReadAgain
		}
	}
	if ctxErr := callerEnded(err); ctxErr != nil {
		return r, nil, ctxErr
	}
	if err != nil {
		errCtx := ctx
		if detached {
			// The reserving write ran on a context of its own (FinishTimeout): its
			// deadline passing is the store's doing, whatever the caller's ctx did.
			errCtx = context.WithoutCancel(ctx)
		}
		return r, nil, c.logStoreError(errCtx, cl, store.Wrap("reserve", err))
	}
	return r, held, nil
}

// takeOver takes over r, an expired record or a record whose lease expired. done is true
// when acquire returns: holding the reservation, or with err. false means another caller
// was first (or the row changed): read the key again.
func (c *Engine) takeOver(ctx context.Context, cl *Call, r *store.Row, acq *acquisition) (done bool, err error) {
	t, held, _, err := c.reserveWrite(ctx, c.sql.Takeover, cl)
	if errors.Is(err, pgx.ErrNoRows) || store.IsSerializationFailure(err) {
		return false, nil
	}
	if ctxErr := callerEnded(err); ctxErr != nil {
		return true, ctxErr
	}
	if err != nil { // the takeover ran on a context of its own, as the insert did
		return true, c.logStoreError(context.WithoutCancel(ctx), cl, store.Wrap("takeover", err))
	}
	if t.Recovered { // the takeover's reply was lost: it counted an attempt, or not
		t.TookOver = t.Attempts == r.Attempts+1
	}
	ok, err := c.keepReservation(ctx, held, cl, &t)
	if err != nil || !ok {
		return err != nil, err // not ok: taken over again before fn started
	}
	acq.held, acq.row = true, t
	if t.TookOver {
		acq.tookOver, acq.prevLeaseExpiry = true, r.LeaseExpires.Time
		c.config.Logger.WarnContext(ctx, "pgidem: took over expired lease; the effect may run more than once",
			slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.Int("attempts", t.Attempts))
		c.emit(ctx, EventTakenOver, cl.namespace, 1)
	}
	return true, nil
}

// reserveWrite runs a reserving statement (the insert or the takeover) on a context
// detached from the caller's and bounded by FinishTimeout, so its outcome is always known:
// a reservation committed on the server but abandoned by a cancelled client would block
// the key for a lease and then count as a takeover that never was. The statement can block
// behind another transaction's uncommitted record for the key (an open DoTx); a caller
// cancelled meanwhile returns when it finishes, at most FinishTimeout later. Waiting for a
// pool connection sends nothing, so that wait ends with ctx (detachedConn), and acquire
// then returns ctx's error.
//
// Each call makes a fresh owner token; a row the statement reserved carries it. Reserving
// inserts of concurrent calls share a statement (batch.go).
//
// held, when not nil, is the connection the call's own statement reserved on; the caller
// gives it back (keepReservation), having renewed or released the reservation on it. A
// reservation made by a shared round comes without one: the round released it already if
// the caller's context had ended (releaseEnded).
//
// refused reports that a shared round reached the server and was refused before the call
// ran its own statement, or that a write may have committed with its reply lost: the store
// answered (or may hold this call's reservation), so failing open is no longer allowed even
// if a later statement cannot connect.
//
// A write whose reply was lost after it may have committed (mayHaveApplied) is not
// abandoned: the row then carries this call's owner token, which no other call has. The
// call reads the row and, finding its token in progress, holds the reservation it made
// (recovered); otherwise it runs its statement again, once.
func (c *Engine) reserveWrite(ctx context.Context, sql string, cl *Call) (r store.Row, held *pgxpool.Conn, refused bool, err error) {
	owner := store.NewOwner()
	unknown := false // an earlier attempt with owner may have committed
	// Any reservation this call makes is granted by a statement sent after this moment.
	defer func(sent time.Time) { r.LeaseFrom = sent }(time.Now())
	if sql == c.sql.Reserve && c.config.MaxBatch > 1 {
		r, err := c.reserves.do(ctx, reserveReq{ctx: ctx, cl: cl, Owner: owner})
		switch {
		case err == errBatchFallback:
			refused = true
		case replyLost(err):
			unknown, refused = true, true
		default:
			return r, nil, false, err
		}
	}
	// The first statement runs on a connection acquired while ctx lasts (unless an earlier
	// write may have committed: then the call must find out, whatever ctx does); a retry
	// after a lost reply gives it back and runs on any connection of the pool.
	wctx, cancel, conn, err := c.detachedConn(ctx, unknown)
	if err != nil {
		return store.Row{}, nil, refused, err
	}
	defer cancel()
	// The connection stays with the caller while it holds a reservation made on it, so
	// that renewing or releasing it before fn runs needs no other (keepReservation).
	q := &heldConn{pool: c.pool, conn: conn}
	defer func() {
		if err != nil || !ownedBy(&r, owner) {
			q.release()
		}
		held = q.conn
	}()
	for attempt := 0; ; attempt++ {
		if unknown {
			if mine, ok, err := c.ownReservation(wctx, q.q(), cl, owner); err != nil || ok {
				return mine, nil, refused, err
			}
		}
		r, err = c.reserveOne(wctx, q.q(), sql, cl, owner)
		if unknown && err == nil && !r.Inserted && ownedBy(&r, owner) {
			// The first write committed after the read above (it was still running on the
			// server, behind a lock): the insert finds its own row.
			r.Inserted, r.Recovered = true, true
		}
		if unknown && errors.Is(err, pgx.ErrNoRows) {
			// Or this write waited for the first one to finish and then matched nothing:
			// look once more, now that the first is done.
			if mine, ok, rerr := c.ownReservation(wctx, q.q(), cl, owner); rerr != nil || ok {
				return mine, nil, refused, rerr
			}
		}
		if attempt > 0 || !replyLost(err) {
			return r, nil, refused, err
		}
		unknown, refused = true, true
		q.release() // the connection may be broken; with a pool of one, the retry needs it
	}
}

// reserveOne runs a single-key reserving statement with owner as the token.
func (c *Engine) reserveOne(ctx context.Context, q store.Executor, sql string, cl *Call, owner pgtype.UUID) (store.Row, error) {
	var r store.Row
	targets := r.ScanTargets(true)
	args := []any{cl.namespace, cl.key, owner, cl.fingerprint, store.Micros(cl.lease), store.Micros(cl.ttl)}
	if sql == c.sql.Takeover {
		targets = append(targets, &r.TookOver)
		args = append(args, cl.maxAttempts)
	}
	err := q.QueryRow(ctx, sql, args...).Scan(targets...)
	return r, err
}

// ownReservation reads cl's record and reports whether it is in progress under owner: a
// reserving write of this call committed although its reply was lost. The row comes back
// as the write would have returned it (inserted; for a takeover, acquire decides
// tookOver from its own read).
func (c *Engine) ownReservation(ctx context.Context, q store.Executor, cl *Call, owner pgtype.UUID) (store.Row, bool, error) {
	var r store.Row
	err := q.QueryRow(ctx, c.sql.Lookup, cl.namespace, cl.key).Scan(r.ScanTargets(false)...)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return store.Row{}, false, nil
	case err != nil:
		return store.Row{}, false, err
	case !ownedBy(&r, owner):
		return store.Row{}, false, nil
	}
	r.Inserted, r.Recovered = true, true
	return r, true, nil
}

// ownedBy reports whether r is in progress under owner with its lease running: a
// reservation this call made. One whose lease already ran out is not claimed (another
// caller may be taking it over); the caller takes it over like any expired lease.
func ownedBy(r *store.Row, owner pgtype.UUID) bool {
	return r.Status == store.StatusInProgress && r.Owner == owner && !r.LeaseExpired && !r.Released
}

// replyLost reports whether a reserving write failed with err after it may have
// committed: not pgx.ErrNoRows (an answer: nothing reserved) and not an error that proves
// nothing was applied.
func replyLost(err error) bool {
	return err != nil && !errors.Is(err, pgx.ErrNoRows) && store.MayHaveApplied(err)
}

// keepReservation readies a reservation just made (r) for fn, on held, the connection it
// was made on (nil: any of the pool's), which it then gives back: it releases the
// reservation when ctx ended meanwhile, returning ctx's error, and renews a lease that
// may be short (freshLease). ok is false when the reservation is no longer cl's (the
// caller reads the key again) or err is set.
func (c *Engine) keepReservation(ctx context.Context, held *pgxpool.Conn, cl *Call, r *store.Row) (ok bool, err error) {
	q := &heldConn{pool: c.pool, conn: held}
	defer q.release()
	if err := c.releaseIfCancelled(ctx, q, cl, r.Owner); err != nil {
		return false, err
	}
	if ok, err := c.freshLease(ctx, q, cl, r); err != nil || !ok {
		return false, err
	}
	// ctx may have ended while the lease was renewed.
	if err := c.releaseIfCancelled(ctx, q, cl, r.Owner); err != nil {
		return false, err
	}
	return true, nil
}

// freshLease renews a lease just granted to cl (r) before fn starts, when a third of it
// or more went by since the granting statement was sent: a statement that waited (behind
// another transaction's uncommitted record for the key, or through a lost-reply recovery)
// grants a lease counted from its start on the server, which can be over already, and
// another caller could then take the key over while fn starts. It returns false when the
// reservation is no longer cl's (the caller reads the key again), and a store error when
// the renewal failed — after releasing the reservation, so no caller waits a lease for it.
func (c *Engine) freshLease(ctx context.Context, q *heldConn, cl *Call, r *store.Row) (bool, error) {
	if time.Since(r.LeaseFrom) < cl.lease/3 {
		return true, nil
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	sent := time.Now()
	tag, err := q.q().Exec(wctx, c.sql.Heartbeat, cl.namespace, cl.key, r.Owner, store.Micros(cl.lease), store.Micros(cl.ttl))
	switch {
	case tag.RowsAffected() == 0 && err == nil, store.IsSerializationFailure(err):
		// Taken over meanwhile (under a stricter default isolation the server says so
		// with a serialization failure): read the key again.
		return false, nil
	case err != nil:
		q.release() // it may be what failed
		_ = c.finishOn(ctx, q, cl, r.Owner, "release", c.sql.Release)
		if ctxErr := ctx.Err(); ctxErr != nil {
			return false, ctxErr
		}
		return false, c.logStoreError(ctx, cl, store.Wrap("heartbeat", err))
	}
	r.LeaseFrom = sent
	return true, nil
}

// releaseIfCancelled gives back a reservation just made when the caller's context ended
// while it was being made, and returns the context's error; otherwise nil.
func (c *Engine) releaseIfCancelled(ctx context.Context, q *heldConn, cl *Call, owner pgtype.UUID) error {
	if ctx.Err() == nil {
		return nil
	}
	_ = c.finishOn(ctx, q, cl, owner, "release", c.sql.Release)
	return ctx.Err()
}
