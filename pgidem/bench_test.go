package pgidem_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// The baselines send the statements pgidem sends, through the same pool, with none of the
// library around them: the ratio pgidem/baseline from one run is the library's overhead.
// A fresh key costs an indexed read (miss), the reserving insert and the completing update;
// a replay costs the indexed read alone.
const (
	benchReserveSQL = `
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
	benchCompleteSQL = `
UPDATE pgidem_record SET status = $4, result = $5, error = $6, lease_expires_at = NULL,
	completed_at = now(), expires_at = now() + $7 * interval '1 microsecond', updated_at = now()
WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'`
	benchReadSQL = `SELECT result FROM pgidem_record WHERE namespace = $1 AND key = $2`
)

func benchPrefix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func BenchmarkDo(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	fn := func(context.Context) (string, error) { return "em_1", nil }
	ttl := micros(testTTL)
	lease := micros(pgidem.LeaseDefault)

	b.Run("FreshKey/pgidem", func(b *testing.B) {
		prefix := benchPrefix()
		i := 0
		for b.Loop() {
			i++
			if _, err := pgidem.Do(ctx, coord, "bench", prefix+strconv.Itoa(i), testTTL, nil, fn); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("FreshKey/baseline", func(b *testing.B) {
		prefix := benchPrefix()
		i := 0
		for b.Loop() {
			i++
			key := prefix + strconv.Itoa(i)
			owner := pgtype.UUID{Valid: true}
			_, _ = rand.Read(owner.Bytes[:])
			var result []byte
			if err := db.Pool.QueryRow(ctx, benchReadSQL, "bench", key).Scan(&result); err != pgx.ErrNoRows {
				b.Fatal(err)
			}
			rows, err := db.Pool.Query(ctx, benchReserveSQL, "bench", key, owner, nil, lease, ttl)
			if err != nil {
				b.Fatal(err)
			}
			rows.Close()
			if _, err := db.Pool.Exec(ctx, benchCompleteSQL, "bench", key, owner, "completed", []byte(`"em_1"`), nil, ttl); err != nil {
				b.Fatal(err)
			}
		}
	})

	if _, err := pgidem.Do(ctx, coord, "bench", "replayed", testTTL, nil, fn); err != nil {
		b.Fatal(err)
	}
	b.Run("Replay/pgidem", func(b *testing.B) {
		for b.Loop() {
			if _, err := pgidem.Do(ctx, coord, "bench", "replayed", testTTL, nil, fn); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("Replay/baseline", func(b *testing.B) {
		for b.Loop() {
			var result []byte
			if err := db.Pool.QueryRow(ctx, benchReadSQL, "bench", "replayed").Scan(&result); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func micros(d interface{ Microseconds() int64 }) int64 { return d.Microseconds() }
