package pgidem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/pgidem/pgidem/internal/protocol"
	"github.com/pgidem/pgidem/internal/store"
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

	// ReserveFirst starts this call with the reserving INSERT … ON CONFLICT DO NOTHING,
	// which returns an existing record in the same round trip, whatever [Config.Order]
	// says ([OrderReserveFirst] for one call). Useful where keys are almost always new
	// (queue jobs) and a call should not depend on its namespace's estimate. Default false:
	// the coordinator's order. Either way the protocol and its guarantees are the same.
	// DoTx and DoInTx ignore it (they read under an advisory lock).
	ReserveFirst bool

	// Reconcile, when set, is asked before fn runs again on a key whose effect an earlier
	// holder may have run: when the record shows an earlier attempt (a holder whose lease
	// ran out, [Result.Attempts] ≥ 2). It looks the effect up at its provider (a payment
	// by the same idempotency key, a mail by message id). Found: it answers with the value
	// fn would have returned (a T, or anything that encodes to JSON decoding into T). The
	// value is then stored and returned as if fn had returned it, fn does not run, and
	// the outcome is [OutcomeReconciled]. Not found: fn runs. An error: the record is
	// released and the error returned, so the next delivery decides. It runs with fn's
	// context (the key, the fence, the heartbeat's cancellation). Used by [Do] and
	// [DoResult] only: a transaction's effect is never half done. Default nil: fn runs.
	Reconcile func(ctx context.Context, t Takeover) (value any, found bool, err error)

	// MaxAttempts overrides [Config.MaxAttempts] for this call: a record whose holder died
	// at this many attempts or more is parked instead of taken over ([*ParkedError]).
	// Default 0: the config's. A negative one returns an error matching
	// [ErrInvalidArgument]. Await ignores it.
	MaxAttempts int
}

// Takeover is what [DoOpts.Reconcile] is told about a key an earlier holder may have run
// the effect for.
type Takeover = protocol.Takeover

// engineOpts returns the engine's form of o (nil: defaults).
func (o *DoOpts) engineOpts() *protocol.Opts {
	if o == nil {
		return nil
	}
	return &protocol.Opts{Fingerprint: o.Fingerprint, InFlight: o.InFlight, WaitTimeout: o.WaitTimeout,
		Lease: o.Lease, ReserveFirst: o.ReserveFirst, MaxAttempts: o.MaxAttempts}
}

// Result is what [DoResult] returns: fn's value and how it was obtained.
type Result[T any] struct {
	// Outcome is what the call did; it is set on errors too ([OutcomeNone] when the call
	// ended before the protocol reached one).
	Outcome Outcome
	// RetryAfter is the holder's remaining lease when Outcome is [OutcomeInProgress]: the
	// earliest moment a retry could take over. 0 otherwise.
	RetryAfter time.Duration
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
	// another holder. fn's outcome was not written, and the effect may have run more than
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
// was obtained. The first caller reserves the key and runs fn with a context that carries
// the key ([KeyFromContext]); later calls within ttl replay the stored value or error
// without running fn. The package documentation describes the lease and heartbeat
// ("Concurrency: in progress, lease, heartbeat, takeover") and what each outcome of fn
// stores ("Outcomes of fn"). It also describes what a replay returns ("Replayed values")
// and cancellation ("Store errors, cancellation and the pool").
//
// Errors (fn is not run unless noted):
//   - namespace or key empty, not valid UTF-8, with control characters, or over
//     [Config.MaxNamespaceBytes] / [Config.MaxKeyBytes]: an [*InvalidKeyError].
//   - ttl below [Config.MinTTL] or not longer than the lease, or [DoOpts.Lease] out of
//     range: an [*InvalidTTLError].
//   - a nil c or fn, another [DoOpts] field out of range, or a call for the key from
//     within the fn of a call holding it (it would wait for itself): [ErrInvalidArgument].
//   - the key in progress under a live lease: an [*InProgressError], at once under
//     [InFlightRaise], after the wait timeout under [InFlightWait].
//   - a database error before fn: a [*StoreError] matching [ErrStoreUnavailable], unless
//     [Config.FailOpen]; ctx ending before fn: ctx's error, with no reservation left.
//   - fn's own error, returned unchanged after the record is released; a [Permanent] one
//     is stored first, or a [*FailureNotStoredError] says it was not.
//   - fn ran but its record was taken over: fn's value with an error matching
//     [ErrLeaseLost]; a value JSON cannot store exactly: [ErrResultNotStorable].
//   - a stored value that no longer decodes into T: [ErrReplayNotDecodable].
//   - a dead holder's record at the attempts cap ([Config.MaxAttempts]): it is parked,
//     and this and every later call return a [*ParkedError]; fn does not run.
//
// Defaults: the lease is [Config.Lease] (30 s), renewed every lease/3; the wait timeout is
// [Config.WaitTimeout] (one minute); [DoOpts] overrides both per call. ttl counts from
// completion, or from the last heartbeat while in progress. Safe for concurrent use.
func DoResult[T any](ctx context.Context, c *Coordinator, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context) (T, error)) (Result[T], error) {
	var res Result[T]
	if c == nil || fn == nil {
		return Result[T]{Outcome: OutcomeInvalid}, invalidArgument("Do: the coordinator and fn must not be nil")
	}
	var value T
	eopts := opts.engineOpts()
	if opts != nil && opts.Reconcile != nil {
		eopts.Reconcile = func(ctx context.Context, t Takeover) (bool, error) {
			v, found, err := opts.Reconcile(ctx, t)
			if err != nil || !found {
				return false, err
			}
			return true, assignValue(&value, v)
		}
	}
	cl, err := c.engine.Prepare(ctx, "Do", namespace, key, ttl, eopts)
	if err != nil {
		res.Outcome = OutcomeInvalid
		return res, err
	}
	ctx, o := c.observe(ctx, OpDo, namespace, key)
	defer o.closePanicked()
	rep, err := c.engine.Do(ctx, cl, o.fn(func(ctx context.Context) error {
		var err error
		value, err = fn(ctx)
		return err
	}), func() ([]byte, error) { return encodeValue(value, c.config.MaxValueBytes) })
	res = result(rep, value)
	if rep.Replayed() {
		err = decodeReplay(namespace, key, &rep.Row, &res.Value)
	}
	return observedResult(o, res, err)
}

// result is the Result of a call the engine reported as rep, with fn's value.
func result[T any](rep protocol.Report, value T) Result[T] {
	return Result[T]{Outcome: rep.Outcome, RetryAfter: rep.RetryAfter, Value: value,
		Replayed: rep.Replayed(), Attempts: rep.Attempts, Waited: rep.Waited,
		TookOver: rep.TookOver, FailedOpen: rep.FailedOpen, LeaseLost: rep.LeaseLost}
}

// assignValue sets *value to v: directly when v is a T, else through its JSON encoding.
func assignValue[T any](value *T, v any) error {
	if tv, ok := v.(T); ok {
		*value = tv
		return nil
	}
	b, err := json.Marshal(v)
	if err == nil {
		err = json.Unmarshal(b, value)
	}
	if err != nil {
		return fmt.Errorf("the value found (%T) does not convert to %T: %w", v, *value, err)
	}
	return nil
}

// decodeReplay turns a completed, failed or parked record into the caller's value or
// error.
func decodeReplay[T any](namespace, key string, r *store.Row, value *T) error {
	switch r.Status {
	case store.StatusFailed:
		return protocol.StoredFailure(namespace, key, r)
	case store.StatusParked:
		return protocol.Parked(namespace, key, r)
	}
	if err := json.Unmarshal(r.Result, value); err != nil {
		return fmt.Errorf("%w: %s/%s: decode stored result into %T: %w", ErrReplayNotDecodable, namespace, key, *value, err)
	}
	return nil
}

// encodeValue encodes fn's value for a record. It refuses JSON that jsonb cannot store or
// that would not replay as it was: larger than maxBytes, a string with a NUL character,
// nesting deeper than a replay decodes, or an invalid UTF-8 string. encoding/json writes
// invalid UTF-8 as the escape \ufffd (a valid U+FFFD it writes as raw bytes). So a
// result holding that escape is decoded and encoded again. Unchanged (a json.RawMessage
// or a MarshalJSON that wrote the escape itself), it is stored; changed, it was invalid.
func encodeValue[T any](value T, maxBytes int) ([]byte, error) {
	b, err := json.Marshal(value)
	if err != nil {
		return nil, err
	}
	replacement, err := store.CheckJSON(b, maxBytes)
	if err != nil {
		return nil, fmt.Errorf("it %w", err)
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
