package pgidemriver_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

const shipmentsSchema = `CREATE TABLE shipments (id bigserial PRIMARY KEY, order_id bigint NOT NULL, job_id bigint NOT NULL)`

// ShipArgs ship an order: a database effect (a shipments row).
type ShipArgs struct {
	OrderID int64 `json:"order_id"`
}

func (ShipArgs) Kind() string { return "order.ship" }

// shipWorker writes the shipment, its pgidem record and the job's completion in one
// transaction through WorkTx.
type shipWorker struct {
	river.WorkerDefaults[ShipArgs]
	coord *pgidem.Coordinator
	inTx  func(ctx context.Context, jobID int64) // nil: none; called inside the transaction after the shipment row
	errs  chan error                             // nil: none; receives each WorkTx error
}

func (w *shipWorker) Work(ctx context.Context, job *river.Job[ShipArgs]) error {
	_, err := pgidemriver.WorkTx(ctx, w.coord, job, "orders", fmt.Sprintf("order-%d.ship", job.Args.OrderID), testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, "INSERT INTO shipments (order_id, job_id) VALUES ($1, $2) RETURNING id", job.Args.OrderID, job.ID).Scan(&id)
			if err == nil && w.inTx != nil {
				w.inTx(ctx, job.ID)
			}
			return id, err
		})
	if w.errs != nil {
		w.errs <- err
	}
	return err
}

// state reads the three things WorkTx commits together.
func (b *bundle) shipState(t *testing.T, jobID int64) (shipments int, record bool, jobState rivertype.JobState) {
	t.Helper()
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT
		(SELECT count(*) FROM shipments),
		EXISTS (SELECT 1 FROM pgidem_record WHERE namespace = 'orders' AND key = 'order-9.ship' AND status = 'completed'),
		(SELECT state::text FROM river_job WHERE id = $1)`, jobID).Scan(&shipments, &record, &jobState))
	return shipments, record, jobState
}

// TestWorkTx: after success the business row, the record and the job's completion are
// all present; after a worker process is SIGKILLed mid-transaction all three are absent,
// and the rescued retry makes them present exactly once.
func TestWorkTx(t *testing.T) {
	t.Parallel()

	t.Run("Success", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
		require.NoError(t, err)
		workers := river.NewWorkers()
		river.AddWorker(workers, &shipWorker{coord: b.coord})
		b.startClient(t, riverConfig(t, workers))

		id := b.insert(t, ShipArgs{OrderID: 9}, nil)
		second := b.insert(t, ShipArgs{OrderID: 9}, nil) // a second job for the same shipment
		b.waitJob(t, id, rivertype.JobStateCompleted)
		b.waitJob(t, second, rivertype.JobStateCompleted)
		shipments, record, state := b.shipState(t, id)
		require.Equal(t, 1, shipments, "one shipment for two jobs")
		require.True(t, record)
		require.Equal(t, rivertype.JobStateCompleted, state)
	})

	// River's rescuer discards (or makes retryable) a job that still runs; WorkTx must not
	// commit the effect without the completion River then refuses.
	t.Run("JobNoLongerRunning", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
		require.NoError(t, err)
		errs := make(chan error, 1)
		workers := river.NewWorkers()
		river.AddWorker(workers, &shipWorker{coord: b.coord, errs: errs, inTx: func(ctx context.Context, jobID int64) {
			_, err := b.db.Pool.Exec(ctx, "UPDATE river_job SET state = 'discarded', finalized_at = now() WHERE id = $1", jobID)
			require.NoError(t, err)
		}})
		b.startClient(t, riverConfig(t, workers))

		id := b.insert(t, ShipArgs{OrderID: 9}, nil)
		select {
		case err := <-errs:
			require.ErrorIs(t, err, pgidemriver.ErrJobNotRunning)
		case <-time.After(30 * time.Second):
			t.Fatal("the job did not run")
		}
		shipments, record, state := b.shipState(t, id)
		require.Zero(t, shipments, "the shipment rolled back")
		require.False(t, record, "no record")
		require.Equal(t, rivertype.JobStateDiscarded, state)
	})

	t.Run("CrashMidTransaction", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
		require.NoError(t, err)
		id := b.insert(t, ShipArgs{OrderID: 9}, nil)

		runChildUntil(t, b.db.URL, "in tx")
		shipments, record, state := b.shipState(t, id)
		require.Zero(t, shipments, "the shipment rolled back with the killed session")
		require.False(t, record, "no record")
		require.Equal(t, rivertype.JobStateRunning, state, "no completion: River still thinks it runs")

		workers := river.NewWorkers()
		river.AddWorker(workers, &shipWorker{coord: b.coord})
		cfg := riverConfig(t, workers)
		cfg.JobTimeout = 500 * time.Millisecond
		cfg.RescueStuckJobsAfter = time.Second
		b.waitRunningFor(t, id, cfg.RescueStuckJobsAfter+200*time.Millisecond)
		b.startClient(t, cfg)
		job := b.waitJob(t, id, rivertype.JobStateCompleted)
		require.Equal(t, 2, job.Attempt)
		shipments, record, _ = b.shipState(t, id)
		require.Equal(t, 1, shipments)
		require.True(t, record)
	})
}
