package protocol

import (
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// Sentinel errors. Test for them with [errors.Is]; the typed errors below carry detail and
// match their sentinel.
var (
	// ErrInvalidKey means the namespace or idempotency key cannot be stored: empty, not
	// valid UTF-8, containing NUL or another control character, or longer than the
	// configured limit in bytes. fn is never run for an invalid key. See [*InvalidKeyError].
	ErrInvalidKey = errors.New("pgidem: invalid idempotency key")

	// ErrInvalidTTL means the record TTL is below [Config.MinTTL], or the lease is below
	// [LeaseMin] or not shorter than the TTL. fn is not run. See [*InvalidTTLError].
	ErrInvalidTTL = errors.New("pgidem: invalid ttl")

	// ErrInProgress means another holder's reservation of the key is in progress with a
	// live lease: returned at once under [InFlightRaise], or when [InFlightWait] gave up
	// after its wait timeout. See [*InProgressError] for the retry-after hint.
	ErrInProgress = errors.New("pgidem: idempotency key in progress")

	// ErrFingerprintMismatch means the key's record was made with a different fingerprint:
	// the same key was reused for a different payload. fn is not run.
	// See [*FingerprintMismatchError].
	ErrFingerprintMismatch = errors.New("pgidem: fingerprint mismatch")

	// ErrLeaseLost means the caller's reservation was taken over by another caller after
	// its lease expired (or the record was forgotten by hand), so its writes were refused.
	// It is the cancellation cause of fn's context when renewals stall until the lease has
	// nearly run out, or find the record no longer owned (the first does not prove a
	// takeover: the write after fn decides, [Result.LeaseLost]). It is returned together
	// with fn's value when the finishing write finds the record taken: the effect may then
	// have run twice.
	ErrLeaseLost = errors.New("pgidem: lease lost")

	// ErrPermanent marks a failure stored in the record and replayed on later calls: both
	// the error returned by [Permanent] and a replayed stored failure ([*StoredFailureError])
	// match it.
	ErrPermanent = errors.New("pgidem: permanent failure")

	// ErrResultNotStorable means fn succeeded but its value could not be stored as JSON
	// for the record and replayed as it was. It cannot be encoded (a channel, a function,
	// NaN); it holds a string with a NUL character or invalid UTF-8; it is larger than
	// [Config.MaxValueBytes] or nested deeper than encoding/json decodes (10000 levels). Or
	// Postgres refused the JSON: jsonb rejects an unpaired surrogate, a number beyond
	// numeric's range. The record is completed without a result, so the effect is not
	// repeated; replays return this error. In [DoTx] fn's writes are rolled back instead
	// and nothing is recorded.
	ErrResultNotStorable = errors.New("pgidem: result not storable")

	// ErrReplayNotDecodable means a completed record's stored result does not decode into
	// the caller's type T (encoding/json's error is wrapped too): the result type changed
	// between deploys, or two call sites share a key with different types. The effect ran
	// and fn is not run again (Result.Replayed is true). Read the stored JSON with
	// [Engine.Lookup] (Record.Result), or move the new type to a new namespace.
	ErrReplayNotDecodable = errors.New("pgidem: stored result does not decode into the caller's type")

	// ErrNotFound is returned by [Engine.Lookup], [Engine.LookupTx] and
	// [Engine.Forget] when no record row exists for the key.
	ErrNotFound = errors.New("pgidem: record not found")

	// ErrInvalidArgument means a setting or argument other than the key and the TTL is
	// invalid. fn is not run. The error's message names the field (or, for a held key, the
	// key). It covers:
	//   - a [Config] field out of range ([NewCoordinator]).
	//   - a nil coordinator (given to [Do], [DoTx] or [DoInTx]; a method called on a nil
	//     *Engine panics), pool, transaction or fn. That includes [Engine.InboxHandle]'s fn
	//     and [Engine.InboxRecordTx]'s transaction.
	//   - a [DoOpts] field other than Lease (an [*InvalidTTLError]), or a [SweepOpts] field
	//     out of range.
	//   - a read-only or already aborted transaction given to [DoTx], which must write the
	//     record; an aborted or already ended one given to [Engine.InboxRecordTx].
	//   - a call for a key (an inbox message, for [Engine.InboxHandle]) from within the fn
	//     of a call that holds it.
	ErrInvalidArgument = errors.New("pgidem: invalid argument")
)

// argumentError is an error matching [ErrInvalidArgument] whose message names the field.
type argumentError struct{ msg string }

func (e *argumentError) Error() string { return e.msg }

func (e *argumentError) Is(target error) bool { return target == ErrInvalidArgument }

// InvalidArgument returns an error matching [ErrInvalidArgument] with the message
// "pgidem: " + fmt.Sprintf(format, args...).
func InvalidArgument(format string, args ...any) error {
	return &argumentError{msg: "pgidem: " + fmt.Sprintf(format, args...)}
}

// InvalidKeyError describes why a namespace or key was rejected. It matches [ErrInvalidKey].
type InvalidKeyError struct {
	// Field is "namespace" or "key" (or "consumer" / "message_id" for the inbox).
	Field string
	// Reason says what is wrong, e.g. "contains control character U+0000 at byte 5".
	Reason string
}

// Error returns the message, prefixed "pgidem: ".
func (e *InvalidKeyError) Error() string {
	return fmt.Sprintf("pgidem: invalid idempotency key: %s %s", e.Field, e.Reason)
}

// Is reports whether target is [ErrInvalidKey].
func (e *InvalidKeyError) Is(target error) bool { return target == ErrInvalidKey }

// InvalidTTLError describes a rejected TTL. It matches [ErrInvalidTTL].
type InvalidTTLError struct {
	// TTL is the record TTL the caller asked for; for an inbox call, the retention
	// ([InboxOpts.Retention]).
	TTL time.Duration
	// MinTTL is the configured minimum ([Config.MinTTL]).
	MinTTL time.Duration
	// Lease is the lease that applied to the call; it must be shorter than TTL. For an
	// inbox call, where no lease applies, it is the coordinator's [Config.Lease].
	Lease time.Duration
}

// Error returns the message, prefixed "pgidem: ".
func (e *InvalidTTLError) Error() string {
	if e.TTL < e.MinTTL {
		return fmt.Sprintf("pgidem: invalid ttl: %s is below the minimum %s (Config.MinTTL)", e.TTL, e.MinTTL)
	}
	if e.Lease < LeaseMin {
		return fmt.Sprintf("pgidem: invalid ttl: lease %s is below the minimum %s (LeaseMin)", e.Lease, LeaseMin)
	}
	return fmt.Sprintf("pgidem: invalid ttl: %s must be longer than the lease %s", e.TTL, e.Lease)
}

// Is reports whether target is [ErrInvalidTTL].
func (e *InvalidTTLError) Is(target error) bool { return target == ErrInvalidTTL }

// InProgressError reports a reservation held by another caller. It matches [ErrInProgress].
type InProgressError struct {
	// Namespace and Key identify the record.
	Namespace, Key string
	// RetryAfter is how long until the holder's lease expires, by the database clock, at
	// the moment the record was read: the earliest time a retry could take over if the
	// holder died. At least one millisecond. A live holder renews its lease, so the retry
	// may find it still in progress.
	RetryAfter time.Duration
	// Attempts is the record's attempt count (1 unless a takeover happened); 0 when the
	// key was held by another transaction's advisory lock ([DoTx]), which shows no record.
	Attempts int
	// LeaseExpiresAt is the holder's lease expiry when the record was read; the zero time
	// when the key was held by another transaction's advisory lock ([DoTx]).
	LeaseExpiresAt time.Time
	// Waited is true when the caller waited ([InFlightWait]) before giving up.
	Waited bool
}

// Error returns the message, prefixed "pgidem: ".
func (e *InProgressError) Error() string {
	return fmt.Sprintf("pgidem: idempotency key in progress: %s/%s (retry after %s)", e.Namespace, e.Key, e.RetryAfter.Round(time.Millisecond))
}

// Is reports whether target is [ErrInProgress].
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// FingerprintMismatchError reports a key reused with a different fingerprint. It matches
// [ErrFingerprintMismatch].
type FingerprintMismatchError struct {
	// Namespace and Key identify the record.
	Namespace, Key string
	// store.Status is the stored record's status.
	Status store.Status
}

// Error returns the message, prefixed "pgidem: ".
func (e *FingerprintMismatchError) Error() string {
	return fmt.Sprintf("pgidem: fingerprint mismatch: %s/%s was reserved for a different payload (record %s)", e.Namespace, e.Key, e.Status)
}

// Is reports whether target is [ErrFingerprintMismatch].
func (e *FingerprintMismatchError) Is(target error) bool { return target == ErrFingerprintMismatch }

// abortedByFn returns the error for a fn that returned nil although one of its statements
// in the transaction pgidem gave it had failed. The server then aborts the transaction, so
// pgidem's next statement is refused (in_failed_sql_transaction, 25P02) or the commit
// rolls back (pgx.ErrTxCommitRollback). The mistake is fn's, not the store's: it is not a
// *store.Error, and it is neither logged nor counted. nil when err is not such a refusal.
func abortedByFn(op string, err error) error {
	if !errors.Is(err, pgx.ErrTxCommitRollback) && !store.IsInFailedTransaction(err) {
		return nil
	}
	return fmt.Errorf("pgidem: %s: fn returned nil after one of its statements failed, which aborted the transaction: "+
		"nothing of fn's was committed (fn must return that statement's error): %w", op, err)
}

// commitRefused returns the error for a failed commit of a transaction pgidem began and gave
// fn (InboxHandle, DoInTx) when the failure is fn's doing rather than the store's:
//   - fn returned nil after one of its statements failed ([abortedByFn]).
//   - fn ended the transaction itself (pgx.ErrTxClosed; it matches [ErrInvalidArgument]).
//   - the server refused the commit for a deferred constraint fn's writes broke (class
//     23), which it would refuse again on every delivery.
//
// None is a *store.Error: each is neither logged nor counted, and a caller that retries
// store errors does not loop on it. nil otherwise.
func commitRefused(op string, err error) error {
	if abortErr := abortedByFn(op, err); abortErr != nil {
		return abortErr
	}
	if errors.Is(err, pgx.ErrTxClosed) {
		return InvalidArgument("%s: fn ended the transaction it was given (Commit or Rollback), which it must not: "+
			"fn's writes and the record were committed or rolled back with it, whichever fn called", op)
	}
	if store.IsIntegrityViolation(err) {
		return fmt.Errorf("pgidem: %s: the commit was refused for a deferred constraint that fn's writes broke; "+
			"nothing was committed: %w", op, err)
	}
	return nil
}

// unusableTx returns the error for a caller's transaction that cannot take pgidem's
// statement, judged from the error of that statement: one an earlier failed statement
// aborted (25P02) or one already committed or rolled back (pgx.ErrTxClosed). Each matches
// [ErrInvalidArgument]. nil for any other error, a read-only transaction's included: a
// server that refuses writes (a hot standby after a failover) says so the same way, and
// that is the store's state, not the caller's mistake.
func unusableTx(op string, err error) error {
	switch {
	case errors.Is(err, pgx.ErrTxClosed):
		return InvalidArgument("%s: the transaction was already committed or rolled back", op)
	case store.IsInFailedTransaction(err):
		return InvalidArgument("%s: the transaction was already aborted by a statement that failed before it; roll it back", op)
	}
	return nil
}

// notHeldError is the outcome of a reserving write that leaves the call holding nothing
// although it may have run: it never got a pool connection (nothing was sent, err is the
// pool's error or, when callerEnded, the caller's context error), or, callerEnded, its
// caller's context ended while it ran and the reservation it made was released on the
// same connection. Nothing of it is left applied (SafeToRetry).
type notHeldError struct {
	err         error
	callerEnded bool
}

func (e *notHeldError) Error() string { return e.err.Error() }

func (e *notHeldError) Unwrap() error { return e.err }

func (e *notHeldError) SafeToRetry() bool { return true }

// callerEnded returns the caller's context error when err is a reserving write that its
// caller's context ended (holding nothing), else nil.
func callerEnded(err error) error {
	if err == nil {
		return nil
	}
	if nh := (*notHeldError)(nil); errors.As(err, &nh) && nh.callerEnded {
		return nh.err
	}
	return nil
}

// PermanentError marks fn's error as permanent: it is stored in the record and replayed to
// every later call for the key until the record expires. Create it with [Permanent]. It
// matches [ErrPermanent] and unwraps to the original error.
type PermanentError struct {
	// Err is the error fn returned.
	Err error
}

// Permanent marks err as a permanent failure of the effect: the record stores err's message
// and later calls for the key return a [*StoredFailureError] instead of running fn again.
// Use it for failures that retrying cannot fix (card declined, address invalid). Returns
// nil for a nil err.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// Error returns the original error's message; for a PermanentError made without one (a
// literal, or a nil *PermanentError), "pgidem: permanent failure".
func (e *PermanentError) Error() string {
	if e == nil || e.Err == nil {
		return ErrPermanent.Error()
	}
	return e.Err.Error()
}

// Unwrap returns the original error.
func (e *PermanentError) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.Err
}

// Is reports whether target is [ErrPermanent].
func (e *PermanentError) Is(target error) bool { return target == ErrPermanent }

// FailureNotStoredError is returned by [Do], [DoResult], [DoTx], [DoTxResult], [DoInTx]
// and [DoInTxResult] when fn returned a [Permanent] error that could not be stored.
// Nothing will be replayed, and a later call runs fn again (Do: once the lease ends; DoTx:
// at once). It is always the call's top-level error, never wrapped. So a type assertion
// (err.(*FailureNotStoredError)) tells pgidem's verdict apart from one fn's own error may
// carry from a nested call. errors.Is and errors.As reach both Err and Cause.
type FailureNotStoredError struct {
	// Err is fn's error, unchanged (it matches [ErrPermanent]).
	Err error
	// Cause says why it was not stored: an error matching [ErrLeaseLost] (Do's
	// reservation was taken over; the record is the new holder's), a [*StoreError], or,
	// for DoTx (whose writes run on the caller's context), the context's error.
	Cause error
}

// Error returns fn's message followed by the cause.
func (e *FailureNotStoredError) Error() string {
	return fmt.Sprintf("%v (the failure was not stored: %v)", e.Err, e.Cause)
}

// Unwrap returns fn's error and the cause.
func (e *FailureNotStoredError) Unwrap() []error { return []error{e.Err, e.Cause} }

// StoredFailureError is a permanent failure replayed from the record. It matches
// [ErrPermanent] (and [ErrResultNotStorable] when that is what was stored).
type StoredFailureError struct {
	// Namespace and Key identify the record.
	Namespace, Key string
	// Message is the message of the error given to [Permanent], as stored. It is without
	// whatever fn wrapped around it, which the first call's error still shows. A NUL
	// character is written as the two characters \0 (jsonb cannot hold one). A message
	// over 64 KiB is cut at a character boundary and ends in " … (truncated)".
	Message string
	// NotStorable is true when the stored failure is an unencodable result rather than an
	// error from fn.
	NotStorable bool
	// CompletedAt is when the failure was stored.
	CompletedAt time.Time
}

// Error returns the original error's message.
func (e *StoredFailureError) Error() string {
	return e.Message
}

// Is reports whether target is [ErrPermanent], or [ErrResultNotStorable] for a stored
// unencodable result.
func (e *StoredFailureError) Is(target error) bool {
	return target == ErrPermanent || (e.NotStorable && target == ErrResultNotStorable)
}

// ErrInvalidPayload means [InboxOpts.Payload] cannot be stored in the inbox's jsonb
// column: it is not JSON, it is JSON that jsonb rejects, or it is larger than
// [Config.MaxValueBytes] (see InboxOpts.Payload). It is
// returned wrapped with the reason, before any statement runs; the message is not recorded.
var ErrInvalidPayload = errors.New("pgidem: invalid inbox payload")
