package pgidemriver_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// SharedNSArgs name their effect under a namespace shared with another kind.
type SharedNSArgs struct {
	OrderID int64 `json:"order_id"`
}

func (SharedNSArgs) Kind() string                 { return "mail.invoice_v2" }
func (SharedNSArgs) IdempotencyKey() string       { return "order-9.invoice" }
func (SharedNSArgs) IdempotencyNamespace() string { return "mail.invoice" }

// The valid paths of the namespace method and of Config.KeyFunc (other tests cover the
// invalid ones): a job of another kind that names the same (namespace, key) replays
// instead of running; a KeyFunc key dedupes two different jobs; the KeyFunc's empty
// namespace defaults to the kind.
func TestKeyFromNamespaceMethodAndKeyFunc(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("NamespaceMethod", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, nil)
		mw.Register(InvoiceArgs{}, SharedNSArgs{})
		var runs atomic.Int32
		work := func(context.Context) error { runs.Add(1); return nil }
		require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":9}`), work))
		require.NoError(t, mw.Work(b.ctx, jobRow(2, "mail.invoice_v2", `{"order_id":9}`), work))
		require.EqualValues(t, 1, runs.Load(), "same namespace and key: the effect runs once")
		all := outs.list()
		require.Len(t, all, 2)
		require.Equal(t, pgidemriver.ActionExecuted, all[0].Action)
		require.Equal(t, pgidemriver.ActionReplayed, all[1].Action)
		require.Equal(t, "mail.invoice", all[1].Namespace)
		require.Equal(t, pgidemriver.KeySourceArgs, all[1].KeySource)
	})

	t.Run("KeyFunc", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, &pgidemriver.Config{
			KeyFunc: func(job *rivertype.JobRow) (string, string, bool) {
				if job.Kind != "mail.plain" {
					return "", "", false
				}
				return "", "order-7.receipt", true
			},
		})
		mw.Register(PlainArgs{})
		var runs atomic.Int32
		work := func(context.Context) error { runs.Add(1); return nil }
		require.NoError(t, mw.Work(b.ctx, jobRow(11, "mail.plain", `{"order_id":7}`), work))
		require.NoError(t, mw.Work(b.ctx, jobRow(12, "mail.plain", `{"order_id":7}`), work))
		require.EqualValues(t, 1, runs.Load(), "two jobs, one KeyFunc key: the effect runs once")
		all := outs.list()
		require.Len(t, all, 2)
		for _, o := range all {
			require.Equal(t, pgidemriver.KeySourceFunc, o.KeySource)
			require.Equal(t, "mail.plain", o.Namespace, "an empty KeyFunc namespace defaults to the kind")
			require.Equal(t, "order-7.receipt", o.Key)
		}
		require.Zero(t, mw.Stats().JobIDKeys, "not counted as a job-id fallback")
		rec, err := b.coord.Lookup(b.ctx, "mail.plain", "order-7.receipt")
		require.NoError(t, err)
		require.Equal(t, 1, rec.Attempts)
	})
}

// The sweep job deletes expired inbox rows as well as records (TestSweeper checks the
// records), and keeps live ones.
func TestSweepWorkerSweepsInbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		SELECT 'orders', 'old-' || i, now() - interval '8 days', now() - interval '1 day' FROM generate_series(1, 250) i
		UNION ALL
		SELECT 'orders', 'live-' || i, now(), now() + interval '7 days' FROM generate_series(1, 5) i`)
	require.NoError(t, err)
	sweeper, err := pgidemriver.NewSweepWorker(b.coord, &pgidemriver.SweepConfig{BatchSize: 100, Pause: -1})
	require.NoError(t, err)
	workers := river.NewWorkers()
	river.AddWorker(workers, sweeper)
	client := b.startClient(t, riverConfig(t, workers))
	res, err := client.Insert(b.ctx, pgidemriver.SweepArgs{}, nil)
	require.NoError(t, err)
	job := b.waitJob(t, res.Job.ID, rivertype.JobStateCompleted)
	var out pgidem.SweepResult
	require.NoError(t, json.Unmarshal(job.Output(), &out))
	require.EqualValues(t, 250, out.Inbox)
	var left int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_inbox`).Scan(&left))
	require.Equal(t, 5, left)
}
