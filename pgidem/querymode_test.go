package pgidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// TestEveryQueryExecMode runs the statements that write JSON (a completion alone and in a
// shared round, a stored failure, DoTx's record, an inbox payload) and the replays that
// read it back on a pool set to each of pgx's query modes. Pools in front of PgBouncer
// commonly use QueryExecModeExec or the simple protocol, where pgx types a parameter by
// its Go type: JSON sent as []byte would arrive as bytea, which jsonb does not read.
func TestEveryQueryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
			// A lease long enough that a busy machine's slow commits do not lose it.
			coord := b.newCoordOn(t, pool, &pgidem.Config{Lease: 3 * time.Second})
			ctx := b.ctx
			value := map[string]any{"id": "em_1", "text": "naïve ☃ 'quoted' \"double\" \\ {a,b} NULL", "n": 1.5}

			// A completion alone, then its replay.
			for range 2 {
				got, err := pgidem.Do(ctx, coord, "mail", "alone", testTTL, nil, func(context.Context) (map[string]any, error) { return value, nil })
				require.NoError(t, err)
				require.Equal(t, value, got)
			}

			// A slow effect: it runs until the heartbeat (every second) has renewed its lease
			// once in this mode.
			_, err := pgidem.Do(ctx, coord, "mail", "slow", testTTL, nil, func(ctx context.Context) (int, error) {
				leaseEnd := func() (end time.Time) {
					require.NoError(t, b.db.Pool.QueryRow(ctx,
						`SELECT lease_expires_at FROM pgidem_record WHERE namespace = 'mail' AND key = 'slow'`).Scan(&end))
					return end
				}
				granted := leaseEnd()
				deadline := time.After(30 * time.Second) // failure cap, not a timing assertion
				for {
					select {
					case <-time.After(50 * time.Millisecond):
						if leaseEnd().After(granted) {
							return 1, nil
						}
					case <-deadline:
						return 0, errors.New("the lease was never renewed")
					case <-ctx.Done():
						return 0, context.Cause(ctx)
					}
				}
			})
			require.NoError(t, err, "the heartbeat renewed the lease")

			// Completions sharing rounds.
			done := make(chan error, 8)
			for i := range 8 {
				go func() {
					_, err := pgidem.Do(ctx, coord, "mail", "shared-"+string(rune('a'+i)), testTTL, nil,
						func(context.Context) (map[string]any, error) { return value, nil })
					done <- err
				}()
			}
			for range 8 {
				require.NoError(t, <-done)
			}
			rec := b.lookup(t, "mail", "shared-c")
			var stored map[string]any
			require.NoError(t, json.Unmarshal(rec.Result, &stored))
			require.Equal(t, value, stored)

			// A permanent failure, stored and replayed.
			declined := errors.New("card declined: naïve ☃")
			for range 2 {
				_, err := pgidem.Do(ctx, coord, "mail", "failed", testTTL, nil, func(context.Context) (int, error) { return 0, pgidem.Permanent(declined) })
				require.ErrorIs(t, err, pgidem.ErrPermanent)
				require.ErrorContains(t, err, declined.Error())
			}

			// DoTx's record, committed with the caller's transaction, then replayed.
			for range 2 {
				tx, err := pool.Begin(ctx)
				require.NoError(t, err)
				got, err := pgidem.DoTx(ctx, coord, tx, "ledger", "tx", testTTL, nil, func(context.Context, pgx.Tx) (map[string]any, error) { return value, nil })
				require.NoError(t, err)
				require.Equal(t, value, got)
				require.NoError(t, tx.Commit(ctx))
			}

			// An inbox row with a payload.
			payload := json.RawMessage(`{"event":"order.created","note":"naïve ☃"}`)
			handled, err := coord.InboxHandle(ctx, "consumer", "evt-1", &pgidem.InboxOpts{Payload: payload}, func(context.Context, pgx.Tx) error { return nil })
			require.NoError(t, err)
			require.True(t, handled)
			var n int
			require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pgidem_inbox WHERE payload = $1::jsonb`, string(payload)).Scan(&n))
			require.Equal(t, 1, n)
		})
	}
}
