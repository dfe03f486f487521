package protocol

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// The heartbeat renews the lease while the finishing write waits for its round, so a slow
// round never lets another caller take the key over.
func TestHeartbeatCoversAQueuedCompletion(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	// A lease long enough that a busy machine's slow commits do not lose it: the test is
	// about the renewals continuing, not about their speed.
	c, err := newTestEngine(db.Pool, Settings{MinTTL: 5 * time.Second, Lease: time.Second})
	require.NoError(t, err)
	ctx := context.Background()
	inRound, proceed := make(chan struct{}), make(chan struct{})
	run := c.completes.run
	c.completes.run = func(ctx context.Context, leader *batchItem[completeReq, struct{}], take func(time.Duration) []*batchItem[completeReq, struct{}]) {
		close(inRound)
		<-proceed // the round is slow: longer than a lease
		run(ctx, leader, take)
	}
	done := make(chan error, 1)
	go func() {
		_, err := doString(ctx, c, "ns", "k", time.Hour, nil, func(context.Context) (string, error) { return "v", nil })
		done <- err
	}()
	<-inRound
	time.Sleep(3 * time.Second) // three leases
	var leaseLive bool
	require.NoError(t, db.Pool.QueryRow(ctx,
		"SELECT lease_expires_at > now() FROM pgidem_record WHERE key = 'k'").Scan(&leaseLive))
	require.True(t, leaseLive, "the lease was renewed while the completion waited")
	_, err = doString(ctx, c, "ns", "k", time.Hour, &Opts{InFlight: InFlightRaise}, func(context.Context) (string, error) {
		return "second", nil
	})
	require.ErrorIs(t, err, ErrInProgress, "no takeover while the holder finishes")
	close(proceed)
	require.NoError(t, <-done)
	rec, err := c.Lookup(ctx, c.pool, "ns", "k")
	require.NoError(t, err)
	require.Equal(t, store.StatusCompleted, rec.Status)
	require.Equal(t, 1, rec.Attempts)
}
