package pgidem

import (
	"context"
	"errors"
	"time"

	"github.com/pgidem/pgidem/internal/protocol"
)

// CallHook is implemented by a [Hook] that also observes each call from start to end, to
// trace it (package pgidemotel opens a span per call). [NewCoordinator] checks
// [Config.Hook] for it; a Hook without it sees events only. Its methods are called on the
// call's goroutine, from many goroutines at once: they must be fast and safe for
// concurrent use.
type CallHook interface {
	Hook
	// OnCallStart is called before a call touches the database: for the Do and DoTx forms
	// once the key, TTL and options were checked (a refused call reports only
	// [EventInvalidKey]), for the inbox calls at their start. The context it returns is the call's from then on: its events
	// ([Hook.OnEvent]), shared rounds ([RoundHook]) and fn receive it, or a context
	// derived from it. Return ctx itself to add nothing.
	OnCallStart(ctx context.Context, call CallStart) context.Context
	// OnCallEnd is called once when the call returns, also when fn panics (Err is then
	// [ErrPanicked]), with the context OnCallStart returned.
	OnCallEnd(ctx context.Context, call CallEnd)
}

// RoundHook is implemented by a [Hook] that also observes the shared statements (the
// package doc's "Shared statements"): every round of reserving inserts, of completing
// writes and of first reads, once its statement returned. [NewCoordinator] checks
// [Config.Hook] for it. OnRound is called on the round leader's goroutine with the
// leader's context (detached from its cancellation): fast and safe for concurrent use.
type RoundHook interface {
	Hook
	// OnRound is called once per round, after its statement returned.
	OnRound(ctx context.Context, round Round)
}

// Call operations, as [CallStart.Op] names them.
const (
	// OpDo: [Do] and [DoResult].
	OpDo = "Do"
	// OpDoTx: [DoTx] and [DoTxResult].
	OpDoTx = "DoTx"
	// OpDoInTx: [DoInTx] and [DoInTxResult].
	OpDoInTx = "DoInTx"
	// OpDoSQLTx: [DoSQLTx] and [DoSQLTxResult].
	OpDoSQLTx = "DoSQLTx"
	// OpInboxRecordTx: [Coordinator.InboxRecordTx].
	OpInboxRecordTx = "InboxRecordTx"
	// OpInboxRecordSQLTx: [Coordinator.InboxRecordSQLTx].
	OpInboxRecordSQLTx = "InboxRecordSQLTx"
	// OpInboxHandle: [Coordinator.InboxHandle].
	OpInboxHandle = "InboxHandle"
)

// CallStart describes a call as it starts.
type CallStart struct {
	// Op is the operation: [OpDo] (Do, DoResult), [OpDoTx], [OpDoInTx], [OpDoSQLTx],
	// [OpInboxRecordTx], [OpInboxRecordSQLTx] or [OpInboxHandle].
	Op string
	// Namespace is the record's namespace; the consumer for inbox calls.
	Namespace string
	// Key is the idempotency key; the message id for inbox calls. Keys can carry personal
	// data: record them only where that is allowed.
	Key string
}

// CallEnd describes a call as it returns.
type CallEnd struct {
	// Op and Namespace are the call's, as in [CallStart].
	Op, Namespace string
	// Outcome is the call's [Result.Outcome]. An inbox call reports [OutcomeExecuted] for
	// a new message (InboxHandle: fn ran and committed), [OutcomeReplayed] for a duplicate,
	// and the failure outcomes of the Do calls otherwise.
	Outcome Outcome
	// Attempts, Waited and TookOver are the [Result]'s (zero for inbox calls).
	Attempts         int
	Waited, TookOver bool
	// Wait is the time from the call's start until fn began or, when fn did not run,
	// until the call returned: the reservation, any wait for another holder, a replay.
	Wait time.Duration
	// Fn is how long fn ran (summed when DoTx ran it twice, after yielding to a
	// concurrent Do); 0 when it did not run.
	Fn time.Duration
	// Err is the error the call returns, nil on success.
	Err error
}

// Round describes one shared round.
type Round struct {
	// Kind is "reserve" (reserving inserts), "complete" (completing writes) or "read"
	// (the reads that start calls).
	Kind string
	// Size is the number of calls the round's statement carried (1 to [Config.MaxBatch]).
	Size int
	// Latency is the time from sending the statement to reading its last row.
	Latency time.Duration
	// Err is the statement's error. The calls of a write round, or of a read round of more
	// than one, then fall back to statements of their own; a read alone returns it.
	Err error
}

// ErrPanicked is [CallEnd.Err] for a call whose fn panicked; the panic goes on.
var ErrPanicked = errors.New("pgidem: fn panicked")

// observedCall follows one call for the coordinator's CallHook; nil when there is none, and
// every method of a nil *observedCall does nothing.
type observedCall struct {
	hook           CallHook
	ctx            context.Context
	end            CallEnd
	start, fnStart time.Time
	ended          bool
}

// observe starts observing a call of op; it returns the call's context.
func (c *Coordinator) observe(ctx context.Context, op, namespace, key string) (context.Context, *observedCall) {
	if c.calls == nil {
		return ctx, nil
	}
	o := &observedCall{hook: c.calls, start: time.Now(), end: CallEnd{Op: op, Namespace: namespace}}
	o.ctx = c.calls.OnCallStart(ctx, CallStart{Op: op, Namespace: namespace, Key: key})
	if o.ctx == nil {
		o.ctx = ctx
	}
	return o.ctx, o
}

// fn wraps a call's fn to time it.
func (o *observedCall) fn(fn func(context.Context) error) func(context.Context) error {
	if o == nil {
		return fn
	}
	return func(ctx context.Context) error {
		start := time.Now()
		if o.fnStart.IsZero() {
			o.fnStart = start
		}
		defer func() { o.end.Fn += time.Since(start) }()
		return fn(ctx)
	}
}

// txFn wraps a transactional call's fn to time it.
func (o *observedCall) txFn(fn func(context.Context, any) error) func(context.Context, any) error {
	if o == nil {
		return fn
	}
	return func(ctx context.Context, tx any) error {
		return o.fn(func(ctx context.Context) error { return fn(ctx, tx) })(ctx)
	}
}

// done ends the call with its outcome.
func (o *observedCall) done(outcome Outcome, attempts int, waited, tookOver bool, err error) {
	if o == nil || o.ended {
		return
	}
	o.ended = true
	o.end.Outcome, o.end.Attempts, o.end.Waited, o.end.TookOver, o.end.Err = outcome, attempts, waited, tookOver, err
	if o.fnStart.IsZero() {
		o.end.Wait = time.Since(o.start)
	} else {
		o.end.Wait = o.fnStart.Sub(o.start)
	}
	o.hook.OnCallEnd(o.ctx, o.end)
}

// closePanicked ends a call that did not end normally: fn panicked. Deferred.
func (o *observedCall) closePanicked() {
	if o != nil && !o.ended {
		o.done(OutcomeExecuted, 0, false, false, ErrPanicked)
	}
}

// observedResult ends the call with res and err and returns them.
func observedResult[T any](o *observedCall, res Result[T], err error) (Result[T], error) {
	o.done(res.Outcome, res.Attempts, res.Waited, res.TookOver, err)
	return res, err
}

// inboxDone ends an inbox call: executed when the message was new (or its handler ran),
// replayed for a duplicate, else the failure's outcome.
func (o *observedCall) inboxDone(isNew bool, err error) {
	if o == nil {
		return
	}
	outcome := OutcomeReplayed
	switch {
	case isNew || !o.fnStart.IsZero():
		outcome = OutcomeExecuted
	case err != nil:
		outcome = protocol.FailureOutcome(err)
	}
	o.done(outcome, 0, false, false, err)
}

// roundFunc returns the engine's round observer for hook (nil: none).
func roundFunc(hook RoundHook) func(context.Context, protocol.RoundKind, int, time.Duration, error) {
	if hook == nil {
		return nil
	}
	return func(ctx context.Context, kind protocol.RoundKind, size int, latency time.Duration, err error) {
		hook.OnRound(ctx, Round{Kind: string(kind), Size: size, Latency: latency, Err: err})
	}
}
