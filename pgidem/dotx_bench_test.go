package pgidem_test

import (
	"context"
	"hash/fnv"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgidem/pgidem/internal/benchsql"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// The DoTx and inbox baselines send the statements pgidem sends, in the same transactions,
// through the same pool: the ratio pgidem/baseline from one run is the library's overhead.
// The one difference: pgidem's upsert also reads (under READ COMMITTED, locks) the old row
// first, in a CTE that decides whether it took over, which the baseline has no use for.
// A fresh DoTx key costs BEGIN, the pipelined try-lock and read (one round trip), SAVEPOINT,
// the upsert, RELEASE and COMMIT; a replay costs BEGIN, the pipelined try-lock and read, and
// COMMIT. A new inbox message costs BEGIN, the recording insert and COMMIT; a duplicate
// BEGIN, the insert (which reads the existing row) and ROLLBACK.
const (
	benchTxCols = `status, owner, attempts, fingerprint, result, error, lease_expires_at,
	expires_at, created_at, updated_at, completed_at, expires_at <= statement_timestamp() AS expired,
	(status = 'in_progress' AND lease_expires_at <= statement_timestamp()) AS lease_expired,
	statement_timestamp() AS db_now`
	benchTxReadSQL   = `SELECT ` + benchTxCols + ` FROM pgidem_record WHERE namespace = $1 AND key = $2`
	benchTxUpsertSQL = `
INSERT INTO pgidem_record AS r (namespace, key, status, owner, attempts, fingerprint, result, error,
	lease_expires_at, expires_at, created_at, updated_at, completed_at)
VALUES ($1, $2, $3, $4, 1, $5, $6, $7, NULL, statement_timestamp() + $8 * interval '1 microsecond',
	statement_timestamp(), statement_timestamp(), statement_timestamp())
ON CONFLICT (namespace, key) DO UPDATE SET status = excluded.status, owner = excluded.owner,
	attempts = CASE WHEN r.expires_at <= statement_timestamp() THEN 1 ELSE r.attempts + 1 END,
	fingerprint = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.fingerprint
		ELSE coalesce(r.fingerprint, excluded.fingerprint) END,
	result = excluded.result, error = excluded.error, lease_expires_at = NULL,
	expires_at = excluded.expires_at,
	created_at = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.created_at ELSE r.created_at END,
	updated_at = excluded.updated_at, completed_at = excluded.completed_at
WHERE r.expires_at <= statement_timestamp()
	OR (r.status = 'in_progress' AND r.lease_expires_at <= statement_timestamp()
		AND (excluded.fingerprint IS NULL OR r.fingerprint IS NULL OR r.fingerprint = excluded.fingerprint))
RETURNING ` + benchTxCols
	benchInboxSQL = `
WITH ins AS (
	INSERT INTO pgidem_inbox (consumer, message_id, payload, received_at, expires_at)
	VALUES ($1, $2, $3, statement_timestamp(), statement_timestamp() + $4 * interval '1 microsecond')
	ON CONFLICT (consumer, message_id) DO NOTHING
	RETURNING true AS inserted, false AS expired
)
SELECT inserted, expired FROM ins
UNION ALL
SELECT false, expires_at <= statement_timestamp() FROM pgidem_inbox
WHERE consumer = $1 AND message_id = $2 AND NOT EXISTS (SELECT 1 FROM ins)`
)

func benchLockID(namespace, key string) int64 {
	h := fnv.New64a()
	h.Write([]byte(namespace))
	h.Write([]byte(key))
	return int64(h.Sum64())
}

// benchTxLockRead is the baseline's pipelined try-lock and record read.
func benchTxLockRead(b *testing.B, ctx context.Context, tx pgx.Tx, namespace, key string) (found bool) {
	batch := &pgx.Batch{}
	batch.Queue(`SELECT pg_try_advisory_xact_lock($1)`, benchLockID(namespace, key))
	batch.Queue(benchTxReadSQL, namespace, key)
	br := tx.SendBatch(ctx, batch)
	var locked bool
	if err := br.QueryRow().Scan(&locked); err != nil || !locked {
		b.Fatal(err, locked)
	}
	rows, err := br.Query()
	if err != nil {
		b.Fatal(err)
	}
	found = rows.Next()
	rows.Close()
	if err := br.Close(); err != nil {
		b.Fatal(err)
	}
	return found
}

func BenchmarkDoTx(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	fn := func(context.Context, pgx.Tx) (string, error) { return "entry_1", nil }
	ttl := micros(testTTL)

	b.Run("FreshKey/pgidem", func(b *testing.B) {
		prefix := benchsql.KeyPrefix()
		i := 0
		for b.Loop() {
			i++
			if _, err := pgidem.DoInTx(ctx, coord, "bench", prefix+strconv.Itoa(i), testTTL, nil, fn); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("FreshKey/baseline", func(b *testing.B) {
		prefix := benchsql.KeyPrefix()
		i := 0
		for b.Loop() {
			i++
			key := prefix + strconv.Itoa(i)
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if benchTxLockRead(b, ctx, tx, "bench", key) {
				b.Fatal("fresh key found")
			}
			sp, err := tx.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			owner := pgtype.UUID{Valid: true}
			rows, err := sp.Query(ctx, benchTxUpsertSQL, "bench", key, "completed", owner, nil, []byte(`"entry_1"`), nil, ttl)
			if err != nil {
				b.Fatal(err)
			}
			rows.Close()
			if err := sp.Commit(ctx); err != nil {
				b.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})

	if _, err := pgidem.DoInTx(ctx, coord, "bench", "replayed", testTTL, nil, fn); err != nil {
		b.Fatal(err)
	}
	b.Run("Replay/pgidem", func(b *testing.B) {
		for b.Loop() {
			if _, err := pgidem.DoInTx(ctx, coord, "bench", "replayed", testTTL, nil, fn); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("Replay/baseline", func(b *testing.B) {
		for b.Loop() {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if !benchTxLockRead(b, ctx, tx, "bench", "replayed") {
				b.Fatal("record not found")
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkInbox(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	handler := func(context.Context, pgx.Tx) error { return nil }
	retention := micros(pgidem.InboxRetentionDefault)

	b.Run("New/pgidem", func(b *testing.B) {
		prefix := benchsql.KeyPrefix()
		i := 0
		for b.Loop() {
			i++
			handled, err := coord.InboxHandle(ctx, "bench", prefix+strconv.Itoa(i), nil, handler)
			if err != nil || !handled {
				b.Fatal(err, handled)
			}
		}
	})
	b.Run("New/baseline", func(b *testing.B) {
		prefix := benchsql.KeyPrefix()
		i := 0
		for b.Loop() {
			i++
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			var inserted, expired bool
			if err := tx.QueryRow(ctx, benchInboxSQL, "bench", prefix+strconv.Itoa(i), nil, retention).Scan(&inserted, &expired); err != nil || !inserted {
				b.Fatal(err, inserted)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})

	if _, err := coord.InboxHandle(ctx, "bench", "duplicate", nil, handler); err != nil {
		b.Fatal(err)
	}
	b.Run("Duplicate/pgidem", func(b *testing.B) {
		for b.Loop() {
			handled, err := coord.InboxHandle(ctx, "bench", "duplicate", nil, handler)
			if err != nil || handled {
				b.Fatal(err, handled)
			}
		}
	})
	b.Run("Duplicate/baseline", func(b *testing.B) {
		for b.Loop() {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			var inserted, expired bool
			if err := tx.QueryRow(ctx, benchInboxSQL, "bench", "duplicate", nil, retention).Scan(&inserted, &expired); err != nil || inserted {
				b.Fatal(err, inserted)
			}
			if err := tx.Rollback(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}
