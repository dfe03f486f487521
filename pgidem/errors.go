package pgidem

import (
	"github.com/pgidem/pgidem/internal/protocol"
	"github.com/pgidem/pgidem/internal/store"
)

// Sentinel errors. Test for them with [errors.Is]; the typed errors below carry detail and
// match their sentinel.
var (
	// ErrInvalidKey means the namespace or idempotency key cannot be stored: empty, not
	// valid UTF-8, containing NUL or another control character, or longer than the
	// configured limit in bytes. fn is never run for an invalid key. See [*InvalidKeyError].
	ErrInvalidKey = protocol.ErrInvalidKey

	// ErrInvalidTTL means the record TTL is below [Config.MinTTL], or the lease is below
	// [LeaseMin] or not shorter than the TTL. fn is not run. See [*InvalidTTLError].
	ErrInvalidTTL = protocol.ErrInvalidTTL

	// ErrInProgress means another holder's reservation of the key is in progress with a
	// live lease: returned at once under [InFlightRaise], or when [InFlightWait] gave up
	// after its wait timeout. See [*InProgressError] for the retry-after hint.
	ErrInProgress = protocol.ErrInProgress

	// ErrFingerprintMismatch means the key's record was made with a different fingerprint:
	// the same key was reused for a different payload. fn is not run.
	// See [*FingerprintMismatchError].
	ErrFingerprintMismatch = protocol.ErrFingerprintMismatch

	// ErrLeaseLost means the caller's reservation was taken over by another caller after
	// its lease expired (or the record was forgotten by hand), so its writes were refused.
	// It is the cancellation cause of fn's context when renewals stall until the lease has
	// nearly run out, or find the record no longer owned (the first does not prove a
	// takeover: the write after fn decides, [Result.LeaseLost]). It is returned together
	// with fn's value when the finishing write finds the record taken: the effect may then
	// have run twice.
	ErrLeaseLost = protocol.ErrLeaseLost

	// ErrStoreUnavailable wraps a database error: the store could not be reached or a
	// statement failed. Before fn runs it means fn was not run (unless [Config.FailOpen]).
	// A statement on the caller's context cut off because that context ended (its deadline
	// passed, or it was cancelled) is not a store error. Nor is one failing after it ended
	// (pgx closes the connection of a cut-off query). The call then returns an error
	// matching context.DeadlineExceeded or context.Canceled, unlogged and uncounted. A driver
	// timeout of its own (connect_timeout) under a live context is one, and so is a
	// statement pgidem bounds itself ([Config.FinishTimeout]). See [*StoreError].
	ErrStoreUnavailable = store.ErrUnavailable

	// ErrNotMigrated is matched, besides [ErrStoreUnavailable], by a [*StoreError] whose
	// cause is that pgidem's tables or columns do not exist where the coordinator looks
	// (undefined table 42P01, undefined column 42703, no such schema 3F000). Its
	// migrations have not run on this database and schema ([Config.Schema]), or not all of
	// them. A misconfiguration, not an outage: retrying does not help, and
	// [Config.FailOpen] does not apply to it.
	ErrNotMigrated = store.ErrNotMigrated

	// ErrPermanent marks a failure stored in the record and replayed on later calls: both
	// the error returned by [Permanent] and a replayed stored failure ([*StoredFailureError])
	// match it.
	ErrPermanent = protocol.ErrPermanent

	// ErrResultNotStorable means fn succeeded but its value could not be stored as JSON
	// for the record and replayed as it was. It cannot be encoded (a channel, a function,
	// NaN); it holds a string with a NUL character or invalid UTF-8; it is larger than
	// [Config.MaxValueBytes] or nested deeper than encoding/json decodes (10000 levels). Or
	// Postgres refused the JSON: jsonb rejects an unpaired surrogate, a number beyond
	// numeric's range. The record is completed without a result, so the effect is not
	// repeated; replays return this error. In [DoTx] fn's writes are rolled back instead
	// and nothing is recorded.
	ErrResultNotStorable = protocol.ErrResultNotStorable

	// ErrReplayNotDecodable means a completed record's stored result does not decode into
	// the caller's type T (encoding/json's error is wrapped too): the result type changed
	// between deploys, or two call sites share a key with different types. The effect ran
	// and fn is not run again (Result.Replayed is true). Read the stored JSON with
	// [Coordinator.Lookup] (Record.Result), or move the new type to a new namespace.
	ErrReplayNotDecodable = protocol.ErrReplayNotDecodable

	// ErrParked means the key's record is parked: holders that died took it over until
	// its attempts reached the cap ([Config.MaxAttempts], [DoOpts.MaxAttempts]), so fn
	// is not run again until an operator forgets the record ([Coordinator.Forget]) or it
	// expires. See [*ParkedError].
	ErrParked = protocol.ErrParked

	// ErrNotFound is returned by [Coordinator.Lookup], [Coordinator.LookupTx] and
	// [Coordinator.Forget] when no record row exists for the key.
	ErrNotFound = protocol.ErrNotFound

	// ErrInvalidArgument means a setting or argument other than the key and the TTL is
	// invalid. fn is not run. The error's message names the field (or, for a held key, the
	// key). It covers:
	//   - a [Config] field out of range ([NewCoordinator]).
	//   - a nil coordinator (given to [Do], [DoTx] or [DoInTx]; a method called on a nil
	//     *Coordinator panics), pool, transaction or fn. That includes
	//     [Coordinator.InboxHandle]'s fn and [Coordinator.InboxRecordTx]'s transaction.
	//   - a [DoOpts] field other than Lease (an [*InvalidTTLError]), or a [SweepOpts] field
	//     out of range.
	//   - a read-only or already aborted transaction given to [DoTx], which must write the
	//     record; an aborted or already ended one given to [Coordinator.InboxRecordTx].
	//   - a call for a key (an inbox message, for [Coordinator.InboxHandle]) from within
	//     the fn of a call that holds it.
	ErrInvalidArgument = protocol.ErrInvalidArgument
)

// ErrInvalidPayload means [InboxOpts.Payload] cannot be stored in the inbox's jsonb
// column: it is not JSON, it is JSON that jsonb rejects, or it is larger than
// [Config.MaxValueBytes] (see InboxOpts.Payload). It is
// returned wrapped with the reason, before any statement runs; the message is not recorded.
var ErrInvalidPayload = protocol.ErrInvalidPayload

// InvalidKeyError describes why a namespace or key was rejected. It matches [ErrInvalidKey].
type InvalidKeyError = protocol.InvalidKeyError

// InvalidTTLError describes a rejected TTL. It matches [ErrInvalidTTL].
type InvalidTTLError = protocol.InvalidTTLError

// InProgressError reports a reservation held by another caller. It matches [ErrInProgress].
type InProgressError = protocol.InProgressError

// FingerprintMismatchError reports a key reused with a different fingerprint. It matches
// [ErrFingerprintMismatch].
type FingerprintMismatchError = protocol.FingerprintMismatchError

// StoreError wraps a database error. It matches [ErrStoreUnavailable] (and [ErrNotMigrated]
// when pgidem's tables are missing) and unwraps to the driver's error, so a
// *pgconn.PgError can be inspected with [errors.As].
type StoreError = store.Error

// PermanentError marks fn's error as permanent: it is stored in the record and replayed to
// every later call for the key until the record expires. Create it with [Permanent]. It
// matches [ErrPermanent] and unwraps to the original error.
type PermanentError = protocol.PermanentError

// FailureNotStoredError is returned by [Do], [DoResult], [DoTx], [DoTxResult], [DoInTx]
// and [DoInTxResult] when fn returned a [Permanent] error that could not be stored.
// Nothing will be replayed, and a later call runs fn again (Do: once the lease ends; DoTx:
// at once). It is always the call's top-level error, never wrapped. So a type assertion
// (err.(*FailureNotStoredError)) tells pgidem's verdict apart from one fn's own error may
// carry from a nested call. errors.Is and errors.As reach both Err and Cause.
type FailureNotStoredError = protocol.FailureNotStoredError

// ParkedError reports a record parked at the attempts cap ([Config.MaxAttempts]): [Do],
// [DoTx], [DoInTx] (and their Result forms) and [Await] return it, whether the call parked
// the record or found it parked, and fn does not run. It carries the record's Namespace,
// Key and Attempts, and matches [ErrParked].
type ParkedError = protocol.ParkedError

// StoredFailureError is a permanent failure replayed from the record. It matches
// [ErrPermanent] (and [ErrResultNotStorable] when that is what was stored).
type StoredFailureError = protocol.StoredFailureError

// Permanent marks err as a permanent failure of the effect: the record stores err's message
// and later calls for the key return a [*StoredFailureError] instead of running fn again.
// Use it for failures that retrying cannot fix (card declined, address invalid). Returns
// nil for a nil err.
func Permanent(err error) error { return protocol.Permanent(err) }

// invalidArgument returns an error matching [ErrInvalidArgument] with the message
// "pgidem: " + fmt.Sprintf(format, args...).
func invalidArgument(format string, args ...any) error {
	return protocol.InvalidArgument(format, args...)
}
