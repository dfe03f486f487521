package pgidem

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DoOpts are optional per-call settings for [Do], [DoResult], [DoTx], [DoTxResult],
// [DoInTx] and [DoInTxResult]. A nil *DoOpts means the coordinator's defaults.
type DoOpts struct {
	// Fingerprint identifies the payload the key was first used for (callers hash the
	// request body or the fields that matter). It is stored on reserve and compared on every
	// later path (replay, in progress, takeover) when both the stored and the given
	// fingerprint are non-nil. A difference returns [ErrFingerprintMismatch], and fn is not
	// run. A released first reservation is deleted and binds nothing. A record released
	// after a takeover keeps its fingerprint, since the dead holder may have run the effect
	// for that payload: another payload under the key stays refused until the record
	// expires. Default nil: no check.
	Fingerprint []byte

	// InFlight overrides [Config.InFlight] for this call. Default [InFlightDefault]: the
	// config's. A value that is not one of the policies returns an error matching
	// [ErrInvalidArgument].
	InFlight InFlightPolicy

	// WaitTimeout overrides [Config.WaitTimeout] for this call. Default 0: the config's
	// (0 cannot mean "do not wait": use [InFlightRaise]). A negative one returns an error
	// matching [ErrInvalidArgument].
	WaitTimeout time.Duration

	// Lease overrides [Config.Lease] for this call; at least [LeaseMin] and shorter than
	// the TTL, or the call returns an [*InvalidTTLError]. Default 0: the config's.
	Lease time.Duration

	// ReserveFirst skips the indexed read a call starts with and goes straight to the
	// reserving INSERT … ON CONFLICT DO NOTHING, which returns an existing record in the
	// same round trip (and takes no lock or transaction id when it finds one). It saves a
	// round trip when keys are usually new — queue jobs, where replays are the exception —
	// and costs more per replay (that statement reads the existing row at about 1.7× the
	// plain read; docs/performance.md). Default false: read first, which makes replays one
	// plain indexed read. Either way the protocol and its guarantees are the same. DoTx and
	// DoInTx ignore it (they read under an advisory lock).
	ReserveFirst bool
}

// Result is what [DoResult] returns: fn's value and how it was obtained.
type Result[T any] struct {
	// Value is fn's value: returned by fn on this call, or decoded from the record on a
	// replay.
	Value T
	// Replayed is true when Value (or the error) came from the record and fn did not run.
	Replayed bool
	// Attempts is the record's attempt count after this call: 1 normally, more when a
	// takeover happened (this call's or an earlier one's) and the effect may have run more
	// than once. 0 when fn ran unprotected ([Config.FailOpen]).
	Attempts int
	// Waited is true when the call waited for another holder before its outcome.
	Waited bool
	// TookOver is true when this call took over an expired lease from a holder that
	// stopped renewing it (not a record its holder released after an error, which is
	// taken over without counting an attempt).
	TookOver bool
	// FailedOpen is true when fn ran unprotected because the store was unreachable.
	FailedOpen bool
	// LeaseLost is true when fn ran and the write that followed it (completing, storing a
	// permanent failure, or releasing after fn's error) found the reservation taken over by
	// another holder: fn's outcome was not written, and the effect may have run more than
	// once. The error says so too, except after fn's own ordinary error, which is returned
	// unchanged: then this is the only sign. (fn's context is cancelled with cause
	// [ErrLeaseLost] when no renewal succeeded by a tenth of a lease before it ends, before
	// this is known; that alone does not set it.)
	LeaseLost bool
}

// Do runs fn at most once per (namespace, key) within ttl and returns its value; later
// calls with the same key replay the stored value without running fn. It is [DoResult]
// without the detail; see there for the protocol, errors and cancellation.
func Do[T any](ctx context.Context, c *Coordinator, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context) (T, error)) (T, error) {
	res, err := DoResult(ctx, c, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// DoResult runs fn under an idempotency key reserved in Postgres and reports how its value
// was obtained.
//
// The key names the effect ("order-9.invoice"), not the delivery: a job or message id only
// dedupes redeliveries of that one job, not two jobs for the same effect. namespace and key
// are separate columns, so no character is reserved; they must be non-empty valid UTF-8
// without control characters, within [Config.MaxNamespaceBytes] and [Config.MaxKeyBytes],
// or the call returns an [*InvalidKeyError] and fn is never run. ttl is how long the
// record counts, measured from completion (while in progress, from the holder's last
// heartbeat: its record expires a ttl after its lease, so a dead holder is always taken
// over first): at least [Config.MinTTL] and longer than the lease, or [*InvalidTTLError].
// Make it outlive the queue's retry and retention horizon ([DoOpts.Lease] out of range
// returns the same error). A nil c or fn, another [DoOpts] field out of range, or a call
// for the key from within the fn of a call holding it, directly or through calls for other
// keys (it would wait for itself), returns an error matching [ErrInvalidArgument]; fn is
// not run.
//
// The first caller reserves the key and runs fn with a context that carries the key
// ([KeyFromContext]) and is cancelled with cause [ErrLeaseLost] when renewals stall until a
// tenth of a lease before it ends or find the reservation taken over (see
// [Result.LeaseLost] for what proves a takeover); a heartbeat renews the lease every lease/3 while fn runs, so a slow live
// holder is never taken over. No connection is held while fn runs. Then:
//   - fn succeeds: the value is stored as JSON (jsonb, encoding/json rules) and returned;
//     later calls replay it, decoded into T. Zero values, nil pointers, empty slices and
//     null are stored as such. A stored value that no longer decodes into T (a result
//     type changed between deploys, two call sites share a key with different types)
//     replays as an error matching [ErrReplayNotDecodable], and fn does not run. Three
//     limits come from JSON and jsonb: a json.RawMessage replays as the same JSON value in
//     jsonb's normal form, numbers inside an any decode as float64, and a negative zero
//     replays as 0 (jsonb's numeric has no sign on zero). A value that cannot be stored exactly (a channel, NaN, a string with NUL or
//     invalid UTF-8, more than [Config.MaxValueBytes] of JSON, nesting deeper than 10000)
//     is returned with an error matching [ErrResultNotStorable]; the record is completed
//     without it, so the effect is not repeated.
//   - fn returns an error: the record is released so the next delivery runs fn again, and
//     the error is returned unchanged. Releasing deletes a first reservation; one that
//     took over a dead holder's is kept with its lease ended, so the next call takes it
//     over at once (counting no attempt and reporting no takeover: this holder did not
//     die) and the record's attempts still show that the effect may have run more than
//     once.
//   - fn returns a [Permanent] error: it is stored and replayed as a
//     [*StoredFailureError]. When storing it fails, the error returned is a
//     [*FailureNotStoredError]: it matches fn's error and also [ErrStoreUnavailable] or
//     [ErrLeaseLost], and nothing will be replayed: a later call takes the key over once
//     the lease ends.
//   - fn panics: the record is released and the panic continues.
//   - encoding fn's value panics (its MarshalJSON): the effect ran, so the record is
//     completed without the value, as for a value that cannot be stored (later calls
//     replay an error matching [ErrResultNotStorable]), and the panic continues.
//
// The finishing write runs on a context detached from ctx, bounded by
// [Config.FinishTimeout] and retried briefly, so a cancelled caller does not leave the
// record stuck in progress. If it finds the reservation taken over, the value is returned
// with an error matching [ErrLeaseLost] (the effect may have run twice; the record's
// attempts say so).
//
// A caller that finds the key in progress under a live lease follows the in-flight policy
// ([InFlightWait] by default, [InFlightRaise]); a waiter gives up with an
// [*InProgressError] after the wait timeout, or with ctx.Err() when ctx ends, and never
// writes. A record whose lease expired (its holder died) is taken over and fn runs again
// with Attempts incremented; an expired record behaves exactly like no record.
//
// Database errors before fn runs return a [*StoreError] (matching [ErrStoreUnavailable])
// and fn is not run, unless [Config.FailOpen] is set. Cancelling ctx before fn runs
// returns ctx.Err() and leaves no reservation behind (one made while ctx ended is released
// at once; a reserving statement already sent finishes first, within
// [Config.FinishTimeout]). With every connection of the pool in use (a pool smaller than
// the calls holding one, such as handlers inside [Coordinator.InboxHandle] or [DoInTx]
// calling Do), the statements before fn wait for a connection while ctx lasts and, when
// ctx ends first, return its error with nothing sent (with or without
// [DoOpts.ReserveFirst]), also while queued behind a concurrent call's shared reserving
// statement that waits for its connection; the reserving statement waits at most
// [Config.FinishTimeout] and then returns a [*StoreError]. Size the pool for the calls in
// flight. Safe for concurrent use.
func DoResult[T any](ctx context.Context, c *Coordinator, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context) (T, error)) (Result[T], error) {
	var res Result[T]
	if c == nil || fn == nil {
		return res, invalidArgument("Do: the coordinator and fn must not be nil")
	}
	call, err := c.newCall(namespace, key, ttl, opts)
	if err == nil {
		err = checkNotHeld(ctx, "Do", c.config.Schema, namespace, key, false)
	}
	if err != nil {
		c.emitInvalid(ctx, namespace)
		return res, err
	}
	acq, err := c.acquire(ctx, call)
	res.Waited, res.TookOver = acq.waited, acq.tookOver
	if err != nil {
		// Fail open only when no connection to the store could be made, so no reservation
		// can exist: once the store answered (a live holder, an uncommitted DoTx record)
		// running fn could run it beside another holder; a statement cut off mid-way may
		// have reserved the key; and a server that answered with an error (a missing
		// table, a wrong schema) is a misconfiguration that must not silently turn
		// deduplication off.
		if c.config.FailOpen && isConnectError(err) && !acq.answered && ctx.Err() == nil {
			c.config.Logger.WarnContext(ctx, "pgidem: store unavailable, running effect unprotected (FailOpen)",
				slog.String("namespace", namespace), slog.String("key", key), slog.String("error", err.Error()))
			c.emit(ctx, EventFailOpen, namespace, 1)
			res.FailedOpen = true
			res.Value, err = fn(withKey(ctx, c.config.Schema, namespace, key, false))
			return res, err
		}
		return res, err
	}
	res.Attempts = acq.row.attempts

	if !acq.held {
		res.Replayed = true
		c.emit(ctx, EventReplayed, namespace, 1)
		err := decodeReplay(call, acq.row, &res.Value)
		return res, err
	}

	c.emit(ctx, EventExecuted, namespace, 1)
	var value T
	fnErr := c.run(ctx, call, acq.row.owner, acq.row.leaseFrom, func(ctx context.Context) error {
		var err error
		value, err = fn(ctx)
		return err
	}, func() ([]byte, error) { return encodeValue(value, c.config.MaxValueBytes) })
	res.Value = value
	res.LeaseLost = call.lost
	return res, fnErr
}

// call is one validated request.
type call struct {
	namespace, key string
	ttl, lease     time.Duration
	waitTimeout    time.Duration
	policy         InFlightPolicy
	fingerprint    []byte
	reserveFirst   bool
	// lost is set when the finishing write found the reservation taken over.
	lost bool
}

func (c *Coordinator) newCall(namespace, key string, ttl time.Duration, opts *DoOpts) (*call, error) {
	if opts == nil {
		opts = &DoOpts{}
	}
	if err := c.validateKey(namespace, key); err != nil {
		return nil, err
	}
	cl := &call{
		namespace:    namespace,
		key:          key,
		ttl:          ttl,
		lease:        cmp.Or(opts.Lease, c.config.Lease),
		waitTimeout:  cmp.Or(opts.WaitTimeout, c.config.WaitTimeout),
		policy:       cmp.Or(opts.InFlight, c.config.InFlight),
		fingerprint:  opts.Fingerprint,
		reserveFirst: opts.ReserveFirst,
	}
	if ttl < c.config.MinTTL || cl.lease < LeaseMin || cl.lease >= ttl {
		return nil, &InvalidTTLError{TTL: ttl, MinTTL: c.config.MinTTL, Lease: cl.lease}
	}
	if opts.WaitTimeout < 0 {
		return nil, invalidArgument("DoOpts.WaitTimeout %s must not be negative", opts.WaitTimeout)
	}
	if cl.policy != InFlightWait && cl.policy != InFlightRaise {
		return nil, invalidArgument("DoOpts.InFlight %d is not a known policy", cl.policy)
	}
	return cl, nil
}

// acquisition is the outcome of acquire: either this caller holds the reservation (held),
// or row is a completed or failed record to replay.
type acquisition struct {
	held     bool
	row      row
	waited   bool
	tookOver bool
	answered bool // the store answered a read: failing open is no longer allowed
}

// maxSnapshotRetries is how many times the reserve statement is re-run at once after
// finding a row committed after its snapshot (resolved by the next statement in practice)
// before pausing for a poll interval.
const maxSnapshotRetries = 10

// acquire reserves the key, takes over an available record, or waits/raises for an
// in-progress one (the reservation protocol of the package docs). It writes only when it
// inserts or takes over; reading an existing record never writes.
func (c *Coordinator) acquire(ctx context.Context, cl *call) (acquisition, error) {
	var acq acquisition
	w := c.newWaiter(cl, time.Time{}, false)
	snapshotRetries := 0
	readAgain := func() error { // before a retry the statement's snapshot made necessary
		if snapshotRetries++; snapshotRetries%maxSnapshotRetries == 0 {
			return sleepCtx(ctx, jitter(c.config.PollIntervalMin))
		}
		return nil
	}
	rounds := 0
	for {
		if err := ctx.Err(); err != nil {
			return acq, err
		}
		// A plain indexed read first: replays and in-progress checks, the paths that must
		// stay cheap, cost one read and never write. Under ReserveFirst the first round
		// goes straight to the reserving insert, which reads an existing row itself.
		var r row
		err := pgx.ErrNoRows
		if !cl.reserveFirst || rounds > 0 {
			// Bounded like the reserving write: a pool with no connection to spare (its
			// holders waiting on each other) fails the call instead of blocking it for
			// as long as ctx allows, which may be for ever.
			pctx, cancel := context.WithTimeout(ctx, c.config.FinishTimeout)
			var conn *pgxpool.Conn
			if conn, err = c.poolConn(pctx); err == nil {
				err = conn.QueryRow(pctx, c.sql.probe, cl.namespace, cl.key).Scan(r.probeTargets()...)
				conn.Release()
			}
			cancel()
			// The store answered. From here on a failure is not "unreachable": the
			// reserving insert may be blocked behind another transaction's uncommitted
			// record for the key (an open DoTx), and failing open would run fn beside it.
			if err == nil || errors.Is(err, pgx.ErrNoRows) {
				acq.answered = true
			}
			if isSerializationFailure(err) { // chosen as a victim under SERIALIZABLE
				acq.answered = true
				if err := readAgain(); err != nil {
					return acq, err
				}
				continue
			}
		}
		rounds++
		detached := false      // err is the reserving write's, not the read's
		var held *pgxpool.Conn // the connection a reservation was made on, if still held
		if errors.Is(err, pgx.ErrNoRows) {
			var refused bool
			r, held, refused, err = c.reserveWrite(ctx, c.sql.reserve, cl)
			detached = true
			if err == nil || refused || !isConnectError(err) {
				// The statement reached the store: it may have reserved the key or found
				// (or waited for) another caller's record. Never fail open after this.
				acq.answered = true
			}
			if errors.Is(err, pgx.ErrNoRows) || isSerializationFailure(err) {
				// The conflicting row committed after the statement's snapshot (or was
				// deleted in between; under a stricter default isolation the server says
				// so with a serialization failure): run it again, pausing if the key
				// churns.
				if err := readAgain(); err != nil {
					return acq, err
				}
				continue
			}
		}
		if ctxErr := callerEnded(err); ctxErr != nil {
			return acq, ctxErr
		}
		if err != nil {
			errCtx := ctx
			if detached {
				// The reserving write ran on a context of its own (FinishTimeout): its
				// deadline passing is the store's doing, whatever the caller's ctx did.
				errCtx = context.WithoutCancel(ctx)
			}
			return acq, c.logStoreError(errCtx, cl, storeError("reserve", err))
		}
		if r.inserted {
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

		if r.available() {
			t, held, _, err := c.reserveWrite(ctx, c.sql.takeover, cl)
			if errors.Is(err, pgx.ErrNoRows) || isSerializationFailure(err) {
				continue // another caller took it over first (or it was deleted): read again
			}
			if ctxErr := callerEnded(err); ctxErr != nil {
				return acq, ctxErr
			}
			if err != nil { // the takeover ran on a context of its own, as the insert did
				return acq, c.logStoreError(context.WithoutCancel(ctx), cl, storeError("takeover", err))
			}
			if t.recovered { // the takeover's reply was lost: it counted an attempt, or not
				t.tookOver = t.attempts == r.attempts+1
			}
			ok, err := c.keepReservation(ctx, held, cl, &t)
			if err == nil && !ok {
				continue // taken over again before fn started: read again
			}
			if err != nil {
				return acq, err
			}
			acq.held, acq.row = true, t
			if t.tookOver {
				acq.tookOver = true
				c.config.Logger.WarnContext(ctx, "pgidem: took over expired lease; the effect may run more than once",
					slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.Int("attempts", t.attempts))
				c.emit(ctx, EventTakenOver, cl.namespace, 1)
			}
			return acq, nil
		}

		if r.status != StatusInProgress {
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

// checkFingerprint returns a [*FingerprintMismatchError] (logged and reported) when r's
// stored fingerprint contradicts the call's.
func (c *Coordinator) checkFingerprint(ctx context.Context, cl *call, r *row) error {
	if !mismatch(cl.fingerprint, r) {
		return nil
	}
	c.config.Logger.WarnContext(ctx, "pgidem: fingerprint mismatch",
		slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("status", string(r.status)))
	c.emit(ctx, EventFingerprintMismatch, cl.namespace, 1)
	return &FingerprintMismatchError{Namespace: cl.namespace, Key: cl.key, Status: r.status}
}

// waiter applies the in-flight policy to a record in progress under a live lease, for Do
// and DoTx alike.
type waiter struct {
	c        *Coordinator
	cl       *call
	start    time.Time // when the wait budget started; zero: at the first wait
	backoff  time.Duration
	waited   bool
	maxSleep time.Duration // a bound on each sleep; 0: none
}

func (c *Coordinator) newWaiter(cl *call, start time.Time, waited bool) *waiter {
	return &waiter{c: c, cl: cl, start: start, backoff: c.config.PollIntervalMin, waited: waited}
}

// inProgress returns the error to give up with — an [*InProgressError] under
// [InFlightRaise] or once the wait budget is spent, or ctx's error — or nil after sleeping
// (jittered backoff, woken when the lease would expire or the budget ends), when the caller
// should read the record again. It never writes.
func (w *waiter) inProgress(ctx context.Context, r *row) error {
	c, cl := w.c, w.cl
	retryAfter := max(r.leaseExpires.Time.Sub(r.dbNow), time.Millisecond)
	inProgress := &InProgressError{Namespace: cl.namespace, Key: cl.key, RetryAfter: retryAfter,
		Attempts: r.attempts, LeaseExpiresAt: r.leaseExpires.Time, Waited: w.waited}
	if cl.policy == InFlightRaise {
		c.emit(ctx, EventInProgress, cl.namespace, 1)
		return inProgress
	}
	if !w.waited {
		w.waited, inProgress.Waited = true, true
		c.emit(ctx, EventWaited, cl.namespace, 1)
	}
	if w.start.IsZero() {
		w.start = time.Now()
	}
	remaining := cl.waitTimeout - time.Since(w.start)
	if remaining <= 0 {
		c.emit(ctx, EventInProgress, cl.namespace, 1)
		return inProgress
	}
	sleep := min(jitter(w.backoff), c.config.PollIntervalMax, retryAfter+time.Millisecond, remaining)
	if w.maxSleep > 0 {
		sleep = min(sleep, w.maxSleep)
	}
	w.backoff = min(w.backoff*2, c.config.PollIntervalMax)
	return sleepCtx(ctx, sleep)
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
func (c *Coordinator) reserveWrite(ctx context.Context, sql string, cl *call) (r row, held *pgxpool.Conn, refused bool, err error) {
	owner := newOwner()
	unknown := false // an earlier attempt with owner may have committed
	// Any reservation this call makes is granted by a statement sent after this moment.
	defer func(sent time.Time) { r.leaseFrom = sent }(time.Now())
	if sql == c.sql.reserve && c.config.MaxBatch > 1 {
		r, err := c.reserves.do(ctx, reserveReq{ctx: ctx, cl: cl, owner: owner})
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
		return row{}, nil, refused, err
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
		if unknown && err == nil && !r.inserted && ownedBy(&r, owner) {
			// The first write committed after the read above (it was still running on the
			// server, behind a lock): the insert finds its own row.
			r.inserted, r.recovered = true, true
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

// detachedConn acquires a pool connection for a write that must finish once sent: the
// write runs on wctx, detached from ctx and bounded by FinishTimeout (counted from this
// call), until cancel. Waiting for a free connection sends nothing, so unless mustFinish
// that wait also ends with ctx: err is then a *notHeldError holding ctx's error. A wait
// that outlasts FinishTimeout, or a connection that cannot be made, returns a
// *notHeldError holding the pool's error, or with mustFinish (an earlier write may have
// reserved) the pool's error itself. The caller releases conn.
func (c *Coordinator) detachedConn(ctx context.Context, mustFinish bool) (wctx context.Context, cancel context.CancelFunc, conn *pgxpool.Conn, err error) {
	wctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	actx := wctx
	if !mustFinish {
		deadline, _ := wctx.Deadline()
		var cancelWait context.CancelFunc
		actx, cancelWait = context.WithDeadline(ctx, deadline)
		defer cancelWait()
	}
	conn, err = c.poolConn(actx)
	switch {
	case err == nil:
		return wctx, cancel, conn, nil
	case mustFinish:
		// An earlier write may have committed: this call may hold a reservation.
		cancel()
		return nil, nil, nil, err
	case ctx.Err() != nil:
		cancel()
		return nil, nil, nil, &notHeldError{err: ctx.Err(), callerEnded: true}
	}
	cancel()
	return nil, nil, nil, &notHeldError{err: err}
}

// poolConn acquires a connection of the pool. When ctx's deadline passes first, the error
// says that no connection became free, since the usual cause is the application's (calls
// holding connections while they call pgidem), not the server's.
func (c *Coordinator) poolConn(ctx context.Context) (*pgxpool.Conn, error) {
	conn, err := c.pool.Acquire(ctx)
	// (A pool with connections to spare also times out while a new one is being dialled to
	// a server that does not answer: that is the server's doing.)
	if st := c.pool.Stat(); err != nil && errors.Is(err, context.DeadlineExceeded) && st.AcquiredConns() >= st.MaxConns() {
		err = fmt.Errorf("%w (waiting for a connection: none of the pool's %d became free in time; size the pool "+
			"above the calls that hold a connection while they call pgidem, such as InboxHandle or DoTx "+
			"transactions calling Do)", err, st.MaxConns())
	}
	return conn, err
}

// keepReservation readies a reservation just made (r) for fn, on held, the connection it
// was made on (nil: any of the pool's), which it then gives back: it releases the
// reservation when ctx ended meanwhile, returning ctx's error, and renews a lease that
// may be short (freshLease). ok is false when the reservation is no longer cl's (the
// caller reads the key again) or err is set.
func (c *Coordinator) keepReservation(ctx context.Context, held *pgxpool.Conn, cl *call, r *row) (ok bool, err error) {
	q := &heldConn{pool: c.pool, conn: held}
	defer q.release()
	if err := c.releaseIfCancelled(ctx, q, cl, r.owner); err != nil {
		return false, err
	}
	if ok, err := c.freshLease(ctx, q, cl, r); err != nil || !ok {
		return false, err
	}
	// ctx may have ended while the lease was renewed.
	if err := c.releaseIfCancelled(ctx, q, cl, r.owner); err != nil {
		return false, err
	}
	return true, nil
}

// heldConn is a pool connection a call keeps for its next statements (nil conn: none),
// and the pool. Once a statement failed on the connection, it is given back and the pool
// serves the rest: the connection may be broken, and with every other connection in use
// a retry on the pool would wait for this one.
type heldConn struct {
	pool *pgxpool.Pool
	conn *pgxpool.Conn
}

// q returns where the next statement runs.
func (h *heldConn) q() executor {
	if h.conn != nil {
		return h.conn
	}
	return h.pool
}

// release gives the connection back, if still held; statements then run on the pool.
func (h *heldConn) release() {
	if h.conn != nil {
		h.conn.Release()
		h.conn = nil
	}
}

// freshLease renews a lease just granted to cl (r) before fn starts, when a third of it
// or more went by since the granting statement was sent: a statement that waited (behind
// another transaction's uncommitted record for the key, or through a lost-reply recovery)
// grants a lease counted from its start on the server, which can be over already, and
// another caller could then take the key over while fn starts. It returns false when the
// reservation is no longer cl's (the caller reads the key again), and a store error when
// the renewal failed — after releasing the reservation, so no caller waits a lease for it.
func (c *Coordinator) freshLease(ctx context.Context, q *heldConn, cl *call, r *row) (bool, error) {
	if time.Since(r.leaseFrom) < cl.lease/3 {
		return true, nil
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	sent := time.Now()
	tag, err := q.q().Exec(wctx, c.sql.heartbeat, cl.namespace, cl.key, r.owner, micros(cl.lease), micros(cl.ttl))
	switch {
	case tag.RowsAffected() == 0 && err == nil, isSerializationFailure(err):
		// Taken over meanwhile (under a stricter default isolation the server says so
		// with a serialization failure): read the key again.
		return false, nil
	case err != nil:
		q.release() // it may be what failed
		_ = c.finishOn(ctx, q, cl, r.owner, "release", c.sql.release)
		if ctxErr := ctx.Err(); ctxErr != nil {
			return false, ctxErr
		}
		return false, c.logStoreError(ctx, cl, storeError("heartbeat", err))
	}
	r.leaseFrom = sent
	return true, nil
}

// ownedBy reports whether r is in progress under owner with its lease running: a
// reservation this call made. One whose lease already ran out is not claimed (another
// caller may be taking it over); the caller takes it over like any expired lease.
func ownedBy(r *row, owner pgtype.UUID) bool {
	return r.status == StatusInProgress && r.owner == owner && !r.leaseExpired && !r.released
}

// replyLost reports whether a reserving write failed with err after it may have
// committed: not pgx.ErrNoRows (an answer: nothing reserved) and not an error that proves
// nothing was applied.
func replyLost(err error) bool {
	return err != nil && !errors.Is(err, pgx.ErrNoRows) && mayHaveApplied(err)
}

// ownReservation reads cl's record and reports whether it is in progress under owner: a
// reserving write of this call committed although its reply was lost. The row comes back
// as the write would have returned it (inserted; for a takeover, acquire decides
// tookOver from its own read).
func (c *Coordinator) ownReservation(ctx context.Context, q executor, cl *call, owner pgtype.UUID) (row, bool, error) {
	var r row
	err := q.QueryRow(ctx, c.sql.lookup, cl.namespace, cl.key).Scan(r.scanTargets(false)...)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return row{}, false, nil
	case err != nil:
		return row{}, false, err
	case !ownedBy(&r, owner):
		return row{}, false, nil
	}
	r.inserted, r.recovered = true, true
	return r, true, nil
}

// reserveOne runs a single-key reserving statement with owner as the token.
func (c *Coordinator) reserveOne(ctx context.Context, q executor, sql string, cl *call, owner pgtype.UUID) (row, error) {
	var r row
	targets := r.scanTargets(true)
	if sql == c.sql.takeover {
		targets = append(targets, &r.tookOver)
	}
	err := q.QueryRow(ctx, sql, cl.namespace, cl.key, owner, cl.fingerprint,
		micros(cl.lease), micros(cl.ttl)).Scan(targets...)
	return r, err
}

// releaseIfCancelled gives back a reservation just made when the caller's context ended
// while it was being made, and returns the context's error; otherwise nil.
func (c *Coordinator) releaseIfCancelled(ctx context.Context, q *heldConn, cl *call, owner pgtype.UUID) error {
	if ctx.Err() == nil {
		return nil
	}
	_ = c.finishOn(ctx, q, cl, owner, "release", c.sql.release)
	return ctx.Err()
}

// sleepCtx sleeps for d or until ctx ends, returning ctx's error in that case.
func sleepCtx(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// jitter spreads d over [0.5d, 1.5d) so waiters do not poll in lockstep.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + time.Duration(rand.Int64N(int64(d)))
}

// mismatch reports whether a stored fingerprint contradicts the caller's. An expired record
// counts as absent, so its fingerprint does not bind.
func mismatch(fingerprint []byte, r *row) bool {
	return fingerprint != nil && r.fingerprint != nil && !r.expired && !bytes.Equal(fingerprint, r.fingerprint)
}

func (c *Coordinator) logStoreError(ctx context.Context, cl *call, err error) error {
	return c.reportStoreError(ctx, cl.namespace, err, slog.String("namespace", cl.namespace), slog.String("key", cl.key))
}

// reportStoreError logs err at error with attrs and reports [EventStoreError] under
// namespace when err is a store error; it returns err. ctx is the context the failed
// statement ran on (context.WithoutCancel of the caller's for statements bounded by a
// timeout of their own). A store error once ctx has ended (the caller's deadline, e.g.
// River's JobTimeout, or a cancellation) is the caller's doing, not the store's: it is
// returned as an error matching ctx's error (not ErrStoreUnavailable), neither logged nor
// counted.
func (c *Coordinator) reportStoreError(ctx context.Context, namespace string, err error, attrs ...slog.Attr) error {
	var se *StoreError
	if ctxErr := ctx.Err(); ctxErr != nil && errors.As(err, &se) {
		if errors.Is(se.Err, ctxErr) {
			return se.Err
		}
		// A statement that failed after ctx ended failed because of it (pgx closes a
		// connection whose query was cut off, and the next statement finds it closed).
		return fmt.Errorf("%w (then %s failed: %w)", ctxErr, se.Op, se.Err)
	}
	if errors.Is(err, ErrStoreUnavailable) {
		c.config.Logger.LogAttrs(ctx, slog.LevelError, "pgidem: store error", append(attrs, slog.String("error", err.Error()))...)
		c.emit(ctx, EventStoreError, namespace, 1)
	}
	return err
}

// decodeReplay turns a completed or failed record into the caller's value or error.
func decodeReplay[T any](cl *call, r row, value *T) error {
	if r.status == StatusFailed {
		var f storedFailure
		if err := json.Unmarshal(r.failure, &f); err != nil {
			f.Message = string(r.failure)
		}
		return &StoredFailureError{Namespace: cl.namespace, Key: cl.key, Message: f.Message,
			NotStorable: f.NotStorable, CompletedAt: r.completedAt.Time}
	}
	if err := json.Unmarshal(r.result, value); err != nil {
		return fmt.Errorf("%w: %s/%s: decode stored result into %T: %w", ErrReplayNotDecodable, cl.namespace, cl.key, *value, err)
	}
	return nil
}

// run executes fn under the held reservation with a heartbeat, then finishes the record.
// encode is called after fn succeeded to produce the JSON result.
//
// The finishing write is always attempted, even when the heartbeat gave up on the lease: a
// failed renewal only means the lease may be lost, and only an owner-conditional write that
// matches no row proves it. Completing a record that nobody took over is what keeps the
// effect from running again.
func (c *Coordinator) run(ctx context.Context, cl *call, owner pgtype.UUID, leaseFrom time.Time, fn func(context.Context) error, encode func() ([]byte, error)) error {
	fnCtx, cancel := context.WithCancelCause(withKey(ctx, c.config.Schema, cl.namespace, cl.key, false))
	defer cancel(nil)
	hb := c.startHeartbeat(ctx, cl, owner, leaseFrom, cancel)
	defer hb.stop()

	finished := false
	defer func() {
		if !finished { // fn panicked (or called runtime.Goexit): release, let the panic continue
			hb.stop()
			if c.finish(ctx, cl, owner, "release", c.sql.release) == errFinishNoRow {
				c.leaseLost(ctx, cl) // a store error is logged by finish
			}
		}
	}()
	fnErr := fn(fnCtx)
	finished = true
	// The heartbeat keeps renewing the lease until the finishing write is done: that write
	// may queue behind other calls' rounds, and the lease must not run out meanwhile.
	hb.finishing()

	if fnErr != nil {
		var permanent *PermanentError
		var err error
		isPermanent := errors.As(fnErr, &permanent) // permanent may be a typed nil
		if isPermanent {
			failure, _ := json.Marshal(storedFailure{Message: storableMessage(permanent.Error())})
			err = c.complete(ctx, cl, owner, StatusFailed, nil, failure)
		} else {
			// A release is never queued, so it needs no heartbeat cover; a renewal after it
			// would revive the lease of a kept (taken-over) row.
			hb.stop()
			err = c.finish(ctx, cl, owner, "release", c.sql.release)
		}
		if err == errFinishNoRow {
			c.leaseLost(ctx, cl)
			err = fmt.Errorf("%w: %s/%s was taken over", ErrLeaseLost, cl.namespace, cl.key)
		}
		if err != nil && isPermanent {
			// The caller must not believe the failure will be replayed: a later call takes
			// the key over once the lease ends and runs fn again.
			return &FailureNotStoredError{Err: fnErr, Cause: err}
		}
		return fnErr // a release that failed leaves the lease to end: fn runs again then
	}

	result, panicked, encErr := encodeResult(encode)
	var finishErr error
	if encErr == nil {
		finishErr = c.complete(ctx, cl, owner, StatusCompleted, result, nil)
		var pgErr *pgconn.PgError
		if errors.As(finishErr, &pgErr) && isValueRefused(finishErr) {
			// jsonb refused the value (an unpaired surrogate in a json.RawMessage, a number
			// out of numeric's range, nesting deeper than it parses): as unstorable as a NUL.
			encErr = fmt.Errorf("the database rejected it: %s", pgErr.Message)
		}
	}
	if encErr != nil {
		// The effect happened; never release (that would run it again). Store the failure.
		c.config.Logger.ErrorContext(ctx, "pgidem: result not storable; record completed without it",
			slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("error", encErr.Error()))
		failure, _ := json.Marshal(storedFailure{Message: storableMessage("pgidem: result not storable: " + encErr.Error()), NotStorable: true})
		finishErr = c.complete(ctx, cl, owner, StatusFailed, nil, failure)
	}
	if panicked != nil {
		if finishErr == errFinishNoRow {
			c.leaseLost(ctx, cl)
		}
		panic(panicked) // a MarshalJSON panic is a bug in the caller's type; the record is stored
	}
	switch {
	case finishErr == errFinishNoRow:
		c.leaseLost(ctx, cl)
		return fmt.Errorf("%w: %s/%s was taken over before the result was stored; the effect may have run more than once", ErrLeaseLost, cl.namespace, cl.key)
	case finishErr != nil:
		return finishErr
	case encErr != nil:
		return fmt.Errorf("%w: %v", ErrResultNotStorable, encErr)
	}
	return nil
}

// maxStoredMessageBytes caps the message of a stored failure: a record holds the failure
// to replay it, not a log; jsonb refuses strings over 256 MiB outright.
const maxStoredMessageBytes = 64 << 10

// storableMessage makes an error message storable in jsonb: NUL characters (which jsonb
// refuses) are written as the two characters \0, and a message over
// maxStoredMessageBytes is cut at a character boundary and marked. Invalid UTF-8 becomes
// U+FFFD through encoding/json, which jsonb accepts.
func storableMessage(msg string) string {
	msg = strings.ReplaceAll(msg, "\x00", `\0`)
	if len(msg) <= maxStoredMessageBytes {
		return msg
	}
	const mark = " … (truncated)"
	cut := maxStoredMessageBytes - len(mark)
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + mark
}

// encodeResult runs encode, turning a panic into an error (and returning the panic value so
// the caller can re-raise it once the record is safe).
func encodeResult(encode func() ([]byte, error)) (result []byte, panicked any, err error) {
	defer func() {
		if p := recover(); p != nil {
			result, panicked, err = nil, p, fmt.Errorf("encoding the result panicked: %v", p)
		}
	}()
	result, err = encode()
	return result, nil, err
}

// maxReplayDepth is the deepest nesting of arrays and objects encoding/json decodes; a
// deeper result would be stored and then fail every replay.
const maxReplayDepth = 10000

// encodeValue encodes fn's value for a record, refusing JSON that jsonb cannot store or
// that would not replay as it was: larger than maxBytes, a string with a NUL character,
// nesting deeper than a replay decodes, or an invalid UTF-8 string. encoding/json writes
// invalid UTF-8 as the escape \ufffd (a valid U+FFFD it writes as raw bytes), so a
// result holding that escape is decoded and encoded again: unchanged (a json.RawMessage
// or a MarshalJSON that wrote the escape itself) it is stored; changed, it was invalid.
func encodeValue[T any](value T, maxBytes int) ([]byte, error) {
	b, err := json.Marshal(value)
	if err != nil {
		return nil, err
	}
	replacement, err := checkJSON(b, maxBytes)
	if err != nil {
		return nil, err
	}
	if replacement {
		var back T
		var again []byte
		err := json.Unmarshal(b, &back)
		if err == nil {
			again, err = json.Marshal(back)
		}
		if err != nil || !bytes.Equal(again, b) {
			return nil, errors.New("a string is not valid UTF-8 (or the value holding a \\ufffd escape does not survive a JSON round trip), so it would not replay as it was")
		}
	}
	return b, nil
}

// checkJSON checks JSON as encoding/json writes it (valid, compact) against what a record
// can store and replay (see encodeValue), and reports whether it holds a \ufffd escape.
func checkJSON(b []byte, maxBytes int) (replacement bool, err error) {
	if len(b) > maxBytes {
		return false, fmt.Errorf("it is %d bytes of JSON, more than Config.MaxValueBytes (%d)", len(b), maxBytes)
	}
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			for i++; i < len(b) && b[i] != '"'; i++ {
				if b[i] != '\\' {
					continue
				}
				if i+6 <= len(b) && b[i+1] == 'u' {
					switch strings.ToLower(string(b[i+2 : i+6])) {
					case "0000":
						return false, errors.New("a string contains a NUL character, which jsonb cannot store")
					case "fffd":
						replacement = true
					}
				}
				i++ // skip the escaped character
			}
		case '[', '{':
			if depth++; depth > maxReplayDepth {
				return false, fmt.Errorf("it nests arrays and objects deeper than %d, which a replay cannot decode", maxReplayDepth)
			}
		case ']', '}':
			depth--
		}
	}
	return replacement, nil
}

func (c *Coordinator) leaseLost(ctx context.Context, cl *call) {
	cl.lost = true
	c.config.Logger.ErrorContext(ctx, "pgidem: lease lost; the reservation was taken over and the effect may have run more than once",
		slog.String("namespace", cl.namespace), slog.String("key", cl.key))
	c.emit(ctx, EventLeaseLost, cl.namespace, 1)
}

// complete stores the outcome of cl's held reservation (status completed with result, or
// failed with failure), sharing a statement with concurrent completions (batch.go). Its
// errors are finish's.
func (c *Coordinator) complete(ctx context.Context, cl *call, owner pgtype.UUID, status Status, result, failure []byte) error {
	err := errBatchFallback
	if c.config.MaxBatch > 1 {
		_, err = c.completes.do(ctx, completeReq{cl: cl, owner: owner, status: status, result: result, failure: failure})
	}
	if err == errBatchFallback {
		err = c.finish(ctx, cl, owner, "complete", c.sql.complete, status, jsonText(result), jsonText(failure), micros(cl.ttl))
	}
	return err
}

// errFinishNoRow means the owner-conditional write matched no row: the lease was lost.
var errFinishNoRow = errors.New("pgidem: reservation no longer owned")

// finish runs an owner-conditional write on a context detached from the caller's, retrying
// store errors briefly. It returns errFinishNoRow when the row is no longer ours (except
// for a release retried after an attempt that may have committed: the missing row is that
// attempt's delete) and a *StoreError when the store kept failing (the lease expiry then
// lets a later delivery decide).
func (c *Coordinator) finish(ctx context.Context, cl *call, owner pgtype.UUID, op, sql string, extra ...any) error {
	q := &heldConn{pool: c.pool}
	defer q.release()
	return c.finishOn(ctx, q, cl, owner, op, sql, extra...)
}

// finishOn is finish with its first attempt on q's held connection, if any; a failed
// attempt gives it back, and later ones run on connections acquired from the pool (q
// holds the last one; the caller releases q).
func (c *Coordinator) finishOn(ctx context.Context, q *heldConn, cl *call, owner pgtype.UUID, op, sql string, extra ...any) error {
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
		maybeApplied = maybeApplied || mayHaveApplied(err)
		if isValueRefused(err) {
			// A value the server refuses is refused again, and is the caller's to handle
			// (run stores it as not storable): not a store failure to log.
			return &StoreError{Op: op, Err: err}
		}
		if attempt >= len(finishRetries) || ctx.Err() != nil {
			break
		}
		time.Sleep(finishRetries[attempt])
	}
	// ctx is this write's own (FinishTimeout): its deadline passing is the store's doing.
	return c.logStoreError(context.WithoutCancel(ctx), cl, &StoreError{Op: op, Err: err})
}
