package pgidemriver_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// poolerPool returns a pool on b's database through PgBouncer in transaction pooling mode
// with pgx's query mode set to mode.
func (b *bundle) poolerPool(t *testing.T, mode string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgbouncer.URL(t, b.db.URL, mode))
	require.NoError(t, err)
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// River and the middleware behind PgBouncer in transaction pooling mode: River in poll-only
// mode (its LISTEN-based notifier needs a session of its own), every statement of River,
// the middleware and the workers through the pooler. Two clients of 8 workers each (16
// jobs at once) work 3 jobs per effect key over 20 keys: each effect runs once, every job
// completes. The same holds for WorkInTx, whose transaction also completes the job.
func TestPoolerRiver(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			t.Run("Middleware", func(t *testing.T) { poolerRiverMiddleware(t, mode) })
			t.Run("WorkInTx", func(t *testing.T) { poolerRiverWorkInTx(t, mode) })
		})
	}
}

const (
	poolerKeys        = 20
	poolerJobsPerKey  = 3
	poolerWorkersEach = 8
)

// startPoolerClients starts two poll-only River clients on pool and stops them at cleanup.
func (b *bundle) startPoolerClients(t *testing.T, pool *pgxpool.Pool, workers *river.Workers, mws ...rivertype.Middleware) {
	t.Helper()
	for range 2 {
		cfg := riverConfig(t, workers, mws...)
		cfg.PollOnly = true
		cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: poolerWorkersEach}}
		client, err := pgidemriver.NewClient(riverpgxv5.New(pool), cfg)
		require.NoError(t, err)
		require.NoError(t, client.Start(b.ctx))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			require.NoError(t, client.Stop(ctx))
		})
	}
}

// insertPoolerJobs inserts poolerJobsPerKey jobs per key through pool, in one
// transaction, and returns their ids.
func (b *bundle) insertPoolerJobs(t *testing.T, pool *pgxpool.Pool, args func(order int64) river.JobArgs) []int64 {
	t.Helper()
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	require.NoError(t, err)
	var params []river.InsertManyParams
	for range poolerJobsPerKey {
		for order := range int64(poolerKeys) {
			params = append(params, river.InsertManyParams{Args: args(order)})
		}
	}
	res, err := client.InsertMany(b.ctx, params)
	require.NoError(t, err)
	ids := make([]int64, len(res))
	for i, r := range res {
		ids[i] = r.Job.ID
	}
	return ids
}

func poolerRiverMiddleware(t *testing.T, mode string) {
	b := setup(t)
	pool := b.poolerPool(t, mode)
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: 5 * time.Second, FinishTimeout: 30 * time.Second, PollOnly: true, Logger: testLogger(t)})
	require.NoError(t, err)
	mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{Logger: testLogger(t)})
	require.NoError(t, err)
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &effectWorker[InvoiceArgs]{pool: pool})
	b.startPoolerClients(t, pool, workers, mw)

	ids := b.insertPoolerJobs(t, pool, func(order int64) river.JobArgs { return InvoiceArgs{OrderID: order} })
	for _, id := range ids {
		b.waitJob(t, id, rivertype.JobStateCompleted)
	}
	rows, err := b.db.Pool.Query(b.ctx, `SELECT key, count(*) FROM effects GROUP BY key`)
	require.NoError(t, err)
	counts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		Key string
		N   int
	}, error) {
		var c struct {
			Key string
			N   int
		}
		err := r.Scan(&c.Key, &c.N)
		return c, err
	})
	require.NoError(t, err)
	require.Len(t, counts, poolerKeys, "one effect key per order")
	for _, c := range counts {
		require.Equal(t, 1, c.N, "effects of %s", c.Key)
	}
	var records int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_record WHERE status = 'completed'`).Scan(&records))
	require.Equal(t, poolerKeys, records)
}

func poolerRiverWorkInTx(t *testing.T, mode string) {
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
	require.NoError(t, err)
	pool := b.poolerPool(t, mode)
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: 5 * time.Second, FinishTimeout: 30 * time.Second, PollOnly: true, Logger: testLogger(t)})
	require.NoError(t, err)
	workers := river.NewWorkers()
	river.AddWorker(workers, &shipWorker{coord: coord})
	b.startPoolerClients(t, pool, workers)

	ids := b.insertPoolerJobs(t, pool, func(order int64) river.JobArgs { return ShipArgs{OrderID: order} })
	for _, id := range ids {
		b.waitJob(t, id, rivertype.JobStateCompleted)
	}
	var orders, shipments int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(DISTINCT order_id), count(*) FROM shipments`).Scan(&orders, &shipments))
	require.Equal(t, poolerKeys, orders)
	require.Equal(t, poolerKeys, shipments, "one shipment per order for %d jobs", len(ids))
}
