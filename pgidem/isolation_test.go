package pgidem_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// TestStricterDefaultIsolation: on a pool whose sessions default to REPEATABLE READ (or
// SERIALIZABLE), concurrent callers of one key make the server refuse pgidem's own
// statements with serialization failures where READ COMMITTED would re-check the row. The
// callers read the key again: every call succeeds and each effect runs once.
func TestStricterDefaultIsolation(t *testing.T) {
	t.Parallel()
	for _, isolation := range []string{"repeatable read", "serializable"} {
		t.Run(isolation, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			pool := b.newPool(t, func(cfg *pgxpool.Config) {
				cfg.MaxConns = 20
				cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = isolation
			})
			for _, maxBatch := range []int{1, 64} {
				coord := b.newCoordOn(t, pool, &pgidem.Config{MaxBatch: maxBatch})
				var runs [5]atomic.Int32
				errs := make(chan error, 50)
				for i := range 50 {
					go func() {
						key := fmt.Sprintf("batch-%d-key-%d", maxBatch, i%5)
						_, err := pgidem.Do(b.ctx, coord, "mail", key, testTTL, nil, func(context.Context) (int, error) {
							runs[i%5].Add(1)
							return i % 5, nil
						})
						errs <- err
					}()
				}
				for range 50 {
					require.NoError(t, <-errs)
				}
				for k := range runs {
					require.EqualValues(t, 1, runs[k].Load(), "MaxBatch %d, key %d", maxBatch, k)
				}
			}
		})
	}
}
