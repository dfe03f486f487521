package pgidem_test

import (
	"context"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	"github.com/pgidem/pgidem/pgidem"
)

// Identifiers are always quoted: in a schema whose name needs quoting (a space, capitals),
// migrated by the migrations package, every statement family works: Do, DoInTx, DoTx's
// replay, the inbox (new and duplicate) and Sweep.
func TestQuotedSchemaIdentifiers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	const schema = "Idem Store"
	sqlDB, err := migrations.OpenDB(db.URL, schema)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	_, err = migrations.Up(ctx, sqlDB, &migrations.Opts{Schema: schema})
	require.NoError(t, err)
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{Schema: schema})
	require.NoError(t, err)

	v, err := pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	require.Equal(t, 1, v)

	var runs atomic.Int32
	v, err = pgidem.DoInTx(ctx, coord, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		runs.Add(1)
		return 2, nil
	})
	require.NoError(t, err)
	require.Equal(t, 2, v)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	res, err := pgidem.DoTxResult(ctx, coord, tx, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		runs.Add(1)
		return 3, nil
	})
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, 2, res.Value)
	require.NoError(t, tx.Commit(ctx))
	require.EqualValues(t, 1, runs.Load())

	for i, want := range []bool{true, false} {
		handled, err := coord.InboxHandle(ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error { return nil })
		require.NoError(t, err)
		require.Equal(t, want, handled, "call %d", i)
	}

	_, err = db.Pool.Exec(ctx, `
		INSERT INTO "Idem Store".pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
			VALUES ('mail', 'old', 'completed', gen_random_uuid(), '1', now() - interval '1 second', now() - interval '1 hour');
		INSERT INTO "Idem Store".pgidem_inbox (consumer, message_id, received_at, expires_at)
			VALUES ('billing', 'old', now() - interval '8 days', now() - interval '1 day')`)
	require.NoError(t, err)
	sw, err := coord.Sweep(ctx, nil)
	require.NoError(t, err)
	require.Equal(t, pgidem.SweepResult{Records: 1, Inbox: 1}, pgidem.SweepResult{Records: sw.Records, Inbox: sw.Inbox})
	require.Positive(t, sw.RowsPerSecond)

	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM "Idem Store".pgidem_record) + (SELECT count(*) FROM "Idem Store".pgidem_inbox)`).Scan(&n))
	require.Equal(t, 3, n, "Do's and DoInTx's records and the inbox row live in the schema")
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		cfg   pgidem.Config
		field string
	}{
		{pgidem.Config{Lease: time.Millisecond}, "Config.Lease"},
		{pgidem.Config{Lease: time.Minute, MinTTL: time.Minute}, "Config.MinTTL"},
		{pgidem.Config{InFlight: 7}, "Config.InFlight"},
		{pgidem.Config{WaitTimeout: -1}, "Config.WaitTimeout"},
		{pgidem.Config{PollIntervalMin: time.Second, PollIntervalMax: time.Millisecond}, "Config.PollIntervalMin"},
		{pgidem.Config{MaxKeyBytes: 4000}, "Config.MaxKeyBytes"},
		// The sum must not overflow into a negative number that passes the check.
		{pgidem.Config{MaxKeyBytes: math.MaxInt}, "Config.MaxKeyBytes"},
		{pgidem.Config{MaxKeyBytes: 1 << 62, MaxNamespaceBytes: 1 << 62}, "Config.MaxKeyBytes"},
		{pgidem.Config{MaxValueBytes: -1}, "Config.MaxValueBytes"},
		{pgidem.Config{FinishTimeout: time.Nanosecond}, "Config.FinishTimeout"},
		{pgidem.Config{FinishTimeout: -1}, "Config.FinishTimeout"},
		{pgidem.Config{MaxValueBytes: pgidem.MaxValueBytesMax + 1}, "Config.MaxValueBytes"},
		// pgx.Identifier would drop the NUL and use schema "public" instead.
		{pgidem.Config{Schema: "pub\x00lic"}, "Config.Schema"},
		{pgidem.Config{Schema: "\xff"}, "Config.Schema"},
		{pgidem.Config{Schema: strings.Repeat("s", pgidem.SchemaMaxBytes+1)}, "Config.Schema"},
		{pgidem.Config{Schema: "   "}, "Config.Schema"}, // migrations.CheckSchemaName refuses it too
	} {
		_, err := pgidem.NewCoordinator(b.db.Pool, &tc.cfg)
		require.ErrorContains(t, err, tc.field)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	}
	_, err := pgidem.NewCoordinator(nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{Schema: strings.Repeat("s", pgidem.SchemaMaxBytes)})
	require.NoError(t, err)
	cfg := b.coord.Config()
	require.Equal(t, pgidem.LeaseDefault, cfg.Lease)
	require.Equal(t, pgidem.MinTTLDefault, cfg.MinTTL)
	require.Equal(t, pgidem.InFlightWait, cfg.InFlight)
}
