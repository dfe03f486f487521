package pgidem

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Group commit for the two writes every fresh key makes: the reserving insert and the
// completion. Concurrent calls that reach one of them while the coordinator already has
// such a statement in flight queue up, and the next statement carries all of them (up to
// Config.MaxBatch) as arrays: one round trip and one commit for many keys. A call that
// finds nothing in flight runs at once, alone, with the single-key statement, so batching
// adds no latency when there is no concurrency and the sequential benchmarks are
// unchanged.
//
// No goroutine is started: the first caller of a round runs the statement for everyone
// queued ("leads") and then hands the lead to the first caller that queued meanwhile.
//
// Every round, even a round of one, runs under a short lock_timeout, so a key blocked
// behind another transaction's uncommitted record (an open DoTx) or row lock cannot hold up
// the rounds behind it: a round the server refuses for any reason (a lock timeout, a
// deadlock, a value one member's jsonb rejects) rolled back whole, and each of its members
// then runs its own single-key statement outside the batcher, exactly as without batching
// (and may wait there, alone).

// batchLockTimeout bounds how long a round waits for a lock before it gives up and its
// members run one by one.
const batchLockTimeout = "50ms"

// errBatchFallback tells a member to run its own single-key statement: its batch rolled
// back.
var errBatchFallback = errors.New("pgidem: batch rolled back; run alone")

// errRoundNotSent tells a member to run its own single-key statement: its round's leader
// gave up waiting for a pool connection (its context ended), so nothing was sent.
var errRoundNotSent = errors.New("pgidem: round not sent; run alone")

// batchItem is one caller's request in a batcher and, once its round ran, the outcome.
type batchItem[Req, Res any] struct {
	req  Req
	res  Res
	err  error
	wake chan bool // receives false when res and err are set, true when this caller leads the next round
}

// batcher groups concurrent requests for one statement. At most one round runs at a time:
// run is called by the leading caller with the requests of one round (the leader's first)
// and sets each item's res or err; an item left with errBatchFallback runs alone.
type batcher[Req, Res any] struct {
	max int // the most requests a round carries; 1: every call runs alone, at once
	run func(ctx context.Context, items []*batchItem[Req, Res])

	// size, when set, weighs a request in bytes, and a round takes queued requests only
	// while their sizes with the leader's stay within maxBytes (the leader's own always
	// goes): a round of completions carrying large results stays one value's size, not
	// max of them, in memory and on the wire.
	size     func(Req) int
	maxBytes int

	mu    sync.Mutex
	busy  bool                   // a round is running
	queue []*batchItem[Req, Res] // callers waiting for the next round; empty when !busy
}

// do queues req and returns its outcome once a round carried it. A caller that waits is not
// interrupted by its context: rounds run on a detached context bounded by FinishTimeout,
// like the single-key statements, so an outcome is always known. A caller waits for the
// rounds ahead of it (one, unless more than max callers, or more than the byte budget, are
// queued) and then its own.
func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	it := &batchItem[Req, Res]{req: req, err: errBatchFallback, wake: make(chan bool, 1)}
	if b.max <= 1 {
		b.run(ctx, []*batchItem[Req, Res]{it})
		return it.res, it.err
	}
	b.mu.Lock()
	if b.busy {
		b.queue = append(b.queue, it)
		b.mu.Unlock()
		if !<-it.wake {
			return it.res, it.err
		}
	} else {
		b.busy = true
		b.mu.Unlock()
	}

	// Leading a round: it carries this call and up to max-1 of those queued, in order,
	// within the byte budget.
	b.mu.Lock()
	n := min(len(b.queue), b.max-1)
	if b.size != nil {
		total := b.size(req)
		for i := range n {
			if total += b.size(b.queue[i].req); total > b.maxBytes {
				n = i
				break
			}
		}
	}
	items := append([]*batchItem[Req, Res]{it}, b.queue[:n]...)
	b.queue = slices.Delete(b.queue, 0, n)
	b.mu.Unlock()
	defer func() { // deferred so that a panicking run still lets every waiter go
		for _, o := range items[1:] {
			o.wake <- false
		}
		b.mu.Lock()
		if len(b.queue) > 0 {
			next := b.queue[0]
			b.queue = slices.Delete(b.queue, 0, 1)
			next.wake <- true
		} else {
			b.busy = false
		}
		b.mu.Unlock()
	}()
	b.run(ctx, items)
	return it.res, it.err
}

// reserveReq is one reserving insert: the call, the owner token it reserves with, and its
// caller's context (a reservation made for a caller whose context ended meanwhile is
// released on the round's connection).
type reserveReq struct {
	ctx   context.Context
	cl    *call
	owner pgtype.UUID
}

// completeReq is one completing write (a result or a stored failure).
type completeReq struct {
	cl              *call
	owner           pgtype.UUID
	status          Status
	result, failure []byte
}

// runReserves runs one round of reserving inserts: the single-key statement for one, the
// array statement for more. An item that comes back without a row gets pgx.ErrNoRows, as
// the single-key statement would (its key was also in the batch, or committed after the
// statement's snapshot): acquire reads again.
//
// ctx is the leading caller's. Waiting for a pool connection sends nothing, so that wait
// ends with ctx: the leader then returns ctx's error (as a *notSentError) and every other
// member runs alone (errRoundNotSent), waiting for a connection on its own context.
func (c *Coordinator) runReserves(ctx context.Context, items []*batchItem[reserveReq, row]) {
	ctx, cancel, conn, err := c.detachedConn(ctx, false)
	if err != nil {
		for i, it := range items {
			it.res, it.err = row{}, err
			switch {
			case i == 0:
			case err.(*notHeldError).callerEnded: // the leader's context ended: nothing was sent
				it.err = errRoundNotSent
			case it.req.ctx.Err() != nil: // so did this member's, while it waited
				it.err = &notHeldError{err: it.req.ctx.Err(), callerEnded: true}
			}
		}
		return
	}
	held := &heldConn{pool: c.pool, conn: conn}
	defer cancel()
	defer held.release()
	defer c.releaseEnded(ctx, held, items)
	if len(items) == 1 {
		it := items[0]
		cl := it.req.cl
		err = c.inRound(ctx, conn, c.sql.reserveRound, []any{cl.namespace, cl.key, it.req.owner, cl.fingerprint,
			micros(cl.lease), micros(cl.ttl)}, func(rows pgx.Rows) error {
			it.err = pgx.ErrNoRows
			if rows.Next() {
				var r row
				if err := rows.Scan(r.scanTargets(true)...); err != nil {
					return err
				}
				it.res, it.err = r, nil
			}
			return rows.Err()
		})
	} else {
		n := len(items)
		namespaces, keys := make([]string, n), make([]string, n)
		owners, fingerprints := make([]pgtype.UUID, n), make([][]byte, n)
		leases, ttls := make([]int64, n), make([]int64, n)
		for i, it := range items {
			cl := it.req.cl
			namespaces[i], keys[i], owners[i], fingerprints[i] = cl.namespace, cl.key, it.req.owner, cl.fingerprint
			leases[i], ttls[i] = micros(cl.lease), micros(cl.ttl)
			it.err = pgx.ErrNoRows
		}
		err = c.inRound(ctx, conn, c.sql.reserveMany, []any{namespaces, keys, owners, fingerprints, leases, ttls}, func(rows pgx.Rows) error {
			var ord int64
			var r row
			targets := append([]any{&ord}, r.scanTargets(true)...)
			for rows.Next() {
				if err := rows.Scan(targets...); err != nil {
					return err
				}
				if ord < 1 || ord > int64(n) {
					return errors.New("pgidem: batch reserve returned an unknown ordinal")
				}
				it := items[ord-1]
				it.res, it.err = r, nil
			}
			return rows.Err()
		})
	}
	if err != nil {
		// The server refused the round with an ERROR (it rolled back, so running alone is
		// safe), or the outcome is unknown (the connection failed, the session ended):
		// reserveWrite then looks for its own reservation before it writes again.
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && !mayHaveApplied(err) {
			err = errBatchFallback
		}
		for _, it := range items {
			it.res, it.err = row{}, err
		}
	}
}

// releaseEnded releases, on the round's connection q, the reservations the round made for
// members whose context ended while it ran, which then return their context's error (a
// *notHeldError): released later, on another connection, a full pool could keep the
// release waiting and the key in progress for a lease. A member whose release fails keeps
// its row, and acquire tries again.
func (c *Coordinator) releaseEnded(ctx context.Context, q *heldConn, items []*batchItem[reserveReq, row]) {
	for _, it := range items {
		callerErr := it.req.ctx.Err()
		if it.err != nil || !it.res.inserted || callerErr == nil {
			continue
		}
		err := c.finishOn(ctx, q, it.req.cl, it.req.owner, "release", c.sql.release)
		if err == nil || errors.Is(err, errFinishNoRow) {
			it.res, it.err = row{}, &notHeldError{err: callerErr, callerEnded: true}
		}
	}
}

// runCompletes runs one round of completing writes. A member whose reservation was no
// longer its own gets errFinishNoRow; any failure of the round sends every member to its
// own single-key write (which retries), since completing is safe to repeat.
func (c *Coordinator) runCompletes(ctx context.Context, items []*batchItem[completeReq, struct{}]) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	var err error
	if len(items) == 1 {
		it, q := items[0], items[0].req
		err = c.inRound(ctx, c.pool, c.sql.completeRound, []any{q.cl.namespace, q.cl.key, q.owner, q.status, jsonText(q.result),
			jsonText(q.failure), micros(q.cl.ttl)}, func(rows pgx.Rows) error {
			rows.Close()
			if rows.CommandTag().RowsAffected() == 0 {
				it.err = errFinishNoRow
			} else {
				it.err = nil
			}
			return rows.Err()
		})
	} else {
		n := len(items)
		namespaces, keys, statuses := make([]string, n), make([]string, n), make([]string, n)
		owners := make([]pgtype.UUID, n)
		results, failures := make([]*string, n), make([]*string, n)
		ttls := make([]int64, n)
		byOwner := make(map[pgtype.UUID]*batchItem[completeReq, struct{}], n)
		for i, it := range items {
			q := it.req
			namespaces[i], keys[i], owners[i], statuses[i] = q.cl.namespace, q.cl.key, q.owner, string(q.status)
			results[i], failures[i], ttls[i] = jsonText(q.result), jsonText(q.failure), micros(q.cl.ttl)
			byOwner[q.owner] = it
		}
		args := append(slices.Clip(c.planEach), namespaces, keys, owners, statuses, results, failures, ttls)
		err = c.inRound(ctx, c.pool, c.sql.completeMany, args, func(rows pgx.Rows) error {
			var owner pgtype.UUID
			for rows.Next() {
				if err := rows.Scan(&owner); err != nil {
					return err
				}
				if it := byOwner[owner]; it != nil {
					delete(byOwner, owner)
					it.err = nil
				}
			}
			return rows.Err()
		})
		if err == nil {
			for _, it := range byOwner { // rows the statement did not complete
				it.err = errFinishNoRow
			}
		}
	}
	if err != nil {
		for _, it := range items {
			it.err = errBatchFallback
		}
	}
}

// inRound runs one of the round statements (which carry roundGuard) on q and hands its
// rows to scan.
func (c *Coordinator) inRound(ctx context.Context, q executor, sql string, args []any, scan func(pgx.Rows) error) error {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if err := scan(rows); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// planEachExecution returns the query mode argument (or none) under which the array
// completion is planned for each round rather than from a cached generic plan, on
// connections made with cc. With pgx's default mode (QueryExecModeCacheStatement) a
// statement is prepared once per connection, and after five executions Postgres settles on
// a generic plan. For the completion's join with its arrays, a generic plan made while the
// table was small (just migrated, or emptied by sweeps) hashes a sequential scan of the
// whole table, and the cache keeps it, round after round, as the table grows, until
// autovacuum next analyzes the table. Planned for its own arrays and the table's current
// size, each key is looked up in the primary key. The mode chosen, QueryExecModeExec (the
// unnamed statement, text values), still sends the statement in one round trip and needs
// no per-connection cache, so a pool whose BeforeConnect changes the connections' settings
// cannot turn it off. Every other mode a pool can be set to runs unnamed statements or the
// simple protocol, which are planned for each execution already, and is left as it is.
func planEachExecution(cc *pgx.ConnConfig) []any {
	if cc.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return nil
	}
	return []any{pgx.QueryExecModeExec}
}
