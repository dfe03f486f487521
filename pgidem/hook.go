package pgidem

import (
	"context"
	"log/slog"
	"runtime/debug"
)

// EventKind names an outcome counted through [Hook].
type EventKind string

// Event kinds. A call reports at most one of Executed, Replayed, InProgress, InvalidKey,
// FingerprintMismatch or StoreError as its outcome (a cancelled caller reports none), plus
// Waited, TakenOver, LeaseLost or FailOpen when those happened along the way (FailOpen
// follows the StoreError that caused it; a failed heartbeat or finishing write reports a
// StoreError after Executed). Sweep reports Swept; the inbox reports EventInboxRecorded or
// EventInboxDuplicate. A DoTx that yields to a concurrent Do reservation after running fn
// can report Executed and then the outcome of its retry.
const (
	// EventExecuted: fn ran under a fresh or taken-over reservation.
	EventExecuted EventKind = "executed"
	// EventReplayed: a stored result (or stored failure) was returned without running fn.
	EventReplayed EventKind = "replayed"
	// EventInProgress: the call returned [ErrInProgress].
	EventInProgress EventKind = "in_progress"
	// EventWaited: the call waited for another holder ([InFlightWait]).
	EventWaited EventKind = "waited"
	// EventTakenOver: the call took over an expired lease; the effect may run twice.
	EventTakenOver EventKind = "taken_over"
	// EventLeaseLost: the holder found its reservation taken over.
	EventLeaseLost EventKind = "lease_lost"
	// EventStoreError: a database error was returned or logged.
	EventStoreError EventKind = "store_error"
	// EventInvalidKey: the call's input was rejected before fn ran: namespace, key,
	// TTL, DoOpts, an inbox consumer, message id or payload, a read-only transaction
	// given to DoTx, an aborted, committed or rolled-back transaction given to DoTx or
	// InboxRecordTx, or a call for a key from within the fn of a call that holds it.
	EventInvalidKey EventKind = "invalid_key"
	// EventFingerprintMismatch: the key was reused with a different fingerprint.
	EventFingerprintMismatch EventKind = "fingerprint_mismatch"
	// EventFailOpen: fn ran unprotected because the store was unreachable ([Config.FailOpen]).
	EventFailOpen EventKind = "fail_open"
	// EventSwept: a sweep deleted expired rows; Event.Count says how many.
	EventSwept EventKind = "swept"
)

// Event is one outcome reported to a [Hook].
type Event struct {
	// Kind is what happened.
	Kind EventKind
	// Namespace is the record's namespace; the consumer for inbox events
	// ([EventInboxRecorded], [EventInboxDuplicate]); "" for sweeps (and a sweep's
	// [EventStoreError]), and "" for an [EventInvalidKey] whose namespace (or consumer) is
	// itself what was rejected, so rejected input never becomes a metric attribute: a
	// hook can use Namespace as a label without bounding or sanitising it beyond what
	// [Config.MaxNamespaceBytes] allows.
	Namespace string
	// Count is 1, or the number of rows for [EventSwept].
	Count int64
}

// Hook receives outcome events, typically to increment counters (package pgidemotel,
// github.com/pgidem/pgidem/otel, adds each event to an OpenTelemetry counter). OnEvent is
// called synchronously, mostly on the goroutine of the call the event is about; a failed
// lease renewal's [EventStoreError] comes from that call's heartbeat goroutine, with a
// context detached from the caller's. It is called from many goroutines at once: it must
// be fast and safe for concurrent use. A panic in OnEvent is recovered and logged at error
// ([Config.Logger]); the call the event is about goes on as if the Hook had returned.
type Hook interface {
	OnEvent(ctx context.Context, event Event)
}

// HookFunc adapts a function to [Hook].
type HookFunc func(ctx context.Context, event Event)

// OnEvent calls f(ctx, event).
func (f HookFunc) OnEvent(ctx context.Context, event Event) { f(ctx, event) }

// ReportInvalidKey sends [EventInvalidKey] for namespace to [Config.Hook], as the
// coordinator's own calls do when they refuse a key: for integrations that refuse an
// idempotency key themselves before any call (pgidemhttp answers a malformed
// Idempotency-Key header with 400), so that one counter covers every refused key. A
// namespace that is itself invalid is reported as "". It touches no record, returns
// nothing, and does nothing without a Hook. Safe for concurrent use.
func (c *Coordinator) ReportInvalidKey(ctx context.Context, namespace string) {
	c.emitInvalid(ctx, namespace)
}

// emitInvalid reports [EventInvalidKey] for a call whose namespace (or inbox consumer) is
// namespace: under that namespace when it is valid, else under "".
func (c *Coordinator) emitInvalid(ctx context.Context, namespace string) {
	if validatePart("namespace", namespace, c.config.MaxNamespaceBytes) != nil {
		namespace = ""
	}
	c.emit(ctx, EventInvalidKey, namespace, 1)
}

// emit hands an event to the Hook. A panic in the Hook is logged and goes no further: it
// must not cut the protocol short between two of its steps (a reservation left to its
// lease, a heartbeat goroutine crashing the process).
func (c *Coordinator) emit(ctx context.Context, kind EventKind, namespace string, count int64) {
	if c.config.Hook == nil {
		return
	}
	defer func() {
		if p := recover(); p != nil {
			c.config.Logger.ErrorContext(ctx, "pgidem: Hook.OnEvent panicked; the event is lost, the call goes on",
				slog.String("event", string(kind)), slog.String("namespace", namespace),
				slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
		}
	}()
	c.config.Hook.OnEvent(ctx, Event{Kind: kind, Namespace: namespace, Count: count})
}
