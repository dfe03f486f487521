package pgidem_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/pgidem"
)

// TestServerRestartRunsNoEffectTwice keeps the server down for a shutdown, restartDowntime
// and a start (up to about 12 s on a loaded 2-core machine), under the default lease (30
// s), whose finishing writes retry for at least 0.57 of it (17 s).
const (
	restartDowntime = 1500 * time.Millisecond
	restartWorkers  = 16
)

// A server restart (fast or immediate, down for a few seconds) while 16 callers run
// effects on many keys is not a re-run: a finishing write that fails while the server is
// down retries until it is back, within the lease, so every key's effect runs once and its
// record completes with attempts 1. Callers whose calls fail before fn runs call again, as
// a redelivery would; each key is delivered once more after it completed, and replays.
// The server is a throwaway cluster of the test's own, so effects are counted in memory.
// Were an effect to run twice, its record must say so (attempts 2 or more).
func TestServerRestartRunsNoEffectTwice(t *testing.T) {
	t.Parallel()
	cluster, pool := clusterPool(t, restartWorkers+4)
	ctx := context.Background()
	coord, err := pgidem.NewCoordinator(pool, nil)
	require.NoError(t, err)

	for _, mode := range []pgcluster.Mode{pgcluster.Fast, pgcluster.Immediate} {
		t.Run(string(mode), func(t *testing.T) {
			run := &restartRun{namespace: "restart_" + string(mode), effects: map[string]int{}}
			run.start(t, coord)
			run.waitCalls(t, 50) // the callers are under way
			down := time.Now()
			require.NoError(t, cluster.Shutdown(mode))
			time.Sleep(restartDowntime)
			require.NoError(t, cluster.Start())
			up := time.Now()
			run.waitCalls(t, run.calls.Load()+50) // and going again
			run.stopAndWait()

			require.Empty(t, run.mismatches)
			type record struct {
				Key, Status string
				Attempts    int
			}
			rows, err := pool.Query(ctx, `SELECT key, status, attempts FROM pgidem_record WHERE namespace = $1`, run.namespace)
			require.NoError(t, err)
			records, err := pgx.CollectRows(rows, pgx.RowToStructByPos[record])
			require.NoError(t, err)
			attempts := map[string]int{}
			for _, r := range records {
				require.Equal(t, "completed", r.Status, r.Key)
				attempts[r.Key] = r.Attempts
			}
			require.Len(t, attempts, len(run.effects), "every key's effect ran, and its record completed")
			straddled := 0
			for key, n := range run.effects {
				// Never silently: an effect that ran twice is on record.
				require.GreaterOrEqual(t, attempts[key], n, "%s: the effect ran %d times, and the record must say so", key, n)
				require.LessOrEqual(t, n, 1, "%s: the effect ran %d times", key, n)
				require.Equal(t, 1, attempts[key], "%s: taken over although its effect ran once", key)
				if end := run.fnEnded[key]; end.After(down) && end.Before(up) {
					straddled++
				}
			}
			require.Positive(t, straddled, "some effects ended while the server was down, their finishing write retried")
			t.Logf("%s: %d keys, %d calls, %d effects ended while the server was down for %s",
				mode, len(attempts), run.calls.Load(), straddled, up.Sub(down).Round(time.Millisecond))
		})
	}
}

// restartRun is the callers of one TestServerRestartRunsNoEffectTwice subtest.
type restartRun struct {
	namespace string
	calls     atomic.Int64 // calls that returned without error
	next      atomic.Int64 // the next key to deliver
	stop      chan struct{}
	stopOnce  sync.Once
	wg        sync.WaitGroup

	mu      sync.Mutex
	effects map[string]int       // how many times each key's effect ran
	fnEnded map[string]time.Time // when each key's effect last returned
	// mismatches are redeliveries that did not return the first delivery's value.
	mismatches []string
}

// start starts restartWorkers callers, each delivering new keys until stopAndWait. When
// the test ends before that, its cleanup ends the calls under way and waits for them.
func (r *restartRun) start(t *testing.T, coord *pgidem.Coordinator) {
	r.stop = make(chan struct{})
	r.fnEnded = map[string]time.Time{}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		r.stopAndWait()
	})
	for range restartWorkers {
		r.wg.Go(func() {
			for {
				select {
				case <-r.stop:
					return
				default:
				}
				key := fmt.Sprintf("k%d", r.next.Add(1))
				want := r.deliver(ctx, coord, key)
				if got := r.deliver(ctx, coord, key); got != want { // a redelivery replays
					r.mu.Lock()
					r.mismatches = append(r.mismatches, fmt.Sprintf("%s: redelivery returned %q, the first delivery %q", key, got, want))
					r.mu.Unlock()
				}
			}
		})
	}
}

// deliver calls Do on key until a call returns without error, as an at-least-once
// consumer redelivers a message whose handling failed, and returns the call's value ("" once
// ctx ended).
func (r *restartRun) deliver(ctx context.Context, coord *pgidem.Coordinator, key string) string {
	for ctx.Err() == nil {
		v, err := pgidem.Do(ctx, coord, r.namespace, key, testTTL, &pgidem.DoOpts{}, func(ctx context.Context) (string, error) {
			r.mu.Lock()
			r.effects[key]++
			n := r.effects[key]
			r.mu.Unlock()
			time.Sleep(20 * time.Millisecond) // the effect takes a while
			r.mu.Lock()
			r.fnEnded[key] = time.Now()
			r.mu.Unlock()
			return fmt.Sprintf("%s#%d", key, n), nil
		})
		if err == nil {
			r.calls.Add(1)
			return v
		}
		time.Sleep(20 * time.Millisecond)
	}
	return ""
}

// waitCalls waits until at least n calls returned without error.
func (r *restartRun) waitCalls(t *testing.T, n int64) {
	t.Helper()
	require.Eventually(t, func() bool { return r.calls.Load() >= n }, 2*time.Minute, 10*time.Millisecond)
}

// stopAndWait stops the callers once their current key is delivered and waits for them.
func (r *restartRun) stopAndWait() {
	r.stopOnce.Do(func() { close(r.stop) })
	r.wg.Wait()
}
