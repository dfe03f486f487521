package store

import "strings"

// RoundLockTimeout bounds how long a shared round waits for a lock before it gives up and
// its members run one by one.
const RoundLockTimeout = "50ms"

// recordStatements holds the statements on pgidem_record with the table name quoted in.
type recordStatements struct {
	// Reserve, Takeover, Heartbeat, Complete and Release are the reservation protocol's
	// writes for one key, Park the one that ends a dead holder's record at the attempts
	// cap; Probe is the read that starts a call, Lookup the full read.
	Reserve, Takeover, Heartbeat, Complete, Release, Park, Lookup, Probe, Forget string

	// ProbeMany is Probe for many keys, as a round of reads sends it.
	ProbeMany string

	// The forms of Reserve and Complete that shared rounds send: for one key and for
	// many (arrays), all under roundGuard.
	ReserveRound, CompleteRound, ReserveMany, CompleteMany string
}

// Columns every protocol statement returns, in scanRow's order. db_now is the database
// clock at the statement, used for retry-after hints.
//
// The verdicts use statement_timestamp(), not now(): the two agree in a statement of its
// own, but inside a caller's transaction (LookupTx, DoTx) now() is frozen at the
// transaction's start, so a lease or TTL that ran out since would still look alive.
var rowColumns = rowColumnsWith("result", "error")

// rowColumnsWith is rowColumns with result and failure read by the given expressions: a
// listing reads them apart ([Statements.ListRecords]).
func rowColumnsWith(result, failure string) string {
	return `status, owner, attempts, fingerprint, ` + result + `, ` + failure + `, lease_expires_at,
	expires_at, created_at, updated_at, completed_at,
	expires_at <= statement_timestamp() AS expired,
	(status = 'in_progress' AND lease_expires_at <= statement_timestamp()) AS lease_expired,
	statement_timestamp() AS db_now, ` + releasedColumn
}

// releasedCondition is true for an in-progress row its holder gave up (see the release
// statement): its lease was ended in the same statement that set updated_at, which no
// other write does (they all set the lease a whole lease ahead, or clear it). alias
// qualifies the columns ("r." in a statement that names the table r).
func releasedCondition(alias string) string {
	return alias + `status = 'in_progress' AND ` + alias + `lease_expires_at = ` + alias + `updated_at`
}

// releasedColumn is the released verdict, the last column of rowColumns.
var releasedColumn = `(` + releasedCondition("") + `) AS released`

// roundGuard, joined into the statements of shared rounds, bounds their lock waits by
// a lock_timeout local to the statement's own transaction (set_config with is_local; an
// autocommit statement is its own transaction, so the setting ends with it). A round that
// would wait longer fails with lock_not_available and its calls run alone.
const roundGuard = `(SELECT set_config('lock_timeout', '` + RoundLockTimeout + `', true)) AS guard`

// probeColumns are the columns of the probe statement, in ProbeTargets' order: what a
// replay needs, and whether the row is finished (a completed, failed or parked record
// within its TTL). Any other row is read again in full (Lookup): the lease and the
// verdicts are only needed there, and leaving them out keeps a replay's read as cheap as
// a hand-written one.
const probeColumns = `status, attempts, fingerprint, result, error, completed_at,
	status <> 'in_progress' AND expires_at > statement_timestamp() AS finished`

func newRecordStatements(schema string) recordStatements {
	t := Qualify(schema, "pgidem_record")
	channel := Channel(schema)
	r := strings.NewReplacer("{t}", t, "{cols}", rowColumns, "{guard}", roundGuard, "{released}", releasedCondition(""),
		"{notify}", notifyWaiters(channel, ""), "{notify r}", notifyWaiters(channel, "r."))
	// reserve and complete come in two forms: as is, and (for shared rounds) under
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
	// a lost lease; a record taken over carries another owner and matches nothing. The
	// key's waiters, if any, are notified (notify_sql.go) when it commits.
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
	AND (status = 'in_progress' OR status = $4)
RETURNING {notify} AS notified`)
	return recordStatements{
		Reserve: plain.Replace(reserve),

		// reserve for many keys: $1..$6 are arrays, one element per call. Each input row
		// comes back once, by ordinal: inserted (the owner token is the call's), or the
		// existing row. A key given twice is inserted for the first and, since a statement
		// does not see its own inserts, returns nothing for the second — like a row
		// committed after the snapshot, which the caller reads again. Rows are inserted in
		// key order, so concurrent batches take their locks in the same order.
		ReserveMany: r.Replace(`
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
		// $7 is the call's attempts cap (0: none): a row its dead holder left at the cap
		// (not released, within its TTL) is not taken over but parked (Park); the caller
		// reads it again. The guard is checked on the newest row version too, so a record
		// that reached the cap after the caller's read is never taken over past it.
		//
		// took_over (the last column, after {cols}) says whether the statement counted a
		// takeover: the row was neither expired nor released. It is read from the row the
		// statement locked and updated (the CTE locks the newest version first), not from
		// the caller's earlier read, which another caller may have overtaken.
		Takeover: r.Replace(`
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
	AND ($7::int = 0 OR attempts < $7 OR expires_at <= now() OR {released})
RETURNING true AS inserted, {cols}, NOT old.was_expired AND NOT old.was_released AS took_over`),

		// Park a record whose holder died at the attempts cap instead of taking it over:
		// owner-conditional on the dead holder's token ($3), and only while the row is
		// still in progress under a lease that ran out, within its TTL, not released (a
		// holder that returned an error is retried, not parked) and at $4 attempts or more.
		// The lease ends, the failure says why, and expires_at stays: the parked record
		// expires a TTL after its last holder's last heartbeat, like any other.
		Park: r.Replace(`
UPDATE {t} SET
	status = 'parked',
	lease_expires_at = NULL,
	error = jsonb_build_object('message', 'pgidem: record parked after ' || attempts ||
		' attempts (the cap is ' || $4::int || '): its holders stopped renewing their leases; forget it to run the effect again'),
	completed_at = now(),
	updated_at = now()
WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'
	AND lease_expires_at <= now() AND expires_at > now() AND NOT ({released})
	AND $4::int > 0 AND attempts >= $4::int
RETURNING {cols}`),

		// Renew the lease, and keep the record's expiry a whole TTL beyond it: a holder that
		// dies is then always taken over (attempts + 1) before its record can count as
		// expired, however long it ran, and the record only expires (for sweeps and new
		// callers alike) a TTL after the last sign of life.
		// A released row is never renewed: a renewal that was already on the wire when its
		// holder released the row may reach the server after the release.
		Heartbeat: r.Replace(`
UPDATE {t} SET
	lease_expires_at = now() + $4 * interval '1 microsecond',
	expires_at = greatest(expires_at, now() + ($4::bigint + $5::bigint) * interval '1 microsecond'),
	updated_at = now()
WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress' AND NOT ({released})`),

		Complete: plain.Replace(complete),

		ReserveRound:  guarded.Replace(reserve),
		CompleteRound: guarded.Replace(complete),

		// complete for many keys: $1..$7 are arrays, one element per call; results and
		// failures arrive as JSON text. Returns the owner token of each row it completed,
		// and whether its waiters were notified.
		CompleteMany: r.Replace(`
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
RETURNING r.owner, {notify r} AS notified`),

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
		// this owner's. Its waiters, if any, are notified: they may take the key now.
		Release: r.Replace(`
WITH deleted AS (
	DELETE FROM {t}
	WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress' AND attempts = 1
	RETURNING {notify}
), kept AS (
	UPDATE {t} SET -- a row already released (a repeat) is left as it is
		lease_expires_at = CASE WHEN {released} THEN lease_expires_at ELSE now() END,
		updated_at = CASE WHEN {released} THEN updated_at ELSE now() END
	WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress' AND attempts > 1
	RETURNING {notify}
)
SELECT 1 FROM deleted UNION ALL SELECT 1 FROM kept`),

		Lookup: r.Replace(`SELECT {cols} FROM {t} WHERE namespace = $1 AND key = $2`),

		// Delete one record by hand (Coordinator.Forget): unless $3 (force), not one in
		// progress under a live lease and within its TTL. The DELETE re-checks its
		// condition on the newest row version (READ COMMITTED), so a holder renewing or
		// taking over at the same moment is never deleted without force. When nothing is
		// deleted the row as the statement saw it comes back instead, to say why.
		Forget: r.Replace(`
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

		// The read that starts a call: only what a replay needs, since a replay is this
		// one read, alone or as its share of ProbeMany (probeColumns).
		Probe: r.Replace(`SELECT ` + probeColumns + ` FROM {t} WHERE namespace = $1 AND key = $2`),

		// Probe for many keys: $1 and $2 are arrays, one element per call, and $3 and $4
		// are 1 and their length. A row comes back, by ordinal, for each key that has a
		// record; none for one that has not. The statement stays prepared, and Postgres
		// may settle on a generic plan made for no particular arrays. The range on the
		// ordinal, always true, makes that plan count on one element (the default
		// selectivity of a range), so it looks each key up in the primary key from the
		// same table size on as the single-key read does (a few pages), rather than
		// hashing a scan of the table until the table outgrows a hundred arrays' worth.
		// (Planning each execution, as the completing round does, would cost a read round
		// more than it saves.)
		ProbeMany: r.Replace(`SELECT i.ord, ` + probeColumns + `
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS i(namespace, key, ord)
JOIN {t} r ON r.namespace = i.namespace AND r.key = i.key
WHERE i.ord >= $3 AND i.ord <= $4`),
	}
}
