package pgidem_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	"github.com/pgidem/pgidem/pgidem"
)

// clusterPool starts a throwaway cluster of tb's own (internal/pgcluster), migrates it and
// returns it with a pool of at most maxConns connections on it, closed at cleanup.
func clusterPool(tb testing.TB, maxConns int32) (*pgcluster.Cluster, *pgxpool.Pool) {
	tb.Helper()
	ctx := context.Background()
	cluster := pgcluster.Start(tb)
	db, err := migrations.OpenDB(cluster.URL(), "")
	require.NoError(tb, err)
	_, err = migrations.Up(ctx, db, nil)
	require.NoError(tb, err)
	require.NoError(tb, db.Close())
	cfg, err := pgxpool.ParseConfig(cluster.URL())
	require.NoError(tb, err)
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(tb, err)
	tb.Cleanup(pool.Close)
	return cluster, pool
}

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

// acquireSignal is a pool tracer (pgxpool.AcquireTracer; pgx.QueryTracer only because
// ConnConfig.Tracer must be one) that calls onAcquire when an Acquire of the pool starts,
// with the acquire's context: a test can then act once a call is waiting for a connection,
// instead of sleeping and hoping it is.
type acquireSignal struct {
	onAcquire func(ctx context.Context)
}

func (a *acquireSignal) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	if a.onAcquire != nil {
		a.onAcquire(ctx)
	}
	return ctx
}

func (*acquireSignal) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {}

func (*acquireSignal) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (*acquireSignal) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// transitionObserver collects a coordinator's hook events and JSON log records.
type transitionObserver struct {
	mu     sync.Mutex
	events []pgidem.Event
	logs   bytes.Buffer
}

func (o *transitionObserver) config(cfg pgidem.Config) *pgidem.Config {
	cfg.Hook = pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.events = append(o.events, e)
	})
	cfg.Logger = slog.New(slog.NewJSONHandler(&syncWriter{w: &o.logs, mu: &o.mu}, nil))
	return &cfg
}

// kinds returns the kinds of the events reported for namespace.
func (o *transitionObserver) kinds(namespace string) []pgidem.EventKind {
	o.mu.Lock()
	defer o.mu.Unlock()
	var kinds []pgidem.EventKind
	for _, e := range o.events {
		if e.Namespace == namespace {
			kinds = append(kinds, e.Kind)
		}
	}
	return kinds
}

// count returns how many events of kind were reported for namespace.
func (o *transitionObserver) count(namespace string, kind pgidem.EventKind) int {
	n := 0
	for _, k := range o.kinds(namespace) {
		if k == kind {
			n++
		}
	}
	return n
}

// loggedContaining returns the messages logged at level about namespace/key that
// contain want.
func (o *transitionObserver) loggedContaining(t *testing.T, level slog.Level, namespace, key, want string) []string {
	t.Helper()
	o.mu.Lock()
	logs := slices.Clone(o.logs.Bytes())
	o.mu.Unlock()
	var msgs []string
	sc := bufio.NewScanner(bytes.NewReader(logs))
	for sc.Scan() {
		var rec struct {
			Level, Msg, Namespace, Key string
		}
		require.NoError(t, json.Unmarshal(sc.Bytes(), &rec))
		if rec.Level == level.String() && rec.Namespace == namespace && rec.Key == key && strings.Contains(rec.Msg, want) {
			msgs = append(msgs, rec.Msg)
		}
	}
	require.NoError(t, sc.Err())
	return msgs
}

// requireLogged asserts that a message containing want was logged at level about
// namespace/key.
func (o *transitionObserver) requireLogged(t *testing.T, level slog.Level, namespace, key, want string) {
	t.Helper()
	require.NotEmpty(t, o.loggedContaining(t, level, namespace, key, want),
		"no %s log containing %q about %s/%s; logs:\n%s", level, want, namespace, key, o.logText())
}

func (o *transitionObserver) logText() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.logs.String()
}

type syncWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// countStoreErrors returns a coordinator with config (nil: defaults) whose
// EventStoreErrors are counted.
func (b *testBundle) countStoreErrors(t *testing.T, config *pgidem.Config) (*pgidem.Coordinator, *atomic.Int64) {
	t.Helper()
	var cfg pgidem.Config
	if config != nil {
		cfg = *config
	}
	var n atomic.Int64
	cfg.Hook = pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventStoreError {
			n.Add(1)
		}
	})
	return b.newCoord(t, &cfg), &n
}

// createLedger creates the table the transactional tests write their effect to.
func (b *testBundle) createLedger(t *testing.T) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, ref text NOT NULL)`)
	require.NoError(t, err)
}

// ledgerRows counts the ledger rows for ref as seen outside any transaction.
func (b *testBundle) ledgerRows(t *testing.T, ref string) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM ledger WHERE ref = $1`, ref).Scan(&n))
	return n
}

func (b *testBundle) begin(t *testing.T) pgx.Tx {
	t.Helper()
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// requireUsable asserts that tx has not been aborted.
func requireUsable(t *testing.T, ctx context.Context, tx pgx.Tx) {
	t.Helper()
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one), "the caller's transaction must stay usable")
}

// waitForBlocked waits until n backends of the test database wait for a lock of the given
// type ("advisory", "transactionid"): a condition, not a timing assumption.
func (b *testBundle) waitForBlocked(t *testing.T, lockType string, n int) {
	t.Helper()
	b.waitForLocks(t, lockType, false, n)
}

// waitForLocks waits until n locks of the given type are granted (or, with granted false,
// waited for) by backends of the test database.
func (b *testBundle) waitForLocks(t *testing.T, lockType string, granted bool, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var count int
		err := b.db.Pool.QueryRow(b.ctx, `
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted = $2 AND l.locktype = $1 AND a.datname = current_database()`, lockType, granted).Scan(&count)
		return err == nil && count >= n
	}, 30*time.Second, 5*time.Millisecond)
}

// insertDeadHolder writes a dead holder's in-progress row (lease expired, record live).
func (b *testBundle) insertDeadHolder(t *testing.T, ns, key string, fingerprint []byte) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, fingerprint, lease_expires_at, expires_at)
		VALUES ($1, $2, 'in_progress', gen_random_uuid(), 1, $3, now() - interval '1 second', now() + interval '1 hour')`,
		ns, key, fingerprint)
	require.NoError(t, err)
}

// lostReplyConn passes a connection's traffic through, except that after the client sent a
// message containing marker (the first time, across all connections of its dialer) it
// lets the server run and commit the statement, then closes the connection and discards
// the reply: a write that committed but whose reply was lost.
type lostReplyConn struct {
	net.Conn
	d    *lostReplyDialer
	lost atomic.Bool // the marked message was sent: every read from now on fails
}

type lostReplyDialer struct {
	marker []byte
	fired  atomic.Bool
	// unsent, when set, closes the connection instead of sending the marked message: a
	// write that fails on a broken connection, with nothing applied.
	unsent bool
}

func (c *lostReplyConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, c.d.marker) && c.d.fired.CompareAndSwap(false, true) {
		if c.d.unsent {
			_ = c.Conn.Close()
			return 0, net.ErrClosed
		}
		c.lost.Store(true)
	}
	return c.Conn.Write(p)
}

func (c *lostReplyConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.lost.Load() {
		time.Sleep(300 * time.Millisecond) // the server runs and commits the statement
		_ = c.Conn.Close()
		return 0, net.ErrClosed
	}
	return n, err
}

func (d *lostReplyDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &lostReplyConn{Conn: conn, d: d}, nil
}

// dialerPool returns a pool on the bundle's database whose connections d makes, sending
// statements with their text each time and without TLS, so d sees them on the wire;
// configure (which may be nil) adjusts the rest of its config.
func (b *testBundle) dialerPool(t *testing.T, d *lostReplyDialer, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	return b.newPool(t, func(cfg *pgxpool.Config) {
		if configure != nil {
			configure(cfg)
		}
		cfg.ConnConfig.DialFunc = d.dial
		cfg.ConnConfig.TLSConfig = nil
		cfg.ConnConfig.Fallbacks = nil
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	})
}

// insertRecord writes a record row directly. lease and expires are SQL expressions.
func insertRecord(t *testing.T, b *testBundle, key, status, lease, expires string, fingerprint []byte) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, fingerprint, result, lease_expires_at, expires_at)
		VALUES ('mail', $1, $2, gen_random_uuid(), 1, $3,
			CASE WHEN $2 = 'completed' THEN '"old"'::jsonb END, `+lease+`, `+expires+`)`,
		key, status, fingerprint)
	require.NoError(t, err)
}

// waitLockBlocked waits until n backends of the test database wait for a heavyweight lock
// (a row lock or another transaction): a condition, not a timing assumption.
func waitLockBlocked(t *testing.T, b *testBundle, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting int
		err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting >= n
	}, 30*time.Second, 5*time.Millisecond)
}

func raiseOpts() *pgidem.DoOpts { return &pgidem.DoOpts{InFlight: pgidem.InFlightRaise} }

// assertNoErr is require.NoError for goroutines other than the test's (no FailNow).
func assertNoErr(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("unexpected error: %v", err)
	}
}

func returnOne(context.Context) (int, error) { return 1, nil }

// fuzzBundle returns a fresh database and a coordinator on it for a fuzz target: one per
// process, which every input of that process shares.
func fuzzBundle(f *testing.F) *testBundle {
	f.Helper()
	db := testdb.New(f)
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	require.NoError(f, err)
	return &testBundle{db: db, coord: coord, ctx: context.Background()}
}
