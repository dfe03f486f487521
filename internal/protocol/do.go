package protocol

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"time"

	"github.com/pgidem/pgidem/internal/store"
)

// Opts are a call's optional settings (pgidem.DoOpts documents each).
type Opts struct {
	Fingerprint  []byte
	InFlight     InFlightPolicy
	WaitTimeout  time.Duration
	Lease        time.Duration
	ReserveFirst bool
	Reconcile    Reconciler
	MaxAttempts  int
}

// Report is what a call did: its outcome and what the record showed.
type Report struct {
	Outcome Outcome
	// Row is the record replayed (OutcomeReplayed, OutcomeWaitedReplayed,
	// OutcomeStoredFailure, OutcomeParked).
	Row store.Row
	// Attempts is the record's attempt count after the call; 0 when fn ran unprotected.
	Attempts int
	// Waited, TookOver, FailedOpen and LeaseLost are what happened along the way.
	Waited, TookOver, FailedOpen, LeaseLost bool
	// RetryAfter is the in-progress hint (OutcomeInProgress).
	RetryAfter time.Duration
}

// Replayed reports whether the outcome came from the record without running fn.
func (r *Report) Replayed() bool {
	switch r.Outcome {
	case OutcomeReplayed, OutcomeWaitedReplayed, OutcomeStoredFailure, OutcomeParked:
		return true
	}
	return false
}

// Prepare validates a call of op for (namespace, key) and refuses one made from within the
// fn of a call holding the key. An invalid call is reported ([EventInvalidKey]).
func (c *Engine) Prepare(ctx context.Context, op, namespace, key string, ttl time.Duration, opts *Opts) (*Call, error) {
	cl, err := c.newCall(namespace, key, ttl, opts)
	if err == nil {
		err = checkNotHeld(ctx, op, c.config.Schema, namespace, key, false)
	}
	if err != nil {
		c.emitInvalid(ctx, namespace)
		return nil, err
	}
	return cl, nil
}

// Do runs the protocol for cl: it reserves the key (or replays, waits, takes over), runs
// fn under a heartbeat, and stores what encode returns once fn succeeded. A replayed
// record comes back in the report's Row for the caller to decode.
func (c *Engine) Do(ctx context.Context, cl *Call, fn func(context.Context) error, encode func() ([]byte, error)) (Report, error) {
	var rep Report
	acq, err := c.acquire(ctx, cl)
	rep.Waited, rep.TookOver = acq.waited, acq.tookOver
	if err != nil {
		// Fail open only when no connection to the store could be made, so no reservation
		// can exist. Once the store answered (a live holder, an uncommitted DoTx record),
		// running fn could run it beside another holder. A statement cut off mid-way may
		// have reserved the key. And a server that answered with an error (a missing
		// table, a wrong schema) is a misconfiguration that must not silently turn
		// deduplication off.
		if c.config.FailOpen && store.IsConnectError(err) && !acq.answered && ctx.Err() == nil {
			c.config.Logger.WarnContext(ctx, "pgidem: store unavailable, running effect unprotected (FailOpen)",
				slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("error", err.Error()))
			c.emit(ctx, EventFailOpen, cl.namespace, 1)
			rep.Outcome, rep.FailedOpen = OutcomeFailOpen, true
			return rep, fn(withKey(ctx, c.config.Schema, cl.namespace, cl.key, false))
		}
		rep.failed(err)
		return rep, err
	}
	rep.Attempts = acq.row.Attempts

	if !acq.held {
		if !acq.parked { // a call that parks the record reported EventParked instead
			c.emit(ctx, EventReplayed, cl.namespace, 1)
		}
		rep.Row = acq.row
		rep.Outcome = replayOutcome(&acq.row, acq.waited)
		return rep, nil
	}

	c.emit(ctx, EventExecuted, cl.namespace, 1)
	cl.attempt = acq.row.Attempts
	if cl.reconcile != nil && cl.attempt >= 2 {
		fn = c.reconciling(cl, Takeover{Namespace: cl.namespace, Key: cl.key, Attempt: cl.attempt, LeaseExpiredAt: acq.prevLeaseExpiry}, fn)
	}
	err = c.run(ctx, cl, acq.row.Owner, acq.row.LeaseFrom, fn, encode)
	rep.LeaseLost = cl.lost
	rep.Outcome = ranOutcome(cl, acq.tookOver)
	return rep, err
}

// replayOutcome is the outcome of replaying r.
func replayOutcome(r *store.Row, waited bool) Outcome {
	switch {
	case r.Status == store.StatusFailed:
		return OutcomeStoredFailure
	case r.Status == store.StatusParked:
		return OutcomeParked
	case waited:
		return OutcomeWaitedReplayed
	}
	return OutcomeReplayed
}

// ranOutcome is the outcome of a call whose fn ran under a reservation.
func ranOutcome(cl *Call, tookOver bool) Outcome {
	switch {
	case cl.lost:
		return OutcomeLeaseLost
	case cl.notStored:
		return OutcomeNotStored
	case cl.reconciled:
		return OutcomeReconciled
	case tookOver:
		return OutcomeTakenOver
	}
	return OutcomeExecuted
}

// failed records err as the outcome of a call that ended before fn ran, unless an outcome
// is already set.
func (r *Report) failed(err error) {
	if err == nil || r.Outcome != OutcomeNone {
		return
	}
	r.Outcome = failureOutcome(err)
	var ip *InProgressError
	if errors.As(err, &ip) {
		r.RetryAfter = ip.RetryAfter
	}
}

// failureOutcome is the outcome of a call that ended with err before fn ran.
func failureOutcome(err error) Outcome {
	var ip *InProgressError
	var fm *FingerprintMismatchError
	switch {
	case errors.As(err, &ip):
		return OutcomeInProgress
	case errors.As(err, &fm):
		return OutcomeFingerprintMismatch
	case errors.Is(err, ErrInvalidArgument), errors.Is(err, ErrInvalidKey), errors.Is(err, ErrInvalidTTL):
		return OutcomeInvalid
	case errors.Is(err, store.ErrUnavailable):
		return OutcomeStoreError
	}
	return OutcomeNone
}

// StoredFailure returns the error a failed record r of (namespace, key) replays as.
func StoredFailure(namespace, key string, r *store.Row) error {
	var f store.StoredFailure
	if err := json.Unmarshal(r.Failure, &f); err != nil {
		f.Message = string(r.Failure)
	}
	return &StoredFailureError{Namespace: namespace, Key: key, Message: f.Message,
		NotStorable: f.NotStorable, CompletedAt: r.CompletedAt.Time}
}
