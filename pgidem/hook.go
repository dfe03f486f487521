package pgidem

import (
	"context"

	"github.com/pgidem/pgidem/internal/protocol"
)

// EventKind names an outcome counted through [Hook].
type EventKind = protocol.EventKind

// Event kinds. A call reports at most one of Executed, Replayed, Parked, InProgress,
// InvalidKey, FingerprintMismatch or StoreError as its outcome; a cancelled caller reports none. It
// also reports Waited, TakenOver, LeaseLost or FailOpen when those happened along the way.
// FailOpen follows the StoreError that caused it; a failed heartbeat or finishing write
// reports a StoreError after Executed. Sweep reports Swept; the inbox reports EventInboxRecorded or
// EventInboxDuplicate. A DoTx that yields to a concurrent Do reservation after running fn
// can report Executed and then the outcome of its retry.
const (
	// EventExecuted: fn ran under a fresh or taken-over reservation.
	EventExecuted = protocol.EventExecuted
	// EventReplayed: a stored result (or stored failure) was returned without running fn.
	EventReplayed = protocol.EventReplayed
	// EventInProgress: the call returned [ErrInProgress].
	EventInProgress = protocol.EventInProgress
	// EventWaited: the call waited for another holder ([InFlightWait]).
	EventWaited = protocol.EventWaited
	// EventTakenOver: the call took over an expired lease; the effect may run twice.
	EventTakenOver = protocol.EventTakenOver
	// EventLeaseLost: the holder found its reservation taken over.
	EventLeaseLost = protocol.EventLeaseLost
	// EventReconciled: [DoOpts.Reconcile] found an earlier holder's effect done; fn did
	// not run.
	EventReconciled = protocol.EventReconciled
	// EventParked: the call parked a record at the attempts cap ([Config.MaxAttempts])
	// instead of taking it over; a call that finds a record parked reports
	// [EventReplayed].
	EventParked = protocol.EventParked
	// EventStoreError: a database error was returned or logged.
	EventStoreError = protocol.EventStoreError
	// EventInvalidKey: the call's input was rejected before fn ran. That is a namespace,
	// key, TTL, DoOpts, an inbox consumer, message id or payload. It is also a read-only
	// transaction given to DoTx, or an aborted, committed or rolled-back one given to DoTx
	// or InboxRecordTx. And it is a call for a key from within the fn of a call that holds
	// it.
	EventInvalidKey = protocol.EventInvalidKey
	// EventFingerprintMismatch: the key was reused with a different fingerprint.
	EventFingerprintMismatch = protocol.EventFingerprintMismatch
	// EventFailOpen: fn ran unprotected because the store was unreachable ([Config.FailOpen]).
	EventFailOpen = protocol.EventFailOpen
	// EventSwept: a sweep deleted expired rows; Event.Count says how many.
	EventSwept = protocol.EventSwept
)

// Inbox event kinds, reported to [Config.Hook] with the consumer as Event.Namespace.
const (
	// EventInboxRecorded: a message was recorded as new; its handler runs.
	EventInboxRecorded = protocol.EventInboxRecorded
	// EventInboxDuplicate: a message was already recorded; its handler is skipped.
	EventInboxDuplicate = protocol.EventInboxDuplicate
)

// Event is one outcome reported to a [Hook].
type Event struct {
	// Kind is what happened.
	Kind EventKind
	// Namespace is the record's namespace; the consumer for inbox events
	// ([EventInboxRecorded], [EventInboxDuplicate]); "" for sweeps (and a sweep's
	// [EventStoreError]). It is "" for an [EventInvalidKey] whose namespace (or consumer)
	// is itself what was rejected, so rejected input never becomes a metric attribute. A
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
//
// A Hook that also implements [CallHook] observes each call's start and end (to trace it),
// and one that implements [RoundHook] each shared round.
type Hook interface {
	OnEvent(ctx context.Context, event Event)
}

// HookFunc adapts a function to [Hook].
type HookFunc func(ctx context.Context, event Event)

// OnEvent calls f(ctx, event).
func (f HookFunc) OnEvent(ctx context.Context, event Event) { f(ctx, event) }

// ReportInvalidKey sends [EventInvalidKey] for namespace to [Config.Hook], as the
// coordinator's own calls do when they refuse a key. It is for integrations that refuse an
// idempotency key themselves before any call (pgidemhttp answers a malformed
// Idempotency-Key header with 400), so that one counter covers every refused key. A
// namespace that is itself invalid is reported as "". It touches no record, returns
// nothing, and does nothing without a Hook. Safe for concurrent use.
func (c *Coordinator) ReportInvalidKey(ctx context.Context, namespace string) {
	c.engine.ReportInvalid(ctx, namespace)
}
