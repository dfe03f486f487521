package pgidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// testTTL is a TTL valid under testConfig's MinTTL.
const testTTL = time.Hour

type testBundle struct {
	db    *testdb.DB
	coord *pgidem.Coordinator
	ctx   context.Context
}

// setup returns a fresh database and a coordinator on it; config may be nil.
func setup(t *testing.T, config *pgidem.Config) *testBundle {
	t.Helper()
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, config)
	require.NoError(t, err)
	return &testBundle{db: db, coord: coord, ctx: context.Background()}
}

// newCoord returns another coordinator on the bundle's database.
func (b *testBundle) newCoord(t *testing.T, config *pgidem.Config) *pgidem.Coordinator {
	t.Helper()
	coord, err := pgidem.NewCoordinator(b.db.Pool, config)
	require.NoError(t, err)
	return coord
}

// newCoordOn returns a coordinator on another pool.
func (b *testBundle) newCoordOn(t *testing.T, pool *pgxpool.Pool, config *pgidem.Config) *pgidem.Coordinator {
	t.Helper()
	coord, err := pgidem.NewCoordinator(pool, config)
	require.NoError(t, err)
	return coord
}

func (b *testBundle) lookup(t *testing.T, namespace, key string) *pgidem.Record {
	t.Helper()
	rec, err := b.coord.Lookup(b.ctx, namespace, key)
	require.NoError(t, err)
	return rec
}

func (b *testBundle) count(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM pgidem_record").Scan(&n))
	return n
}
