package protocol

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgidem/pgidem/internal/store"
)

// detachedConn acquires a pool connection for a write that must finish once sent: the
// write runs on wctx, detached from ctx and bounded by FinishTimeout (counted from this
// call), until cancel. Waiting for a free connection sends nothing, so unless mustFinish
// that wait also ends with ctx: err is then a *notHeldError holding ctx's error. A wait
// that outlasts FinishTimeout, or a connection that cannot be made, returns a
// *notHeldError holding the pool's error, or with mustFinish (an earlier write may have
// reserved) the pool's error itself. The caller releases conn.
func (c *Engine) detachedConn(ctx context.Context, mustFinish bool) (wctx context.Context, cancel context.CancelFunc, conn *pgxpool.Conn, err error) {
	wctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	actx := wctx
	if !mustFinish {
		deadline, _ := wctx.Deadline()
		var cancelWait context.CancelFunc
		actx, cancelWait = context.WithDeadline(ctx, deadline)
		defer cancelWait()
	}
	conn, err = c.poolConn(actx)
	switch {
	case err == nil:
		return wctx, cancel, conn, nil
	case mustFinish:
		// An earlier write may have committed: this call may hold a reservation.
		cancel()
		return nil, nil, nil, err
	case ctx.Err() != nil:
		cancel()
		return nil, nil, nil, &notHeldError{err: ctx.Err(), callerEnded: true}
	}
	cancel()
	return nil, nil, nil, &notHeldError{err: err}
}

// poolConn acquires a connection of the pool. When ctx's deadline passes first, the error
// says that no connection became free, since the usual cause is the application's (calls
// holding connections while they call pgidem), not the server's.
func (c *Engine) poolConn(ctx context.Context) (*pgxpool.Conn, error) {
	conn, err := c.pool.Acquire(ctx)
	// (A pool with connections to spare also times out while a new one is being dialled to
	// a server that does not answer: that is the server's doing.)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		return conn, err
	}
	if st := c.pool.Stat(); st.AcquiredConns() >= st.MaxConns() {
		err = fmt.Errorf("%w (waiting for a connection: none of the pool's %d became free in time; size the pool "+
			"above the calls that hold a connection while they call pgidem, such as InboxHandle or DoTx "+
			"transactions calling Do)", err, st.MaxConns())
	}
	return conn, err
}

// heldConn is a pool connection a call keeps for its next statements (nil conn: none),
// and the pool. Once a statement failed on the connection, it is given back and the pool
// serves the rest: the connection may be broken, and with every other connection in use
// a retry on the pool would wait for this one.
type heldConn struct {
	pool *pgxpool.Pool
	conn *pgxpool.Conn
}

// q returns where the next statement runs.
func (h *heldConn) q() store.Executor {
	if h.conn != nil {
		return h.conn
	}
	return h.pool
}

// release gives the connection back, if still held; statements then run on the pool.
func (h *heldConn) release() {
	if h.conn != nil {
		h.conn.Release()
		h.conn = nil
	}
}
