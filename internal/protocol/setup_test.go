package protocol

import (
	"cmp"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// batchFixture is a coordinator on a fresh database, for driving rounds directly.
func batchFixture(t *testing.T) (*Engine, *testdb.DB) {
	t.Helper()
	db := testdb.New(t)
	c, err := newTestEngine(db.Pool, Settings{MinTTL: 2 * time.Second, Lease: time.Second})
	require.NoError(t, err)
	return c, db
}

func reserveItems(t *testing.T, c *Engine, keys ...string) []*batchItem[reserveReq, store.Row] {
	t.Helper()
	var items []*batchItem[reserveReq, store.Row]
	for _, k := range keys {
		cl, err := c.newCall("ns", k, time.Hour, nil)
		require.NoError(t, err)
		items = append(items, &batchItem[reserveReq, store.Row]{req: reserveReq{ctx: context.Background(), cl: cl, Owner: store.NewOwner()}})
	}
	return items
}

// newTestEngine returns an engine on pool with s's zero fields set to pgidem's defaults.
func newTestEngine(pool *pgxpool.Pool, s Settings) (*Engine, error) {
	s.Lease = cmp.Or(s.Lease, 30*time.Second)
	s.MinTTL = cmp.Or(s.MinTTL, time.Minute)
	s.WaitTimeout = cmp.Or(s.WaitTimeout, time.Minute)
	s.InFlight = cmp.Or(s.InFlight, InFlightWait)
	s.PollIntervalMin = cmp.Or(s.PollIntervalMin, 10*time.Millisecond)
	s.PollIntervalMax = cmp.Or(s.PollIntervalMax, time.Second)
	s.FinishTimeout = cmp.Or(s.FinishTimeout, 10*time.Second)
	s.MaxBatch = cmp.Or(s.MaxBatch, 64)
	s.MaxKeyBytes = cmp.Or(s.MaxKeyBytes, 255)
	s.MaxNamespaceBytes = cmp.Or(s.MaxNamespaceBytes, 64)
	s.MaxValueBytes = cmp.Or(s.MaxValueBytes, 16<<20)
	if s.Logger == nil {
		s.Logger = slog.New(slog.DiscardHandler)
	}
	return New(pool, s), nil
}

// doString runs fn under (namespace, key) through the engine, as pgidem.DoResult does
// for a string result.
func doString(ctx context.Context, c *Engine, namespace, key string, ttl time.Duration, opts *Opts, fn func(context.Context) (string, error)) (string, error) {
	cl, err := c.Prepare(ctx, "Do", namespace, key, ttl, opts)
	if err != nil {
		return "", err
	}
	var value string
	rep, err := c.Do(ctx, cl, func(ctx context.Context) error {
		var err error
		value, err = fn(ctx)
		return err
	}, func() ([]byte, error) { return json.Marshal(value) })
	if rep.Replayed() && err == nil {
		if rep.Row.Status == store.StatusFailed {
			return "", StoredFailure(namespace, key, &rep.Row)
		}
		err = json.Unmarshal(rep.Row.Result, &value)
	}
	return value, err
}
