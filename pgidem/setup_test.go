package pgidem_test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// testTTL is a TTL valid under testConfig's MinTTL.
const testTTL = time.Hour

type testBundle struct {
	db    *testdb.DB
	coord *pgidem.Coordinator
	ctx   context.Context
}

// setup returns a fresh database and a coordinator on it; config may be nil.
func setup(t *testing.T, config *pgidem.Config) *testBundle {
	t.Helper()
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, config)
	require.NoError(t, err)
	return &testBundle{db: db, coord: coord, ctx: context.Background()}
}

// newCoord returns another coordinator on the bundle's database.
func (b *testBundle) newCoord(t *testing.T, config *pgidem.Config) *pgidem.Coordinator {
	t.Helper()
	coord, err := pgidem.NewCoordinator(b.db.Pool, config)
	require.NoError(t, err)
	return coord
}

// newCoordOn returns a coordinator on another pool.
func (b *testBundle) newCoordOn(t *testing.T, pool *pgxpool.Pool, config *pgidem.Config) *pgidem.Coordinator {
	t.Helper()
	coord, err := pgidem.NewCoordinator(pool, config)
	require.NoError(t, err)
	return coord
}

// downablePool returns a pool on the bundle's database that cannot open connections while
// down is true (as if the network or the server were gone); configure (which may be nil)
// adjusts the rest of its config.
func (b *testBundle) downablePool(t *testing.T, down *atomic.Bool, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	return b.newPool(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if down.Load() {
				return nil, errors.New("network unreachable")
			}
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}
		if configure != nil {
			configure(cfg)
		}
	})
}

// newPool returns another pool on the bundle's database, closed at cleanup, after
// configure (which may be nil) adjusted its config.
func (b *testBundle) newPool(t *testing.T, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func (b *testBundle) lookup(t *testing.T, namespace, key string) *pgidem.Record {
	t.Helper()
	rec, err := b.coord.Lookup(b.ctx, namespace, key)
	require.NoError(t, err)
	return rec
}

func (b *testBundle) count(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM pgidem_record").Scan(&n))
	return n
}

// holder is a Do call on a key whose fn blocks until released: the key stays in progress
// under a live lease meanwhile.
type holder struct {
	release chan struct{}
	// done receives Do's error once fn returned.
	done chan error
}

// hold starts Do(namespace, key) on coord with opts, whose fn returns value once
// unblock is called, and returns when fn has started.
func (b *testBundle) hold(coord *pgidem.Coordinator, namespace, key string, opts *pgidem.DoOpts, value string) *holder {
	h := &holder{release: make(chan struct{}), done: make(chan error, 1)}
	started := make(chan struct{})
	go func() {
		_, err := pgidem.Do(b.ctx, coord, namespace, key, testTTL, opts, func(context.Context) (string, error) {
			close(started)
			<-h.release
			return value, nil
		})
		h.done <- err
	}()
	<-started
	return h
}

// unblock lets the holder's fn return.
func (h *holder) unblock() { close(h.release) }

// insertExpiredInbox stores an inbox row for (consumer, messageID) whose retention ended a
// day ago.
func (b *testBundle) insertExpiredInbox(t *testing.T, consumer, messageID string) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		VALUES ($1, $2, now() - interval '8 days', now() - interval '1 day')`, consumer, messageID)
	require.NoError(t, err)
}
