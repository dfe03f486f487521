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

	"github.com/pgidem/pgidem/pgidem"
)

// DoOpts.ReserveFirst changes the statements, not the protocol: the invariants hold.
func TestReserveFirst(t *testing.T) {
	t.Parallel()
	rf := func(o pgidem.DoOpts) *pgidem.DoOpts { o.ReserveFirst = true; return &o }

	t.Run("Replay", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		runs := 0
		fn := func(context.Context) (string, error) { runs++; return "em_1", nil }
		first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), fn)
		require.NoError(t, err)
		require.False(t, first.Replayed)
		second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), fn)
		require.NoError(t, err)
		require.True(t, second.Replayed)
		require.Equal(t, "em_1", second.Value)
		require.Equal(t, 1, runs)
	})

	t.Run("ConcurrentWait", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		const callers = 32
		var runs atomic.Int32
		values := make([]string, callers)
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range callers {
			wg.Go(func() {
				values[i], errs[i] = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), func(context.Context) (string, error) {
					n := runs.Add(1)
					time.Sleep(50 * time.Millisecond)
					return fmt.Sprintf("em_%d", n), nil
				})
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, runs.Load())
		for i := range callers {
			require.NoError(t, errs[i])
			require.Equal(t, "em_1", values[i])
		}
	})

	t.Run("FingerprintFromReservingStatement", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ok := func(context.Context) (int, error) { return 1, nil }
		_, err := pgidem.Do(b.ctx, b.coord, "fp", "k", testTTL, rf(pgidem.DoOpts{Fingerprint: []byte("A")}), ok)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "k", testTTL, rf(pgidem.DoOpts{Fingerprint: []byte("B")}), ok)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	})

	t.Run("ExpiredIsAbsent", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, result, expires_at)
			VALUES ('mail', 'k', 'completed', gen_random_uuid(), 3, '"old"', now() - interval '1 second')`)
		require.NoError(t, err)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), func(context.Context) (string, error) { return "new", nil })
		require.NoError(t, err)
		require.False(t, res.Replayed)
		require.Equal(t, 1, res.Attempts)
	})

	t.Run("FailOpenNeverBehindUncommittedRecord", func(t *testing.T) {
		t.Parallel()
		// With no read first, the blocked reserving insert is the first statement; it was
		// sent, so the store answered and FailOpen must not run fn.
		b := setup(t, &pgidem.Config{FinishTimeout: 300 * time.Millisecond, FailOpen: true})
		tx := b.begin(t)
		_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		require.NoError(t, err)
		var ran atomic.Bool
		_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}),
			func(context.Context) (string, error) { ran.Store(true); return "from-do", nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.False(t, ran.Load())
		require.NoError(t, tx.Rollback(b.ctx))
	})
}
