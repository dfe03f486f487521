package protocol

// EventKind names an outcome counted through [Hook].
type EventKind string

// Event kinds. A call reports at most one of Executed, Replayed, Parked, InProgress,
// InvalidKey, FingerprintMismatch or StoreError as its outcome; a cancelled caller reports none. It
// also reports Waited, TakenOver, LeaseLost or FailOpen when those happened along the way.
// FailOpen follows the StoreError that caused it; a failed heartbeat or finishing write
// reports a StoreError after Executed. Sweep reports Swept; the inbox reports EventInboxRecorded or
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
	// EventReconciled: the reconcile hook found an earlier holder's effect done; fn did
	// not run.
	EventReconciled EventKind = "reconciled"
	// EventParked: the call parked a record at the attempts cap instead of taking it over
	// (a call that finds a record parked reports EventReplayed).
	EventParked EventKind = "parked"
	// EventStoreError: a database error was returned or logged.
	EventStoreError EventKind = "store_error"
	// EventInvalidKey: the call's input was rejected before fn ran. That is a namespace,
	// key, TTL, DoOpts, an inbox consumer, message id or payload. It is also a read-only
	// transaction given to DoTx, or an aborted, committed or rolled-back one given to DoTx
	// or InboxRecordTx. And it is a call for a key from within the fn of a call that holds
	// it.
	EventInvalidKey EventKind = "invalid_key"
	// EventFingerprintMismatch: the key was reused with a different fingerprint.
	EventFingerprintMismatch EventKind = "fingerprint_mismatch"
	// EventFailOpen: fn ran unprotected because the store was unreachable ([Config.FailOpen]).
	EventFailOpen EventKind = "fail_open"
	// EventSwept: a sweep deleted expired rows; Event.Count says how many.
	EventSwept EventKind = "swept"
)

// Inbox event kinds, reported to [Config.Hook] with the consumer as Event.Namespace.
const (
	// EventInboxRecorded: a message was recorded as new; its handler runs.
	EventInboxRecorded EventKind = "inbox_recorded"
	// EventInboxDuplicate: a message was already recorded; its handler is skipped.
	EventInboxDuplicate EventKind = "inbox_duplicate"
)
