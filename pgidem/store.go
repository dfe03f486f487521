package pgidem

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// executor is the smallest interface the store's statements need; a pool, a connection and a
// transaction all satisfy it.
type executor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ executor = (*pgxpool.Pool)(nil)
	_ executor = (*pgx.Conn)(nil)
	_ executor = (pgx.Tx)(nil)
)

// Status is a record's state.
type Status string

const (
	// StatusInProgress: a holder has reserved the key and its effect is running (or its
	// holder died and the lease will expire).
	StatusInProgress Status = "in_progress"
	// StatusCompleted: the effect succeeded; the record holds its result for replay.
	StatusCompleted Status = "completed"
	// StatusFailed: the effect failed permanently ([Permanent]); the failure is replayed.
	StatusFailed Status = "failed"
)

// Record is one row of pgidem_record, as returned by [Coordinator.Lookup].
type Record struct {
	// Namespace and Key identify the record.
	Namespace, Key string
	// Status is in progress, completed or failed.
	Status Status
	// Attempts is how many times the effect was started under this key: 1 normally; more
	// means a takeover happened and the effect may have run more than once.
	Attempts int
	// Fingerprint is the stored payload fingerprint, nil when none was given.
	Fingerprint []byte
	// Result is the stored JSON result of a completed record (JSON null for a nil value);
	// nil for other statuses.
	Result json.RawMessage
	// Error is the stored JSON failure of a failed record, nil otherwise: an object with
	// "message" (the permanent error's text, cut to 64 KiB) and, when the failure stands
	// for a value that could not be stored ([ErrResultNotStorable]), "not_storable": true.
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

// jsonText returns a JSON value as the text parameter its statement casts to jsonb (nil:
// NULL). JSON travels as text because pgx's modes that type a parameter by its Go type
// (QueryExecModeExec, the simple protocol) would send a []byte as bytea, which jsonb
// does not read.
func jsonText(b []byte) *string {
	if b == nil {
		return nil
	}
	s := string(b)
	return &s
}

// storedFailure is the JSON shape of pgidem_record.error.
type storedFailure struct {
	Message     string `json:"message"`
	NotStorable bool   `json:"not_storable,omitempty"`
}

// statements holds the protocol's SQL with the table name already quoted in.
type statements struct {
	reserve, takeover, heartbeat, complete, release, lookup, probe, sweep, forget string

	// The forms of reserve and complete that batch.go's rounds send: for one key and for
	// many (arrays), all under roundGuard.
	reserveRound, completeRound, reserveMany, completeMany string

	dotx  dotxStatements  // DoTx (dotx.go)
	inbox inboxStatements // the inbox (inbox.go)
}

// Columns every protocol statement returns, in scanRow's order. db_now is the database
// clock at the statement, used for retry-after hints.
//
// The verdicts use statement_timestamp(), not now(): the two agree in a statement of its
// own, but inside a caller's transaction (LookupTx, DoTx) now() is frozen at the
// transaction's start, so a lease or TTL that ran out since would still look alive.
var rowColumns = `status, owner, attempts, fingerprint, result, error, lease_expires_at,
	expires_at, created_at, updated_at, completed_at,
	expires_at <= statement_timestamp() AS expired,
	(status = 'in_progress' AND lease_expires_at <= statement_timestamp()) AS lease_expired,
	statement_timestamp() AS db_now, ` + releasedColumn

// releasedCondition is true for an in-progress row its holder gave up (see the release
// statement): its lease was ended in the same statement that set updated_at, which no
// other write does (they all set the lease a whole lease ahead, or clear it). alias
// qualifies the columns ("r." in a statement that names the table r).
func releasedCondition(alias string) string {
	return alias + `status = 'in_progress' AND ` + alias + `lease_expires_at = ` + alias + `updated_at`
}

// releasedColumn is the released verdict, the last column of rowColumns and probeColumns.
var releasedColumn = `(` + releasedCondition("") + `) AS released`

// roundGuard, joined into the statements of batch.go's rounds, bounds their lock waits by
// a lock_timeout local to the statement's own transaction (set_config with is_local; an
// autocommit statement is its own transaction, so the setting ends with it). A round that
// would wait longer fails with lock_not_available and its calls run alone.
const roundGuard = `(SELECT set_config('lock_timeout', '` + batchLockTimeout + `', true)) AS guard`

// probeColumns are the columns of the probe statement, in probeTargets' order.
var probeColumns = `status, attempts, fingerprint, result, error, lease_expires_at, completed_at,
	expires_at <= statement_timestamp() AS expired,
	(status = 'in_progress' AND lease_expires_at <= statement_timestamp()) AS lease_expired,
	statement_timestamp() AS db_now, ` + releasedColumn

func newStatements(schema string) statements {
	t := qualify(schema, "pgidem_record")
	r := strings.NewReplacer("{t}", t, "{cols}", rowColumns, "{guard}", roundGuard, "{released}", releasedCondition(""))
	// reserve and complete come in two forms: as is, and (for batch.go's rounds) under
	// roundGuard, which their single-row source or join evaluates before any row is
	// written or locked.
	plain := strings.NewReplacer("{from}", "")
	guarded := strings.NewReplacer("{from}", "FROM "+roundGuard)
	// Insert a fresh reservation, or read the existing row in the same round trip. ON
	// CONFLICT DO NOTHING takes no lock and assigns no transaction id when the row exists,
	// so replays and in-progress checks stay pure reads. When the conflicting row
	// committed after this statement's snapshot, neither branch returns a row and the
	// caller runs it again. The reservation expires a TTL after its lease, as the
	// heartbeat keeps it: a holder that dies before its first heartbeat is taken over
	// (attempts + 1) before its record can count as expired.
	reserve := r.Replace(`
WITH ins AS (
	INSERT INTO {t} (namespace, key, status, owner, attempts, fingerprint,
		lease_expires_at, expires_at)
	SELECT $1, $2, 'in_progress', $3::uuid, 1, $4::bytea,
		now() + $5 * interval '1 microsecond', now() + ($5::bigint + $6::bigint) * interval '1 microsecond' {from}
	ON CONFLICT (namespace, key) DO NOTHING
	RETURNING true AS inserted, {cols}
)
SELECT * FROM ins
UNION ALL
SELECT false, {cols} FROM {t}
WHERE namespace = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM ins)`)
	// Store the outcome; the TTL counts from completion. The owner token makes it safe to
	// repeat: a write whose reply was lost after it committed (a retry, a fallback after a
	// round timed out) finds its own completed row and succeeds again instead of reporting
	// a lost lease; a record taken over carries another owner and matches nothing.
	complete := r.Replace(`
UPDATE {t} SET
	status = $4,
	result = $5::jsonb,
	error = $6::jsonb,
	lease_expires_at = NULL,
	completed_at = now(),
	expires_at = now() + $7 * interval '1 microsecond',
	updated_at = now() {from}
WHERE namespace = $1 AND key = $2 AND owner = $3
	AND (status = 'in_progress' OR status = $4)`)
	return statements{
		dotx:  newDotxStatements(schema),
		inbox: newInboxStatements(schema),

		reserve: plain.Replace(reserve),

		// reserve for many keys: $1..$6 are arrays, one element per call. Each input row
		// comes back once, by ordinal: inserted (the owner token is the call's), or the
		// existing row. A key given twice is inserted for the first and, since a statement
		// does not see its own inserts, returns nothing for the second — like a row
		// committed after the snapshot, which the caller reads again. Rows are inserted in
		// key order, so concurrent batches take their locks in the same order.
		reserveMany: r.Replace(`
WITH input AS (
	SELECT i.* FROM unnest($1::text[], $2::text[], $3::uuid[], $4::bytea[], $5::bigint[], $6::bigint[])
		WITH ORDINALITY AS i(namespace, key, owner, fingerprint, lease_us, ttl_us, ord), {guard}
), ins AS (
	INSERT INTO {t} (namespace, key, status, owner, attempts, fingerprint,
		lease_expires_at, expires_at)
	SELECT namespace, key, 'in_progress', owner, 1, fingerprint,
		now() + lease_us * interval '1 microsecond', now() + (lease_us + ttl_us) * interval '1 microsecond'
	FROM input ORDER BY namespace, key
	ON CONFLICT (namespace, key) DO NOTHING
	RETURNING true AS inserted, {cols}
)
SELECT i.ord, ins.* FROM input i JOIN ins ON ins.owner = i.owner
UNION ALL
SELECT i.ord, existing.* FROM input i
CROSS JOIN LATERAL (SELECT false AS inserted, {cols} FROM {t}
	WHERE namespace = i.namespace AND key = i.key) existing
WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.owner = i.owner)`),

		// Take over an expired record or an in-progress record whose lease expired. The
		// WHERE clause is re-checked on the newest row version under READ COMMITTED, so of
		// two concurrent takers exactly one updates a row. An expired record starts afresh
		// (attempts 1, new fingerprint); a lease takeover counts an attempt and keeps a
		// stored fingerprint. A released record (its holder gave up after an error) keeps
		// its count: the release counted nothing that may have run the effect.
		//
		// took_over (the last column, after {cols}) says whether the statement counted a
		// takeover: the row was neither expired nor released. It is read from the row the
		// statement locked and updated (the CTE locks the newest version first), not from
		// the caller's earlier read, which another caller may have overtaken.
		takeover: r.Replace(`
WITH old AS (
	SELECT expires_at <= now() AS was_expired, ({released}) AS was_released
	FROM {t} WHERE namespace = $1 AND key = $2
	FOR NO KEY UPDATE -- the mode the UPDATE itself takes
)
UPDATE {t} SET
	owner = $3,
	attempts = CASE WHEN expires_at <= now() THEN 1 WHEN {released} THEN attempts ELSE attempts + 1 END,
	fingerprint = CASE WHEN expires_at <= now() THEN $4 ELSE coalesce(fingerprint, $4) END,
	created_at = CASE WHEN expires_at <= now() THEN now() ELSE created_at END,
	status = 'in_progress',
	result = NULL,
	error = NULL,
	completed_at = NULL,
	lease_expires_at = now() + $5 * interval '1 microsecond',
	expires_at = now() + ($5::bigint + $6::bigint) * interval '1 microsecond',
	updated_at = now()
FROM old
WHERE namespace = $1 AND key = $2
	AND (expires_at <= now() OR (status = 'in_progress' AND lease_expires_at <= now()))
	AND ($4::bytea IS NULL OR fingerprint IS NULL OR fingerprint = $4 OR expires_at <= now())
RETURNING true AS inserted, {cols}, NOT old.was_expired AND NOT old.was_released AS took_over`),

		// Renew the lease, and keep the record's expiry a whole TTL beyond it: a holder that
		// dies is then always taken over (attempts + 1) before its record can count as
		// expired, however long it ran, and the record only expires (for sweeps and new
		// callers alike) a TTL after the last sign of life.
		// A released row is never renewed: a renewal that was already on the wire when its
		// holder released the row may reach the server after the release.
		heartbeat: r.Replace(`
UPDATE {t} SET
	lease_expires_at = now() + $4 * interval '1 microsecond',
	expires_at = greatest(expires_at, now() + ($4::bigint + $5::bigint) * interval '1 microsecond'),
	updated_at = now()
WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress' AND NOT ({released})`),

		complete: plain.Replace(complete),

		reserveRound:  guarded.Replace(reserve),
		completeRound: guarded.Replace(complete),

		// complete for many keys: $1..$7 are arrays, one element per call; results and
		// failures arrive as JSON text. Returns the owner token of each row it completed.
		completeMany: r.Replace(`
UPDATE {t} AS r SET
	status = u.status,
	result = u.result::jsonb,
	error = u.error::jsonb,
	lease_expires_at = NULL,
	completed_at = now(),
	expires_at = now() + u.ttl_us * interval '1 microsecond',
	updated_at = now()
FROM unnest($1::text[], $2::text[], $3::uuid[], $4::text[], $5::text[], $6::text[], $7::bigint[])
	AS u(namespace, key, owner, status, result, error, ttl_us), {guard}
WHERE r.namespace = u.namespace AND r.key = u.key AND r.owner = u.owner
	AND (r.status = 'in_progress' OR r.status = u.status)
RETURNING r.owner`),

		// Give a reservation up (fn failed, panicked, or the caller's context ended). A
		// first reservation (attempts 1) is deleted: the key is as if never used. A taken-
		// over one is kept with its lease ended and its attempts, so the next caller takes
		// it over at once and the record still says the dead holder before this one may
		// have run the effect; deleting the row would erase that. The kept row is marked
		// released (lease_expires_at = updated_at, releasedCondition): taking it over
		// counts no attempt and reports no takeover, as after a deleted first reservation.
		// Safe to repeat (finish retries a lost reply): a kept row matches again and is left
		// as it is. The heartbeat must be stopped first, or a late renewal
		// would revive the kept row's lease. Returns one row when the reservation was still
		// this owner's.
		release: r.Replace(`
WITH deleted AS (
	DELETE FROM {t}
	WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress' AND attempts = 1
	RETURNING 1
), kept AS (
	UPDATE {t} SET -- a row already released (a repeat) is left as it is
		lease_expires_at = CASE WHEN {released} THEN lease_expires_at ELSE now() END,
		updated_at = CASE WHEN {released} THEN updated_at ELSE now() END
	WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress' AND attempts > 1
	RETURNING 1
)
SELECT 1 FROM deleted UNION ALL SELECT 1 FROM kept`),

		lookup: r.Replace(`SELECT {cols} FROM {t} WHERE namespace = $1 AND key = $2`),

		// Delete one record by hand (Coordinator.Forget): unless $3 (force), not one in
		// progress under a live lease and within its TTL. The DELETE re-checks its
		// condition on the newest row version (READ COMMITTED), so a holder renewing or
		// taking over at the same moment is never deleted without force. When nothing is
		// deleted the row as the statement saw it comes back instead, to say why.
		forget: r.Replace(`
WITH target AS (
	SELECT {cols} FROM {t} WHERE namespace = $1 AND key = $2
), deleted AS (
	DELETE FROM {t}
	WHERE namespace = $1 AND key = $2
		AND ($3 OR status <> 'in_progress' OR lease_expires_at <= statement_timestamp()
			OR expires_at <= statement_timestamp())
	RETURNING {cols}
)
SELECT *, true FROM deleted
UNION ALL
SELECT *, false FROM target WHERE NOT EXISTS (SELECT 1 FROM deleted)`),

		// The read that starts every Do: only what deciding and replaying need, since a
		// replay is this one statement.
		probe: r.Replace(`SELECT ` + probeColumns + ` FROM {t} WHERE namespace = $1 AND key = $2`),

		// Delete one batch of expired rows. SKIP LOCKED lets concurrent sweeps split the
		// work instead of queueing; a live holder's row is never expired (the heartbeat
		// keeps expires_at ahead of its lease).
		sweep: r.Replace(`
DELETE FROM {t}
WHERE (namespace, key) IN (
	SELECT namespace, key FROM {t}
	WHERE expires_at <= now()
		AND (status <> 'in_progress' OR lease_expires_at <= now())
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
	}
}

// row is a record as read by a protocol statement.
type row struct {
	inserted     bool
	status       Status
	owner        pgtype.UUID
	attempts     int
	fingerprint  []byte
	result       []byte
	failure      []byte
	leaseExpires pgtype.Timestamptz
	expiresAt    time.Time
	createdAt    time.Time
	updatedAt    time.Time
	completedAt  pgtype.Timestamptz
	expired      bool
	leaseExpired bool
	dbNow        time.Time
	released     bool // given up by its holder (releasedCondition); taking it over is no takeover
	tookOver     bool // the takeover statement and DoTx's upsert only: they took over a holder that died
	recovered    bool // read back after the reserving write's reply was lost (reserveWrite)
	// leaseFrom is set on a reservation this call holds: a client time no later than the
	// start of the statement that granted the lease, so the lease ends no earlier than
	// leaseFrom + lease, in real time, whatever the clocks say.
	leaseFrom time.Time
}

func (r *row) scanTargets(withInserted bool) []any {
	targets := []any{&r.status, &r.owner, &r.attempts, &r.fingerprint, &r.result, &r.failure,
		&r.leaseExpires, &r.expiresAt, &r.createdAt, &r.updatedAt, &r.completedAt, &r.expired,
		&r.leaseExpired, &r.dbNow, &r.released}
	if withInserted {
		return append([]any{&r.inserted}, targets...)
	}
	return targets
}

// probeTargets are the scan targets of the probe statement.
func (r *row) probeTargets() []any {
	return []any{&r.status, &r.attempts, &r.fingerprint, &r.result, &r.failure,
		&r.leaseExpires, &r.completedAt, &r.expired, &r.leaseExpired, &r.dbNow, &r.released}
}

// available reports whether the row counts as absent: expired, or in progress with an
// expired lease. Such a row is taken over.
func (r *row) available() bool { return r.expired || r.leaseExpired }

// finished reports whether the row is a completed record or a stored failure within its
// TTL: what a call replays.
func (r *row) finished() bool { return r.status != StatusInProgress && !r.available() }

func (r *row) record(namespace, key string) *Record {
	return &Record{
		Namespace:      namespace,
		Key:            key,
		Status:         r.status,
		Attempts:       r.attempts,
		Fingerprint:    r.fingerprint,
		Result:         r.result,
		Error:          r.failure,
		LeaseExpiresAt: r.leaseExpires.Time,
		ExpiresAt:      r.expiresAt,
		CreatedAt:      r.createdAt,
		UpdatedAt:      r.updatedAt,
		CompletedAt:    r.completedAt.Time,
		Expired:        r.expired,
	}
}

// newOwner returns a random version 4 UUID, the fencing token of one reservation.
func newOwner() pgtype.UUID {
	var u pgtype.UUID
	_, _ = rand.Read(u.Bytes[:]) // crypto/rand.Read never fails on supported platforms
	u.Bytes[6] = (u.Bytes[6] & 0x0f) | 0x40
	u.Bytes[8] = (u.Bytes[8] & 0x3f) | 0x80
	u.Valid = true
	return u
}

// Lookup reads the record for (namespace, key) without changing it. It returns an
// [*InvalidKeyError] for a key no call could have stored, [ErrNotFound] when there is no
// row, and the row (with Expired set) when it exists but has expired. Database errors are
// returned as [*StoreError]; cancelling ctx returns an error matching ctx's instead. Safe
// for concurrent use.
func (c *Coordinator) Lookup(ctx context.Context, namespace, key string) (*Record, error) {
	return c.lookup(ctx, c.pool, namespace, key)
}

// LookupTx is [Coordinator.Lookup] inside the caller's transaction; like any statement on
// a pgx.Tx, not concurrently with other uses of tx.
func (c *Coordinator) LookupTx(ctx context.Context, tx pgx.Tx, namespace, key string) (*Record, error) {
	return c.lookup(ctx, tx, namespace, key)
}

// ForgetOpts are optional settings for [Coordinator.Forget]. A nil *ForgetOpts means
// defaults.
type ForgetOpts struct {
	// Force deletes a record even while it is in progress under a live lease. Its holder
	// may be running the effect at that moment, and the next call with the key runs it
	// again beside it; the holder's own completion then finds no row ([ErrLeaseLost]).
	// Default false: such a record is refused.
	Force bool
}

// forgetAttempts bounds how often Forget retries a record that changed under it.
const forgetAttempts = 3

// Forget deletes the record for (namespace, key), so that the next call with the key runs
// its effect again: an operator's tool for replaying an effect by hand after an incident
// (the pgidem command's `records forget` does the same with its own statement). It
// returns the record as it was deleted. A record in progress under a live lease (and
// within its TTL) is refused with an [*InProgressError] (matching [ErrInProgress];
// RetryAfter is its remaining lease) unless opts.Force is set: its holder may be running
// the effect right now. The check and the delete are one statement, so a holder renewing
// or taking the record over at the same moment is never deleted without Force; a record
// that such writes keep making live again is refused the same way after three attempts,
// with a RetryAfter of 1 ms and no LeaseExpiresAt. Cancelling ctx returns an error
// matching ctx's, not a store error.
//
// It returns an [*InvalidKeyError] for a key no call could have stored, [ErrNotFound]
// when there is no row, and a [*StoreError] for a database error. Inbox rows are not
// records: delete those with SQL (docs/inspect.md). Safe for concurrent use.
func (c *Coordinator) Forget(ctx context.Context, namespace, key string, opts *ForgetOpts) (*Record, error) {
	if err := c.validateKey(namespace, key); err != nil {
		return nil, err
	}
	force := opts != nil && opts.Force
	for attempt := 1; ; attempt++ {
		var r row
		var deleted bool
		err := c.pool.QueryRow(ctx, c.sql.forget, namespace, key, force).Scan(append(r.scanTargets(false), &deleted)...)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return nil, ErrNotFound
		case isSerializationFailure(err) && attempt < forgetAttempts:
			continue // a pool of REPEATABLE READ sessions: a concurrent write; read it again
		case err != nil:
			return nil, c.reportStoreError(ctx, namespace, storeError("forget", err), slog.String("namespace", namespace), slog.String("key", key))
		case deleted:
			c.config.Logger.InfoContext(ctx, "pgidem: record forgotten; the next call with the key runs its effect again",
				slog.String("namespace", namespace), slog.String("key", key), slog.String("status", string(r.status)),
				slog.Bool("forced", force))
			return r.record(namespace, key), nil
		case r.status == StatusInProgress && !r.leaseExpired && !r.expired:
			return nil, &InProgressError{Namespace: namespace, Key: key, RetryAfter: max(r.leaseExpires.Time.Sub(r.dbNow), time.Millisecond),
				Attempts: r.attempts, LeaseExpiresAt: r.leaseExpires.Time}
		case attempt == forgetAttempts:
			// Each statement saw a deletable row that a concurrent write (a renewal, a
			// takeover) then made live again, or replaced.
			return nil, &InProgressError{Namespace: namespace, Key: key, RetryAfter: time.Millisecond, Attempts: r.attempts}
		}
	}
}

func (c *Coordinator) lookup(ctx context.Context, db executor, namespace, key string) (*Record, error) {
	if err := c.validateKey(namespace, key); err != nil {
		return nil, err
	}
	var r row
	err := db.QueryRow(ctx, c.sql.lookup, namespace, key).Scan(r.scanTargets(false)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, c.reportStoreError(ctx, namespace, storeError("lookup", err), slog.String("namespace", namespace), slog.String("key", key))
	}
	return r.record(namespace, key), nil
}

// storeError wraps a database error as [*StoreError], leaving a cancellation alone so that
// callers can tell it from an unreachable store. A deadline is wrapped: a driver timeout
// (connect_timeout, a hung server) is a store failure; reportStoreError unwraps it again
// when it was the caller's own deadline that passed.
func storeError(op string, err error) error {
	if errors.Is(err, context.Canceled) {
		return err
	}
	return &StoreError{Op: op, Err: err}
}

func micros(d time.Duration) int64 { return d.Microseconds() }
