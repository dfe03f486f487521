package pgidem_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// Many concurrent calls, several per key, batched or not: each key's effect runs once and
// every caller gets its value.
func TestDoConcurrentCallsShareRoundsAndRunEachEffectOnce(t *testing.T) {
	for _, maxBatch := range []int{0, 1} {
		t.Run(fmt.Sprintf("MaxBatch=%d", maxBatch), func(t *testing.T) {
			b := setup(t, nil)
			// Enough connections that the calls really overlap.
			pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 16 })
			coord := b.newCoordOn(t, pool, &pgidem.Config{MaxBatch: maxBatch})

			const keys, callersPerKey = 12, 6
			var runs [keys]atomic.Int32
			start := make(chan struct{})
			type outcome struct {
				key   int
				value string
				res   pgidem.Result[string]
				err   error
			}
			outcomes := make(chan outcome, keys*callersPerKey)
			var wg sync.WaitGroup
			for i := range keys * callersPerKey {
				k := i % keys
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					opts := &pgidem.DoOpts{ReserveFirst: i%2 == 0} // both ways into the insert
					res, err := pgidem.DoResult(b.ctx, coord, "conc", fmt.Sprintf("key-%d", k), testTTL, opts,
						func(context.Context) (string, error) {
							n := runs[k].Add(1)
							return fmt.Sprintf("value-%d-run-%d", k, n), nil
						})
					outcomes <- outcome{key: k, value: res.Value, res: res, err: err}
				}()
			}
			close(start)
			wg.Wait()
			close(outcomes)

			values := map[int]map[string]int{}
			for o := range outcomes {
				require.NoError(t, o.err, "key %d", o.key)
				require.Equal(t, 1, o.res.Attempts)
				if values[o.key] == nil {
					values[o.key] = map[string]int{}
				}
				values[o.key][o.value]++
			}
			for k := range keys {
				require.Equal(t, int32(1), runs[k].Load(), "key %d: the effect ran once", k)
				require.Equal(t, map[string]int{fmt.Sprintf("value-%d-run-1", k): callersPerKey}, values[k],
					"key %d: every caller got the one run's value", k)
				rec := b.lookup(t, "conc", fmt.Sprintf("key-%d", k))
				require.Equal(t, pgidem.StatusCompleted, rec.Status)
				require.Equal(t, 1, rec.Attempts)
			}
		})
	}
}

// A call whose key is blocked behind an open DoTx waits alone: calls on other keys, which
// may share its round, finish while that transaction is still open.
func TestDoBesideAnOpenDoTxIsNotHeldUp(t *testing.T) {
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 24 })
	coord := b.newCoordOn(t, pool, nil)

	// DoTx has written its record for "held" in tx, which stays open.
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = pgidem.DoTx(b.ctx, coord, tx, "side", "held", testTTL, nil, func(context.Context, pgx.Tx) (string, error) {
		return "from-dotx", nil
	})
	require.NoError(t, err)

	// A Do on the held key, reserving first so its insert meets the uncommitted record, and
	// around it many calls on other keys.
	heldDone := make(chan error, 1)
	var heldValue string
	go func() {
		var err error
		heldValue, err = pgidem.Do(b.ctx, coord, "side", "held", testTTL, &pgidem.DoOpts{ReserveFirst: true},
			func(context.Context) (string, error) { return "from-do", nil })
		heldDone <- err
	}()
	// Start the others only once that call is waiting on tx's lock in the database.
	require.Eventually(t, func() bool {
		var waiting int
		err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting > 0
	}, 30*time.Second, 5*time.Millisecond)
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := pgidem.Do(b.ctx, coord, "side", fmt.Sprintf("free-%d", i), testTTL, &pgidem.DoOpts{ReserveFirst: true},
				func(context.Context) (int, error) { return i, nil })
			errs <- err
		}()
	}
	wg.Wait() // with tx still open: a round stuck behind it would never let these finish
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	select {
	case err := <-heldDone:
		t.Fatalf("the call on the held key finished while the DoTx transaction was open: %v", err)
	default:
	}

	require.NoError(t, tx.Commit(b.ctx))
	require.NoError(t, <-heldDone)
	require.Equal(t, "from-dotx", heldValue, "the held key replays the DoTx's value")
}
