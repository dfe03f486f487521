package store

import (
	"encoding/binary"
	"hash/fnv"
	"math"
	"strings"
	"time"
)

// LockTimeoutMax is the largest lock_timeout Postgres accepts: INT_MAX milliseconds, about
// 24.8 days. DoTx waits longer in successive waits of at most this long.
const LockTimeoutMax = time.Duration(math.MaxInt32) * time.Millisecond

// Advisory lock statements of DoTx. The lock is transaction-scoped: Postgres releases it at
// the caller's commit or rollback, after the commit has made the record visible.
const (
	// TryLock tries the key's lock, unless the transaction is read-only (it could not
	// write the record): then it reports that instead of locking.
	TryLock = `SELECT current_setting('transaction_read_only') = 'on',
	CASE WHEN current_setting('transaction_read_only') = 'on' THEN false ELSE pg_try_advisory_xact_lock($1) END`
	Lock = `SELECT pg_advisory_xact_lock($1)`
	// The wait for the lock is bounded by lock_timeout alone: the caller's
	// statement_timeout is lifted meanwhile (a shorter one would end the wait as a
	// cancelled statement) and both are put back after it.
	GetLockTimeout = `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`
	// IdleTimeout reads idle_in_transaction_session_timeout in milliseconds.
	IdleTimeout    = `SELECT setting::bigint FROM pg_catalog.pg_settings WHERE name = 'idle_in_transaction_session_timeout'`
	SetLockTimeout = `SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)`
	// DeadlockTimeout reads the session's deadlock_timeout in whole milliseconds.
	DeadlockTimeout = `SELECT (extract(epoch FROM current_setting('deadlock_timeout')::interval) * 1000)::bigint`
)

// txStatements holds DoTx's statements on pgidem_record with the table name quoted in.
type txStatements struct {
	// TxRead reads a record in the caller's transaction; TxUpsert writes the finished
	// record there.
	TxRead, TxUpsert string
}

func newTxStatements(schema string) txStatements {
	t := Qualify(schema, "pgidem_record")
	r := strings.NewReplacer("{t}", t, "{cols}", rowColumns, "{released}", releasedCondition("r."))
	return txStatements{
		TxRead: r.Replace(`SELECT {cols} FROM {t} WHERE namespace = $1 AND key = $2`),

		// Write the completed (or permanently failed) record in the caller's transaction.
		// An existing row is overwritten only when it counts as absent: expired, or in
		// progress under a lease that ran out (a Do holder that died; the row's owner token
		// changes, so that holder's late writes are refused). A live row — a Do holder that
		// reserved the key after DoTx read it — is left alone and nothing is returned. A
		// unique violation is never raised, so the caller's transaction is never aborted by
		// a duplicate; the primary key is the backstop behind the advisory lock. $9 is the
		// call's attempts cap (0: none): a dead holder's row at the cap is left alone too,
		// for DoTx to park (Park).
		//
		// took_over (after {cols}) says whether it took over a Do holder that died (a
		// released row is no takeover), decided by this statement rather than by DoTx's
		// earlier read, which fn's whole run separates from the write. Under READ
		// COMMITTED (and READ UNCOMMITTED, which Postgres runs as READ COMMITTED) the old
		// row is locked, in the mode ON CONFLICT DO UPDATE locks it, and read first
		// (locked, evaluated before the insert through the count), so the verdict is about
		// the very version ON CONFLICT then updates, even when another writer commits while
		// the statement waits; a row deleted meanwhile is just skipped. Under REPEATABLE READ and SERIALIZABLE it is
		// read from the snapshot (old's second branch), which is what ON CONFLICT acts on
		// there (a newer version raises a serialization failure), without a lock: locking a
		// row deleted after the snapshot (an expired record swept) would fail although the
		// upsert treats it as absent.
		TxUpsert: r.Replace(`
WITH locked AS (
	SELECT r.expires_at, r.status, r.lease_expires_at, r.updated_at
	FROM {t} AS r WHERE r.namespace = $1 AND r.key = $2
		AND current_setting('transaction_isolation') NOT IN ('repeatable read', 'serializable')
	FOR NO KEY UPDATE
), old AS (
	SELECT r.expires_at <= statement_timestamp() AS was_expired, ({released}) AS was_released
	FROM (SELECT * FROM locked
		UNION ALL
		SELECT r.expires_at, r.status, r.lease_expires_at, r.updated_at
		FROM {t} AS r WHERE r.namespace = $1 AND r.key = $2
			AND current_setting('transaction_isolation') IN ('repeatable read', 'serializable')) AS r
)
INSERT INTO {t} AS r (namespace, key, status, owner, attempts, fingerprint, result, error,
	lease_expires_at, expires_at, created_at, updated_at, completed_at)
SELECT $1, $2, $3, $4, 1, $5, $6::jsonb, $7::jsonb, NULL,
	statement_timestamp() + $8 * interval '1 microsecond',
	statement_timestamp(), statement_timestamp(), statement_timestamp()
FROM (SELECT count(*) FROM old) AS read_first
ON CONFLICT (namespace, key) DO UPDATE SET
	status = excluded.status,
	owner = excluded.owner,
	attempts = CASE WHEN r.expires_at <= statement_timestamp() THEN 1
		WHEN {released} THEN r.attempts
		ELSE r.attempts + 1 END,
	fingerprint = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.fingerprint
		ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
	result = excluded.result,
	error = excluded.error,
	lease_expires_at = NULL,
	expires_at = excluded.expires_at,
	created_at = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.created_at
		ELSE r.created_at END,
	updated_at = excluded.updated_at,
	completed_at = excluded.completed_at
WHERE r.expires_at <= statement_timestamp()
	OR (r.status = 'in_progress' AND r.lease_expires_at <= statement_timestamp()
		AND (excluded.fingerprint IS NULL OR r.fingerprint IS NULL
			OR r.fingerprint = excluded.fingerprint)
		AND ($9::int = 0 OR r.attempts < $9 OR {released}))
RETURNING {cols}, coalesce((SELECT NOT was_expired AND NOT was_released FROM old), false) AS took_over`),
	}
}

// LockKey returns the advisory lock id of (namespace, key): the FNV-1a 64-bit hash of
// "pgidem", a zero byte, the namespace's length in bytes as a uvarint, the namespace and
// the key. The length prefix keeps ("a", "bc") and ("ab", "c") apart. Applications that
// take their own pg_advisory_xact_lock(bigint) locks share this id space; a collision only
// serialises two unrelated transactions, it never breaks correctness.
func LockKey(namespace, key string) int64 {
	h := fnv.New64a()
	var n [binary.MaxVarintLen64]byte
	h.Write([]byte("pgidem\x00"))
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(namespace)))])
	h.Write([]byte(namespace))
	h.Write([]byte(key))
	return int64(h.Sum64())
}
