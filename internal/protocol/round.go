package protocol

import (
	"context"
	"errors"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgidem/pgidem/internal/store"
)

// errBatchFallback tells a member to run its own single-key statement: its batch rolled
// back.
var errBatchFallback = errors.New("pgidem: batch rolled back; run alone")

// batchItem is one caller's request in a batcher and, once its round ran, the outcome.
type batchItem[Req, Res any] struct {
	req Req
	res Res
	err error
	// wake is made when the caller queues. It receives false when res and err are set,
	// true when the caller leads the next round.
	wake   chan bool
	queued time.Time // when it joined the queue
}

// batcher groups concurrent requests for one statement, running up to rounds rounds at a
// time. run is called by the leading caller with its own item, and calls take (at most
// once) when it is about to send, for the queued requests the round carries (take(d) with
// d > 0 takes only those queued for d or longer); it sets the leader's and each taken
// item's res or err. An item left with errBatchFallback runs alone. Requests run does not
// take stay queued, and the next of them leads a round.
type batcher[Req, Res any] struct {
	max int // the most requests a round carries; 1: every call runs alone, at once
	// rounds is the most rounds running at once; 0 counts as 1. A caller that finds fewer
	// running leads one at once.
	rounds int
	run    func(ctx context.Context, leader *batchItem[Req, Res], take func(waited time.Duration) []*batchItem[Req, Res])

	// leave, when set, lets a queued caller whose context ends before a round took it
	// leave the queue (nothing was sent for it): do then returns leave(ctx).
	leave func(ctx context.Context) error

	// size, when set, weighs a request in bytes, and a round takes queued requests only
	// while their sizes with the leader's stay within maxBytes (the leader's own always
	// goes): a round of completions carrying large results stays one value's size, not
	// max of them, in memory and on the wire.
	size     func(Req) int
	maxBytes int

	mu      sync.Mutex
	running int                    // rounds running
	queue   []*batchItem[Req, Res] // callers waiting for the next round; empty unless all rounds run
}

// do queues req and returns its outcome once a round carried it. A caller taken into a
// round is not interrupted by its context: rounds run on a detached context bounded by
// FinishTimeout, like the single-key statements, so an outcome is always known. Before
// that it leaves when its context ends, if the batcher has leave. A caller waits for the
// rounds ahead of it (one, unless more than max callers, or more than the byte budget, are
// queued) and then its own.
func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	it := &batchItem[Req, Res]{req: req, err: errBatchFallback}
	if b.max <= 1 {
		b.run(ctx, it, func(time.Duration) []*batchItem[Req, Res] { return nil })
		return it.res, it.err
	}
	b.mu.Lock()
	if b.running >= max(b.rounds, 1) {
		it.queued, it.wake = time.Now(), make(chan bool, 1)
		b.queue = append(b.queue, it)
		b.mu.Unlock()
		lead, stayed := b.wait(ctx, it)
		if !stayed {
			var zero Res
			return zero, b.leave(ctx)
		}
		if !lead {
			return it.res, it.err
		}
	} else {
		b.running++
		b.mu.Unlock()
	}

	// Leading a round: it carries this call and, once run takes them, up to max-1 of those
	// queued, in order, within the byte budget.
	var taken []*batchItem[Req, Res]
	took := false
	take := func(waited time.Duration) []*batchItem[Req, Res] {
		if took {
			return taken
		}
		took = true
		b.mu.Lock()
		defer b.mu.Unlock()
		n := min(len(b.queue), b.max-1)
		if waited > 0 { // the queue is in the order callers joined it
			n = min(n, sort.Search(n, func(i int) bool { return time.Since(b.queue[i].queued) < waited }))
		}
		if b.size != nil {
			total := b.size(req)
			for i := range n {
				if total += b.size(b.queue[i].req); total > b.maxBytes {
					n = i
					break
				}
			}
		}
		taken = slices.Clone(b.queue[:n])
		b.queue = slices.Delete(b.queue, 0, n)
		return taken
	}
	defer func() { // deferred so that a panicking run still lets every waiter go
		for _, o := range taken {
			o.wake <- false
		}
		b.mu.Lock()
		if len(b.queue) > 0 {
			next := b.queue[0]
			b.queue = slices.Delete(b.queue, 0, 1)
			next.wake <- true
		} else {
			b.running--
		}
		b.mu.Unlock()
	}()
	b.run(ctx, it, take)
	return it.res, it.err
}

// wait waits for a queued caller's turn: lead reports that it leads the next round, else
// a round carried it. stayed is false when it left the queue instead, its context having
// ended before any round took it (only with leave).
func (b *batcher[Req, Res]) wait(ctx context.Context, it *batchItem[Req, Res]) (lead, stayed bool) {
	if b.leave == nil {
		return <-it.wake, true
	}
	select {
	case lead := <-it.wake:
		return lead, true
	case <-ctx.Done():
	}
	b.mu.Lock()
	if i := slices.Index(b.queue, it); i >= 0 {
		b.queue = slices.Delete(b.queue, i, i+1)
		b.mu.Unlock()
		return false, false
	}
	b.mu.Unlock()
	return <-it.wake, true // a round took it, or it was handed the lead: see it through
}

// reserveReq is one reserving insert: the call, the owner token it reserves with, and its
// caller's context (a reservation made for a caller whose context ended meanwhile is
// released on the round's connection).
type reserveReq struct {
	ctx   context.Context
	cl    *Call
	Owner pgtype.UUID
}

// completeReq is one completing write (a result or a stored failure).
type completeReq struct {
	cl              *Call
	Owner           pgtype.UUID
	Status          store.Status
	Result, Failure []byte
}

// runReserves runs a round of reserving inserts for items (the leader first), as
// leadReserves with the members given; for tests.
func (c *Engine) runReserves(ctx context.Context, items []*batchItem[reserveReq, store.Row]) {
	c.leadReserves(ctx, items[0], func(time.Duration) []*batchItem[reserveReq, store.Row] { return items[1:] })
}

// leadReserves runs one round of reserving inserts: the single-key statement for one, the
// array statement for more. An item that comes back without a row gets pgx.ErrNoRows, as
// the single-key statement would (its key was also in the batch, or committed after the
// statement's snapshot): acquire reads again.
//
// ctx is the leader's. The round takes its members (take) only once it has a pool
// connection: waiting for one sends nothing, so the wait ends with ctx, and the leader
// then returns ctx's error (a *notHeldError) while those queued stay queued, for the next
// of them to lead, on its own context, and free to leave when theirs ends. A wait that
// outlasts FinishTimeout also fails the members queued for FinishTimeout or longer, who
// have waited as long; those queued since stay, and the next of them leads.
func (c *Engine) leadReserves(ctx context.Context, leader *batchItem[reserveReq, store.Row], take func(waited time.Duration) []*batchItem[reserveReq, store.Row]) {
	ctx, cancel, conn, err := c.detachedConn(ctx, false)
	if err != nil {
		leader.res, leader.err = store.Row{}, err
		if !err.(*notHeldError).callerEnded {
			for _, it := range take(c.config.FinishTimeout) {
				it.res, it.err = store.Row{}, err
				if callerErr := it.req.ctx.Err(); callerErr != nil {
					it.err = &notHeldError{err: callerErr, callerEnded: true}
				}
			}
		}
		return
	}
	items := append([]*batchItem[reserveReq, store.Row]{leader}, take(0)...)
	held := &heldConn{pool: c.pool, conn: conn}
	defer cancel()
	defer held.release()
	defer c.releaseEnded(ctx, held, items)
	start := time.Now()
	if len(items) == 1 {
		it := items[0]
		cl := it.req.cl
		err = c.inRound(ctx, conn, c.sql.ReserveRound, []any{cl.namespace, cl.key, it.req.Owner, cl.fingerprint,
			store.Micros(cl.lease), store.Micros(cl.ttl)}, func(rows pgx.Rows) error {
			it.err = pgx.ErrNoRows
			if rows.Next() {
				var r store.Row
				if err := rows.Scan(r.ScanTargets(true)...); err != nil {
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
			namespaces[i], keys[i], owners[i], fingerprints[i] = cl.namespace, cl.key, it.req.Owner, cl.fingerprint
			leases[i], ttls[i] = store.Micros(cl.lease), store.Micros(cl.ttl)
			it.err = pgx.ErrNoRows
		}
		err = c.inRound(ctx, conn, c.sql.ReserveMany, []any{namespaces, keys, owners, fingerprints, leases, ttls}, func(rows pgx.Rows) error {
			var r store.Row
			return scanOrdinals(rows, n, r.ScanTargets(true), func(i int) { items[i].res, items[i].err = r, nil })
		})
	}
	c.observeRound(ctx, RoundReserve, len(items), time.Since(start), err)
	if err != nil {
		// The server refused the round with an ERROR (it rolled back, so running alone is
		// safe), or the outcome is unknown (the connection failed, the session ended):
		// reserveWrite then looks for its own reservation before it writes again.
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && !store.MayHaveApplied(err) {
			err = errBatchFallback
		}
		for _, it := range items {
			it.res, it.err = store.Row{}, err
		}
	}
}

// releaseEnded releases, on the round's connection q, the reservations the round made for
// members whose context ended while it ran, which then return their context's error (a
// *notHeldError): released later, on another connection, a full pool could keep the
// release waiting and the key in progress for a lease. A member whose release fails keeps
// its row, and acquire tries again.
func (c *Engine) releaseEnded(ctx context.Context, q *heldConn, items []*batchItem[reserveReq, store.Row]) {
	for _, it := range items {
		callerErr := it.req.ctx.Err()
		if it.err != nil || !it.res.Inserted || callerErr == nil {
			continue
		}
		err := c.finishOn(ctx, q, it.req.cl, it.req.Owner, "release", c.sql.Release)
		if err == nil || errors.Is(err, errFinishNoRow) {
			it.res, it.err = store.Row{}, &notHeldError{err: callerErr, callerEnded: true}
		}
	}
}

// runCompletes runs one round of completing writes. A member whose reservation was no
// longer its own gets errFinishNoRow; any failure of the round sends every member to its
// own single-key write (which retries), since completing is safe to repeat.
func (c *Engine) runCompletes(ctx context.Context, items []*batchItem[completeReq, struct{}]) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	var err error
	start := time.Now()
	defer func() { c.observeRound(ctx, RoundComplete, len(items), time.Since(start), err) }()
	if len(items) == 1 {
		it, q := items[0], items[0].req
		err = c.inRound(ctx, c.pool, c.sql.CompleteRound, []any{q.cl.namespace, q.cl.key, q.Owner, q.Status, store.JSONText(q.Result),
			store.JSONText(q.Failure), store.Micros(q.cl.ttl)}, func(rows pgx.Rows) error {
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
			namespaces[i], keys[i], owners[i], statuses[i] = q.cl.namespace, q.cl.key, q.Owner, string(q.Status)
			results[i], failures[i], ttls[i] = store.JSONText(q.Result), store.JSONText(q.Failure), store.Micros(q.cl.ttl)
			byOwner[q.Owner] = it
		}
		args := append(slices.Clip(c.planEach), namespaces, keys, owners, statuses, results, failures, ttls)
		err = c.inRound(ctx, c.pool, c.sql.CompleteMany, args, func(rows pgx.Rows) error {
			var owner pgtype.UUID
			for rows.Next() {
				if err := rows.Scan(&owner, nil); err != nil {
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
func (c *Engine) inRound(ctx context.Context, q store.Executor, sql string, args []any, scan func(pgx.Rows) error) error {
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

// scanOrdinals reads the rows of a round's array statement for n calls, whose first
// column is the call's ordinal (from 1): it scans each row into targets and calls row with
// the call's index.
func scanOrdinals(rows pgx.Rows, n int, targets []any, row func(i int)) error {
	var ord int64
	targets = append([]any{&ord}, targets...)
	for rows.Next() {
		if err := rows.Scan(targets...); err != nil {
			return err
		}
		if ord < 1 || ord > int64(n) {
			return errors.New("pgidem: a round's statement returned an unknown ordinal")
		}
		row(int(ord - 1))
	}
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
