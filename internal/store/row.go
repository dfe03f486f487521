package store

import (
	"crypto/rand"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// Status is a record's state: the status column of pgidem_record.
type Status string

const (
	// StatusInProgress: a holder has reserved the key and its effect is running (or its
	// holder died and the lease will expire).
	StatusInProgress Status = "in_progress"
	// StatusCompleted: the effect succeeded; the record holds its result for replay.
	StatusCompleted Status = "completed"
	// StatusFailed: the effect failed permanently; the failure is replayed.
	StatusFailed Status = "failed"
	// StatusParked: holders of the record kept dying until its attempts reached the cap
	// (pgidem.Config.MaxAttempts); it is not taken over again, and calls get an error
	// until an operator forgets it or it expires.
	StatusParked Status = "parked"
)

// Record is one row of pgidem_record as callers see it.
type Record struct {
	// Namespace and Key identify the record.
	Namespace, Key string
	// Status is in progress, completed, failed or parked.
	Status Status
	// Attempts is how many times the effect was started under this key: 1 normally; more
	// means a takeover happened and the effect may have run more than once.
	Attempts int
	// Fingerprint is the stored payload fingerprint, nil when none was given.
	Fingerprint []byte
	// Result is the stored JSON result of a completed record (JSON null for a nil value);
	// nil for other statuses.
	Result json.RawMessage
	// Error is the stored JSON failure of a failed or parked record, nil otherwise: an
	// object with "message" (the permanent error's text, cut to 64 KiB, or why the record
	// was parked) and, when the failure stands for a value that could not be stored,
	// "not_storable": true.
	Error json.RawMessage
	// LeaseExpiresAt is the holder's lease expiry for an in-progress record, zero otherwise.
	LeaseExpiresAt time.Time
	// ExpiresAt is when the record stops counting (its TTL); after it the key behaves as if
	// it had never been used, whether or not a sweep has deleted the row.
	ExpiresAt time.Time
	// CreatedAt, UpdatedAt and CompletedAt are the row's times (CompletedAt zero while in
	// progress).
	CreatedAt, UpdatedAt, CompletedAt time.Time
	// Expired reports whether ExpiresAt had passed by the database clock when the row was
	// read.
	Expired bool
}

// StoredFailure is the JSON shape of pgidem_record.error.
type StoredFailure struct {
	Message     string `json:"message"`
	NotStorable bool   `json:"not_storable,omitempty"`
}

// Row is a record as read by a protocol statement, with the verdicts the statement took by
// the database clock.
type Row struct {
	Inserted     bool
	Status       Status
	Owner        pgtype.UUID
	Attempts     int
	Fingerprint  []byte
	Result       []byte
	Failure      []byte
	LeaseExpires pgtype.Timestamptz
	ExpiresAt    time.Time
	CreatedAt    time.Time
	UpdatedAt    time.Time
	CompletedAt  pgtype.Timestamptz
	Expired      bool
	LeaseExpired bool
	DBNow        time.Time
	Released     bool // given up by its holder (releasedCondition); taking it over is no takeover
	TookOver     bool // the takeover statement and DoTx's upsert only: they took over a holder that died
	Recovered    bool // read back after the reserving write's reply was lost
	// LeaseFrom is set on a reservation this call holds: a client time no later than the
	// start of the statement that granted the lease, so the lease ends no earlier than
	// LeaseFrom + lease, in real time, whatever the clocks say.
	LeaseFrom time.Time
}

// ScanTargets are the scan targets of rowColumns, with the leading inserted column when
// withInserted.
func (r *Row) ScanTargets(withInserted bool) []any {
	targets := []any{&r.Status, &r.Owner, &r.Attempts, &r.Fingerprint, &r.Result, &r.Failure,
		&r.LeaseExpires, &r.ExpiresAt, &r.CreatedAt, &r.UpdatedAt, &r.CompletedAt, &r.Expired,
		&r.LeaseExpired, &r.DBNow, &r.Released}
	if withInserted {
		return append([]any{&r.Inserted}, targets...)
	}
	return targets
}

// ProbeTargets are the scan targets of the Probe statement. It sets finished when the row
// is a finished record within its TTL; otherwise only Status, Attempts and Fingerprint
// are read, and the row must be read in full (Lookup, ScanTargets) before deciding.
func (r *Row) ProbeTargets(finished *bool) []any {
	return []any{&r.Status, &r.Attempts, &r.Fingerprint, &r.Result, &r.Failure, &r.CompletedAt, finished}
}

// Available reports whether the row counts as absent: expired, or in progress with an
// expired lease. Such a row is taken over.
func (r *Row) Available() bool { return r.Expired || r.LeaseExpired }

// Finished reports whether the row is a completed record, a stored failure or a parked
// record within its TTL: what a call replays (a parked one as an error).
func (r *Row) Finished() bool { return r.Status != StatusInProgress && !r.Available() }

// Live reports whether the row is in progress under a live lease within its TTL: a holder
// may be running the effect.
func (r *Row) Live() bool { return r.Status == StatusInProgress && !r.LeaseExpired && !r.Expired }

// AtCap reports whether the row is one a takeover must park instead (maxAttempts > 0): in
// progress within its TTL, its holder's lease ran out without a release (the holder
// died), and its attempts reached maxAttempts. A released row is a retry, never parked.
func (r *Row) AtCap(maxAttempts int) bool {
	return maxAttempts > 0 && r.Status == StatusInProgress && r.LeaseExpired && !r.Expired &&
		!r.Released && r.Attempts >= maxAttempts
}

// RetryAfter is how long until a live row's lease ends, at least a millisecond.
func (r *Row) RetryAfter() time.Duration {
	return max(r.LeaseExpires.Time.Sub(r.DBNow), time.Millisecond)
}

// Record returns the row as a [Record] of namespace and key.
func (r *Row) Record(namespace, key string) *Record {
	return &Record{
		Namespace:      namespace,
		Key:            key,
		Status:         r.Status,
		Attempts:       r.Attempts,
		Fingerprint:    r.Fingerprint,
		Result:         r.Result,
		Error:          r.Failure,
		LeaseExpiresAt: r.LeaseExpires.Time,
		ExpiresAt:      r.ExpiresAt,
		CreatedAt:      r.CreatedAt,
		UpdatedAt:      r.UpdatedAt,
		CompletedAt:    r.CompletedAt.Time,
		Expired:        r.Expired,
	}
}

// NewOwner returns a random version 4 UUID, the fencing token of one reservation.
func NewOwner() pgtype.UUID {
	var u pgtype.UUID
	_, _ = rand.Read(u.Bytes[:]) // crypto/rand.Read never fails on supported platforms
	u.Bytes[6] = (u.Bytes[6] & 0x0f) | 0x40
	u.Bytes[8] = (u.Bytes[8] & 0x3f) | 0x80
	u.Valid = true
	return u
}
