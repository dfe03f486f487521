package pgidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/pgidem"
)

// poolerCallers is how many goroutines call at once through the pooler.
const poolerCallers = 16

// poolerBundle is a coordinator whose pool goes through PgBouncer in transaction pooling
// mode, and an effect table written through the same pool.
type poolerBundle struct {
	*testBundle
	pool  *pgxpool.Pool
	coord *pgidem.Coordinator
}

// setupPooler returns a fresh database and a coordinator reaching it through PgBouncer with
// pgx's query mode set to mode.
func setupPooler(t *testing.T, mode string) *poolerBundle {
	t.Helper()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE effect (kind text NOT NULL, key text NOT NULL, caller int NOT NULL)`)
	require.NoError(t, err)
	cfg, err := pgxpool.ParseConfig(pgbouncer.URL(t, b.db.URL, mode))
	require.NoError(t, err)
	cfg.MaxConns = 2 * poolerCallers // more clients than the pooler has server connections
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return &poolerBundle{testBundle: b, pool: pool, coord: b.newCoordOn(t, pool, &pgidem.Config{Lease: 5 * time.Second, FinishTimeout: 30 * time.Second, PollOnly: true})}
}

// effectsPerKey returns, for kind, how many effects ran per key.
func (b *poolerBundle) effectsPerKey(t *testing.T, kind string) map[string]int {
	t.Helper()
	rows, err := b.db.Pool.Query(b.ctx, `SELECT key, count(*) FROM effect WHERE kind = $1 GROUP BY key`, kind)
	require.NoError(t, err)
	counts := map[string]int{}
	for rows.Next() {
		var key string
		var n int
		require.NoError(t, rows.Scan(&key, &n))
		counts[key] = n
	}
	require.NoError(t, rows.Err())
	return counts
}

// requireOncePerKey checks that each of keys had its effect of kind run exactly once.
func (b *poolerBundle) requireOncePerKey(t *testing.T, kind string, keys []string) {
	t.Helper()
	counts := b.effectsPerKey(t, kind)
	require.Len(t, counts, len(keys), "%s: effects of unknown keys", kind)
	for _, key := range keys {
		require.Equal(t, 1, counts[key], "%s: effects of key %s", kind, key)
	}
}

// allCallers runs call for every (caller, key) pair, poolerCallers callers at once, each
// going through keys in its own order, and returns the first error.
func allCallers(keys []string, call func(caller int, key string) error) error {
	errs := make(chan error, poolerCallers)
	var wg sync.WaitGroup
	for caller := range poolerCallers {
		wg.Go(func() {
			for i := range keys {
				key := keys[(i+caller*7)%len(keys)] // callers meet on keys at different moments
				if err := call(caller, key); err != nil {
					errs <- fmt.Errorf("caller %d, key %s: %w", caller, key, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func keysN(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return keys
}

// Behind PgBouncer in transaction pooling, with pgx's exec mode or the simple protocol,
// Do, DoTx, DoInTx, the inbox and Sweep work: 16 concurrent callers over many keys run
// every effect once and all get the value it returned.
func TestPooler(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			t.Run("Do", func(t *testing.T) { poolerDo(t, setupPooler(t, mode)) })
			t.Run("DoTx", func(t *testing.T) { poolerDoTx(t, setupPooler(t, mode)) })
			t.Run("DoInTx", func(t *testing.T) { poolerDoInTx(t, setupPooler(t, mode)) })
			t.Run("Inbox", func(t *testing.T) { poolerInbox(t, setupPooler(t, mode)) })
			t.Run("Sweep", func(t *testing.T) { poolerSweep(t, setupPooler(t, mode)) })
		})
	}
}

func poolerDo(t *testing.T, b *poolerBundle) {
	keys := keysN("do", 40)
	type value struct {
		Key    string `json:"key"`
		Caller int    `json:"caller"`
	}
	var mu sync.Mutex
	got := map[string]map[value]bool{}
	err := allCallers(keys, func(caller int, key string) error {
		v, err := pgidem.Do(b.ctx, b.coord, "mail", key, testTTL, nil, func(ctx context.Context) (value, error) {
			if _, err := b.pool.Exec(ctx, `INSERT INTO effect (kind, key, caller) VALUES ('do', $1, $2)`, key, caller); err != nil {
				return value{}, err
			}
			return value{Key: key, Caller: caller}, nil
		})
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if got[key] == nil {
			got[key] = map[value]bool{}
		}
		got[key][v] = true
		return nil
	})
	require.NoError(t, err)
	b.requireOncePerKey(t, "do", keys)
	for _, key := range keys {
		require.Len(t, got[key], 1, "every caller of %s got the same value", key)
		rec := b.lookup(t, "mail", key)
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
		var stored value
		require.NoError(t, json.Unmarshal(rec.Result, &stored))
		require.True(t, got[key][stored], "the stored value is the one returned")
	}
}

func poolerDoTx(t *testing.T, b *poolerBundle) {
	keys := keysN("dotx", 20)
	err := allCallers(keys, func(caller int, key string) error {
		return pgx.BeginFunc(b.ctx, b.pool, func(tx pgx.Tx) error {
			_, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", key, testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effect (kind, key, caller) VALUES ('dotx', $1, $2)`, key, caller)
				return caller, err
			})
			return err
		})
	})
	require.NoError(t, err)
	b.requireOncePerKey(t, "dotx", keys)
}

func poolerDoInTx(t *testing.T, b *poolerBundle) {
	keys := keysN("dointx", 20)
	err := allCallers(keys, func(caller int, key string) error {
		_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", key, testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effect (kind, key, caller) VALUES ('dointx', $1, $2)`, key, caller)
			return caller, err
		})
		return err
	})
	require.NoError(t, err)
	b.requireOncePerKey(t, "dointx", keys)
}

func poolerInbox(t *testing.T, b *poolerBundle) {
	keys := keysN("msg", 20)
	var mu sync.Mutex
	handled := map[string]int{}
	err := allCallers(keys, func(caller int, key string) error {
		ok, err := b.coord.InboxHandle(b.ctx, "billing", key, nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effect (kind, key, caller) VALUES ('inbox', $1, $2)`, key, caller)
			return err
		})
		if ok {
			mu.Lock()
			handled[key]++
			mu.Unlock()
		}
		return err
	})
	require.NoError(t, err)
	b.requireOncePerKey(t, "inbox", keys)
	for _, key := range keys {
		require.Equal(t, 1, handled[key], "one caller reports %s handled", key)
	}
}

func poolerSweep(t *testing.T, b *poolerBundle) {
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, expires_at)
		SELECT 'mail', 'old-' || i, 'completed', gen_random_uuid(), now() - interval '1 hour' FROM generate_series(1, 250) i`)
	require.NoError(t, err)
	for i := range 30 {
		b.insertExpiredInbox(t, "billing", fmt.Sprintf("old-%d", i))
	}
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)

	// Two sweeps at once, in small batches, split the rows between them.
	results := make(chan *pgidem.SweepResult, 2)
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			res, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 20})
			results <- res
			errs <- err
		}()
	}
	var total pgidem.SweepResult
	for range 2 {
		require.NoError(t, <-errs)
		res := <-results
		total.Records += res.Records
		total.Inbox += res.Inbox
	}
	require.Equal(t, pgidem.SweepResult{Records: 250, Inbox: 30}, total)
	require.Equal(t, 1, b.count(t), "the live record stays")
}

// With pgx's default query mode behind a transaction pooler, the statement cache of one
// client meets the prepared statements another left on the shared server connection; the
// store error names the cause and the fix. Two pools take turns on the pooler's one busy
// server connection, so the clash is certain.
func TestPoolerDefaultQueryModeHint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	url := pgbouncer.URL(t, b.db.URL, "")
	coord := func() *pgidem.Coordinator {
		cfg, err := pgxpool.ParseConfig(url)
		require.NoError(t, err)
		cfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		// Each call starts with the indexed read, a statement the cache prepares (the
		// reserving insert of a shared round is planned for each execution instead).
		return b.newCoordOn(t, pool, &pgidem.Config{Order: pgidem.OrderReadFirst})
	}
	first, second := coord(), coord()

	ran := 0
	fn := func(context.Context) (int, error) { ran++; return ran, nil }
	_, err := pgidem.Do(b.ctx, first, "mail", "a", testTTL, nil, fn)
	require.NoError(t, err, "the first client prepares its statements on the server connection")
	_, err = pgidem.Do(b.ctx, second, "mail", "b", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	var storeErr *pgidem.StoreError
	require.True(t, errors.As(err, &storeErr))
	require.Contains(t, err.Error(), "already exists")
	require.Contains(t, err.Error(), "transaction-pooling proxy such as PgBouncer")
	require.Contains(t, err.Error(), "default_query_exec_mode=exec (or simple_protocol)")
	require.Equal(t, 1, ran, "fn did not run without a reservation")

	// The same for DoInTx's statements, prepared first by the first client.
	txFn := func(context.Context, pgx.Tx) (int, error) { return 0, nil }
	_, err = pgidem.DoInTx(b.ctx, first, "ledger", "c", testTTL, nil, txFn)
	require.NoError(t, err)
	_, err = pgidem.DoInTx(b.ctx, second, "ledger", "d", testTTL, nil, txFn)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.Contains(t, err.Error(), "default_query_exec_mode=exec (or simple_protocol)")
}
