package protocol

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// readRes is what the read found: the record (pgx.ErrNoRows as the item's error when there
// is none) and whether it is finished.
type readRes struct {
	row      store.Row
	finished bool
}

// probe reads what deciding and replaying need of cl's record: what a replay needs in
// one read, and a record that is not finished (in progress, expired) in full by a second;
// once cl found one so, its later reads (a waiter's polls) are the full read alone.
// Concurrent first reads share rounds (c.reads, leadReads). Each read, with its wait for a
// pool connection, is bounded by FinishTimeout: a pool with no connection to spare (its
// holders waiting on each other) fails the call instead of blocking it for as long as ctx
// allows, which may be for ever.
func (c *Engine) probe(ctx context.Context, cl *Call) (store.Row, error) {
	if !cl.readInFull && c.config.MaxBatch > 1 {
		res, err := c.reads.do(ctx, cl)
		if err != errBatchFallback { // else the round failed: read alone
			if err != nil || res.finished {
				return res.row, err
			}
			cl.readInFull = true
		}
	}
	return c.readAlone(ctx, cl)
}

// readAlone reads cl's record on a connection of its own: the slim read, unless cl reads in
// full already, and the full one (Lookup) when the record is not finished.
func (c *Engine) readAlone(ctx context.Context, cl *Call) (store.Row, error) {
	rctx, cancel := context.WithTimeout(ctx, c.config.FinishTimeout)
	defer cancel()
	conn, err := c.poolConn(rctx)
	if err != nil {
		return store.Row{}, err
	}
	defer conn.Release()
	var res readRes
	if !cl.readInFull {
		res, err = c.readSlim(rctx, conn, cl)
	}
	if err == nil && !res.finished {
		cl.readInFull = true
		res.row = store.Row{} // a row deleted meanwhile reads as none: pgx.ErrNoRows
		err = conn.QueryRow(rctx, c.sql.Lookup, cl.namespace, cl.key).Scan(res.row.ScanTargets(false)...)
	}
	return res.row, err
}

// readSlim runs the slim read of cl's record (Probe) on q.
func (c *Engine) readSlim(ctx context.Context, q store.Executor, cl *Call) (readRes, error) {
	var res readRes
	err := q.QueryRow(ctx, c.sql.Probe, cl.namespace, cl.key).Scan(res.row.ProbeTargets(&res.finished)...)
	return res, err
}

// leadReads runs one round of first reads: the single-key read for one, the array read for
// more. ctx is the leader's: the wait for a connection ends with it or after
// FinishTimeout, as a read alone does, and sends nothing, so those queued stay queued for
// the next of them to lead (a wait that outlasts FinishTimeout also fails the members
// queued as long). A round of more than one runs on a context detached from the leader's,
// with a deadline FinishTimeout after its wait began, so neither the leader's cancellation
// nor its deadline fails anybody else's read. Any failure of such a round (a panic
// included) sends its members to reads of their own.
func (c *Engine) leadReads(ctx context.Context, leader *batchItem[*Call, readRes], take func(time.Duration) []*batchItem[*Call, readRes]) {
	deadline := time.Now().Add(c.config.FinishTimeout)
	rctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	conn, err := c.poolConn(rctx)
	if err != nil {
		leader.err = err
		if ctx.Err() == nil {
			for _, it := range take(c.config.FinishTimeout) {
				it.err = err
			}
		}
		return
	}
	defer conn.Release()
	members := take(0)
	start := time.Now()
	if len(members) == 0 {
		leader.res, leader.err = c.readSlim(rctx, conn, leader.req)
		if c.config.Round != nil { // the detached context only when someone observes
			if err = leader.err; errors.Is(err, pgx.ErrNoRows) { // no record: the read succeeded
				err = nil
			}
			c.observeRound(context.WithoutCancel(ctx), RoundRead, 1, time.Since(start), err)
		}
		return
	}
	items := append([]*batchItem[*Call, readRes]{leader}, members...)
	dctx, dcancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer dcancel()
	n := len(items)
	namespaces, keys := make([]string, n), make([]string, n)
	for i, it := range items {
		namespaces[i], keys[i] = it.req.namespace, it.req.key
	}
	err = c.inRound(dctx, conn, c.sql.ProbeMany, []any{namespaces, keys, 1, n}, func(rows pgx.Rows) error {
		var res readRes
		return scanOrdinals(rows, n, res.row.ProbeTargets(&res.finished), func(i int) { items[i].res, items[i].err = res, nil })
	})
	c.observeRound(dctx, RoundRead, n, time.Since(start), err)
	for _, it := range items {
		switch {
		case err != nil:
			it.res, it.err = readRes{}, errBatchFallback
		case it.err == errBatchFallback: // the statement returned no row for it
			it.err = pgx.ErrNoRows
		}
	}
}
