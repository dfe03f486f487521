package pgidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// listening reports whether a listener's session is open on the test's database: its
// last statement was its LISTEN on channel or a change of the keys it waits for.
func listening(t *testing.T, b *testBundle, channel string) bool {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND (query = 'LISTEN "' || $1 || '"'
			OR query LIKE '%pg_advisory_%lock_shared(hashtext(n), hashtext(k))%')`, channel).Scan(&n))
	return n > 0
}

// waitedFor reports whether a listener holds the interest lock of some key: the holder's
// finishing statement will notify it.
func waitedFor(t *testing.T, b *testBundle) bool {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND mode = 'ShareLock' AND granted AND objsubid = 2
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&n))
	return n > 0
}

// A waiter in another coordinator is woken by the holder's notification: it polls only
// once a minute and gives up after 20 s, so it returns the value only when notified.
func TestNotifyWakesWaiter(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	waiterCoord := b.newCoord(t, &pgidem.Config{PollIntervalMin: time.Minute, PollIntervalMax: time.Minute, WaitTimeout: 20 * time.Second})

	h := b.hold(b.coord, "mail", "k", nil, "sent")
	waited := make(chan pgidem.Result[string], 1)
	go func() {
		res, err := pgidem.DoResult(b.ctx, waiterCoord, "mail", "k", testTTL, nil, func(context.Context) (string, error) { return "again", nil })
		require.NoError(t, err)
		waited <- res
	}()
	require.Eventually(t, func() bool { return waitedFor(t, b) }, 30*time.Second, 5*time.Millisecond)
	h.unblock()
	require.NoError(t, <-h.done)
	res := <-waited
	require.Equal(t, "sent", res.Value)
	require.Equal(t, pgidem.OutcomeWaitedReplayed, res.Outcome)
	// The listener gives the key up and stops with its last waiter.
	require.Eventually(t, func() bool { return !listening(t, b, "pgidem") && !waitedFor(t, b) }, 30*time.Second, 5*time.Millisecond)
}

// Await and a schema's records use the schema's channel; with PollOnly no session
// listens and the waiter polls.
func TestNotifyPollOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pollOnly := b.newCoord(t, &pgidem.Config{PollOnly: true, WaitTimeout: time.Minute})
	h := b.hold(b.coord, "mail", "k", nil, "sent")
	waited := make(chan pgidem.Result[string], 1)
	go func() {
		res, err := pgidem.Await[string](b.ctx, pollOnly, "mail", "k", nil)
		require.NoError(t, err)
		waited <- res
	}()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'idle' AND query LIKE '%pgidem_record%'`).Scan(&n))
		return n > 0
	}, 30*time.Second, 5*time.Millisecond)
	require.False(t, listening(t, b, "pgidem"))
	h.unblock()
	require.NoError(t, <-h.done)
	require.Equal(t, "sent", (<-waited).Value)
}
