package protocol

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// listenerDone returns the running listener's done channel, nil when none runs.
func listenerDone(c *Engine) chan struct{} {
	c.listener.mu.Lock()
	defer c.listener.mu.Unlock()
	return c.listener.done
}

// The listener locks the key a waiter registers for; when its connection is terminated
// it stops (the waiters poll) instead of retrying a dead connection, and a waiter that
// comes listenRetry later starts a new one, which locks every key waited for. A key's
// last waiter leaving gives its lock up.
func TestListenerLocksKeysAndStopsWithItsConnection(t *testing.T) {
	t.Parallel()
	c, db := batchFixture(t)
	ctx := t.Context()
	interestLocks := func() int {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND mode = 'ShareLock' AND granted AND objsubid = 2
				AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&n))
		return n
	}
	cl, err := c.newCall("ns", "k", time.Hour, nil)
	require.NoError(t, err)
	_, unregister := c.wakeOn(cl)
	require.Eventually(t, func() bool { return interestLocks() == 1 }, 10*time.Second, 5*time.Millisecond)

	cl2, err := c.newCall("ns", "k2", time.Hour, nil)
	require.NoError(t, err)
	_, unregister2 := c.wakeOn(cl2)
	require.Eventually(t, func() bool { return interestLocks() == 2 }, 10*time.Second, 5*time.Millisecond)
	unregister2()
	require.Eventually(t, func() bool { return interestLocks() == 1 }, 10*time.Second, 5*time.Millisecond)

	done := listenerDone(c)
	require.NotNil(t, done)
	_, err = db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_locks
		WHERE locktype = 'advisory' AND mode = 'ShareLock' AND objsubid = 2
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`)
	require.NoError(t, err)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the listener kept going on a terminated connection")
	}
	require.Eventually(t, func() bool { return interestLocks() == 0 }, 10*time.Second, 5*time.Millisecond)
	require.Nil(t, listenerDone(c), "a failed listener is forgotten")

	cl3, err := c.newCall("ns", "k3", time.Hour, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { // a waiter after listenRetry starts a new listener
		_, unregister3 := c.wakeOn(cl3)
		defer unregister3()
		return listenerDone(c) != nil
	}, 10*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool { return interestLocks() == 1 }, 10*time.Second, 5*time.Millisecond,
		"the new listener locks the key still waited for")
	unregister()
	// With no waiter left it lingers and is stopped; a new waiter starts a new listener.
	require.Eventually(t, func() bool { return listenerDone(c) == nil }, 10*time.Second, 5*time.Millisecond)
	_, unregister = c.wakeOn(cl)
	defer unregister()
	require.Eventually(t, func() bool { return interestLocks() == 1 }, 10*time.Second, 5*time.Millisecond)
}
