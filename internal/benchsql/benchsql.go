// Package benchsql holds the hand-written statements the benchmarks run as their raw-SQL
// baselines: the statements pgidem sends for one key, with none of the library around
// them, so a benchmark's ratio library/baseline from one run is the library's overhead.
package benchsql

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	// ReserveSQL is the reserving insert: it inserts an in-progress record or returns the
	// existing one. $1 namespace, $2 key, $3 owner, $4 fingerprint, $5 lease and $6 TTL in
	// microseconds.
	ReserveSQL = `
WITH ins AS (
	INSERT INTO pgidem_record (namespace, key, status, owner, attempts, fingerprint, lease_expires_at, expires_at)
	VALUES ($1, $2, 'in_progress', $3, 1, $4, now() + $5 * interval '1 microsecond', now() + $6 * interval '1 microsecond')
	ON CONFLICT (namespace, key) DO NOTHING
	RETURNING true AS inserted, status, owner, attempts, fingerprint, result, error, lease_expires_at,
		expires_at, created_at, updated_at, completed_at, expires_at <= now() AS expired,
		(status = 'in_progress' AND lease_expires_at <= now()) AS lease_expired, now() AS db_now
)
SELECT * FROM ins
UNION ALL
SELECT false, status, owner, attempts, fingerprint, result, error, lease_expires_at,
	expires_at, created_at, updated_at, completed_at, expires_at <= now() AS expired,
	(status = 'in_progress' AND lease_expires_at <= now()) AS lease_expired, now() AS db_now
FROM pgidem_record WHERE namespace = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM ins)`

	// CompleteSQL is the completing update. $1 namespace, $2 key, $3 owner, $4 status, $5
	// result, $6 error, $7 TTL in microseconds.
	CompleteSQL = `
UPDATE pgidem_record SET status = $4, result = $5, error = $6, lease_expires_at = NULL,
	completed_at = now(), expires_at = now() + $7 * interval '1 microsecond', updated_at = now()
WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'`

	// ReadSQL is pgidem's probe: the indexed read that starts every call. $1 namespace, $2
	// key.
	ReadSQL = `SELECT status, attempts, fingerprint, result, error, completed_at,
	status <> 'in_progress' AND expires_at > now() AS finished
FROM pgidem_record WHERE namespace = $1 AND key = $2`

	// MinimalReadSQL is the cheapest indexed read of a stored result.
	MinimalReadSQL = `SELECT result FROM pgidem_record WHERE namespace = $1 AND key = $2`
)

// Order is the order of a call's statements, as pgidem.DoOpts.ReserveFirst chooses it.
type Order bool

const (
	// ReadFirst starts with the indexed read (pgidem's default): a fresh key costs the
	// read, the reserving insert and the completing update; a replay the read alone.
	ReadFirst Order = false
	// ReserveFirst starts with the reserving insert, which returns an existing record: a
	// fresh key costs the insert and the update; a replay the insert that finds the row.
	ReserveFirst Order = true
)

// Fresh sends the statements of a fresh key through pool, in order: the read (which must
// find nothing) unless ReserveFirst, the reserving insert and, after effect, the
// completing update with effect's result (JSON). fingerprint may be nil.
func Fresh(ctx context.Context, pool *pgxpool.Pool, order Order, namespace, key string, fingerprint []byte, lease, ttl time.Duration, effect func() ([]byte, error)) error {
	owner := pgtype.UUID{Valid: true}
	_, _ = rand.Read(owner.Bytes[:])
	if order == ReadFirst {
		rows, err := pool.Query(ctx, ReadSQL, namespace, key)
		if err != nil {
			return err
		}
		found := rows.Next()
		rows.Close()
		if found {
			return errors.New("benchsql: the fresh key has a record")
		}
		if err := rows.Err(); err != nil {
			return err
		}
	}
	rows, err := pool.Query(ctx, ReserveSQL, namespace, key, owner, fingerprint, lease.Microseconds(), ttl.Microseconds())
	if err != nil {
		return err
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	result, err := effect()
	if err != nil {
		return err
	}
	_, err = pool.Exec(ctx, CompleteSQL, namespace, key, owner, "completed", result, nil, ttl.Microseconds())
	return err
}

// Replay reads a stored result with the statement order starts with and returns it.
func Replay(ctx context.Context, pool *pgxpool.Pool, order Order, namespace, key string, lease, ttl time.Duration) ([]byte, error) {
	// Scanned into plain values, as hand-written code would.
	var (
		inserted               bool
		status                 string
		owner                  pgtype.UUID
		attempts               int
		fingerprint            []byte
		result, failure        []byte
		leaseExpires, complete *time.Time
		expiresAt, createdAt   time.Time
		updatedAt              time.Time
		expired, leaseExpired  bool
		now                    time.Time
	)
	var err error
	if order == ReadFirst {
		var finished bool
		err = pool.QueryRow(ctx, ReadSQL, namespace, key).Scan(&status, &attempts, &fingerprint,
			&result, &failure, &complete, &finished)
	} else {
		newOwner := pgtype.UUID{Valid: true}
		_, _ = rand.Read(newOwner.Bytes[:])
		err = pool.QueryRow(ctx, ReserveSQL, namespace, key, newOwner, nil, lease.Microseconds(), ttl.Microseconds()).Scan(
			&inserted, &status, &owner, &attempts, &fingerprint, &result, &failure, &leaseExpires,
			&expiresAt, &createdAt, &updatedAt, &complete, &expired, &leaseExpired, &now)
		if err == nil && inserted {
			err = errors.New("benchsql: no record to replay (one was reserved)")
		}
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errors.New("benchsql: no record to replay")
	}
	return result, err
}

// KeyPrefix returns 8 random hex characters: a prefix that keeps one benchmark run's keys
// apart from another's in the same database.
func KeyPrefix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
