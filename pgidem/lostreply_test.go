package pgidem_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

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
}

func (c *lostReplyConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, c.d.marker) && c.d.fired.CompareAndSwap(false, true) {
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

// lostReplyPool returns a pool on the bundle's database whose first statement containing
// marker loses its reply. Statements are sent with their text each time (no statement
// cache) and without TLS, so the marker can be seen on the wire.
func (b *testBundle) lostReplyPool(t *testing.T, marker string) (*pgxpool.Pool, *lostReplyDialer) {
	t.Helper()
	d := &lostReplyDialer{marker: []byte(marker)}
	pool := b.newPool(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.DialFunc = d.dial
		cfg.ConnConfig.TLSConfig = nil
		cfg.ConnConfig.Fallbacks = nil
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	})
	return pool, d
}

// A release whose reply is lost after it committed is retried; the retry finds the first
// reservation already deleted, which is the release having worked, not a lost lease.
func TestReleaseLostReply(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool, d := b.lostReplyPool(t, "WITH deleted AS")
	var leaseLost atomic.Int32
	coord := b.newCoordOn(t, pool, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventLeaseLost {
			leaseLost.Add(1)
		}
	})})
	transient := errors.New("transient")
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 0, transient })
	require.ErrorIs(t, err, transient)
	require.True(t, d.fired.Load(), "the release's reply was lost")
	_, err = b.coord.Lookup(b.ctx, "mail", "k")
	require.ErrorIs(t, err, pgidem.ErrNotFound)
	require.Zero(t, leaseLost.Load(), "no lease was lost")
}

// The same for a release that keeps a taken-over reservation: repeating it leaves the row
// and its attempts as they were, so the takeover stays on record.
func TestKeptReleaseLostReply(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool, d := b.lostReplyPool(t, "WITH deleted AS")
	coord := b.newCoordOn(t, pool, nil)
	reviewInsert(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
	transient := errors.New("transient")
	res, err := pgidem.DoResult(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 0, transient })
	require.ErrorIs(t, err, transient)
	require.True(t, res.TookOver)
	require.True(t, d.fired.Load(), "the release's reply was lost")
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, 2, rec.Attempts)
	res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, reviewRaise(), func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	require.Equal(t, 3, res.Attempts)
}
