package protocol

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgidem/pgidem/internal/store"
)

// leaseClock is the end of a held lease as its holder knows it: the client's send time of
// the statement that granted or last renewed it, plus the lease. That send time is no
// later than the statement's start on the server, from which the server counts the lease,
// so no other caller can take the key over before this end. Safe for concurrent use.
type leaseClock struct {
	end atomic.Pointer[time.Time] // nil: no lease known; kept with its monotonic reading
}

// set records that the lease runs until end.
func (l *leaseClock) set(end time.Time) { l.end.Store(&end) }

// until returns the end of the lease, or the zero time when none is known.
func (l *leaseClock) until() time.Time {
	if end := l.end.Load(); end != nil {
		return *end
	}
	return time.Time{}
}

// heartbeat renews a held lease every lease/3 until stopped. Its goroutine starts with
// the first renewal: a call that finishes sooner (most do) starts none.
type heartbeat struct {
	finished atomic.Bool // fn returned: a renewal that finds no row means the finishing write won
	stopOnce sync.Once
	stopCh   chan struct{}
	cancel   context.CancelFunc // ends a renewal in flight when the heartbeat stops
	first    *time.Timer        // starts the renewals' goroutine
	expiry   *time.Timer        // cancels fn when the lease is about to run out unrenewed
	done     chan struct{}      // closed when the renewals ended, or will never start
}

// startHeartbeat starts renewing the lease of cl's reservation, granted by a statement sent
// no earlier than leaseFrom: a lease/3 after the lease was granted or last renewed, and a
// twelfth of a lease after a renewal failed. When a renewal finds the row no longer owned,
// or the lease runs out without a renewal (the store could not be reached, or renewals
// kept failing), it cancels fn's context with cause ErrLeaseLost; a row no longer owned
// also stops the renewals. It keeps cl.held at the lease's end, for the finishing write,
// which retries while the lease lasts.
//
// The lease is counted from the client's send time of the statement that granted or last
// renewed it, which is no later than that statement's start on the server, and a timer
// cancels fn a tenth of a lease before it ends, whatever a renewal in flight is waiting
// for: before another caller can take the key over. A renewal may take until then to
// succeed (a slow store is not a lost lease), and one that succeeds proves that nobody
// took the key over before it. The verdict only stops fn: whether the lease really was
// lost is decided by the finishing write, which is conditional on the owner token.
func (c *Engine) startHeartbeat(ctx context.Context, cl *Call, owner pgtype.UUID, leaseFrom time.Time, cancelFn context.CancelCauseFunc) *heartbeat {
	hb := &heartbeat{stopCh: make(chan struct{}), done: make(chan struct{})}
	// The heartbeat outlives a cancelled caller until fn returns; stop ends it.
	ctx, hb.cancel = context.WithCancel(context.WithoutCancel(ctx))
	interval := cl.lease / 3
	margin := cl.lease / 10 // fn's cancellation comes strictly before a takeover can
	var lostOnce sync.Once
	lost := func() {
		if hb.finished.Load() {
			return // fn has returned; the finishing write decides
		}
		lostOnce.Do(func() {
			c.config.Logger.WarnContext(ctx, "pgidem: heartbeat could not renew the lease; cancelling fn",
				slog.String("namespace", cl.namespace), slog.String("key", cl.key))
			cancelFn(ErrLeaseLost)
		})
	}
	cl.held.set(leaseFrom.Add(cl.lease))
	deadline := leaseFrom.Add(cl.lease - margin) // fn is cancelled then unless a renewal moves it
	expiry := time.AfterFunc(time.Until(deadline), lost)
	hb.expiry = expiry
	hb.first = time.AfterFunc(time.Until(leaseFrom.Add(interval)), func() {
		defer close(hb.done)
		defer expiry.Stop()
		next := time.NewTimer(0) // the first renewal is due
		defer next.Stop()
		for {
			select {
			case <-hb.stopCh:
				return
			case <-next.C:
			}
			timeout := max(interval, time.Until(deadline))
			renewCtx, cancel := context.WithTimeout(ctx, timeout)
			sent := time.Now()
			tag, err := c.pool.Exec(renewCtx, c.sql.Heartbeat, cl.namespace, cl.key, owner, store.Micros(cl.lease), store.Micros(cl.ttl))
			cancel()
			switch {
			case err != nil && ctx.Err() != nil:
				return // stopped
			case store.IsSerializationFailure(err) && hb.finished.Load():
				return // the finishing write won (under a stricter default isolation)
			case store.IsSerializationFailure(err):
				// Another write changed the row first (a stricter default isolation says so
				// with 40001): the next renewal, on a fresh snapshot, tells which.
				next.Reset(interval / 4)
				continue
			case err != nil && hb.finished.Load():
				// fn has returned and the finishing write decides; a renewal queued behind
				// it (and timed out waiting) is no store failure of the call.
				next.Reset(interval / 4)
				continue
			case err != nil:
				c.config.Logger.WarnContext(ctx, "pgidem: heartbeat failed",
					slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("error", err.Error()))
				c.emit(ctx, EventStoreError, cl.namespace, 1)
				next.Reset(interval / 4) // the expiry timer cancels fn if no renewal succeeds in time
				continue
			case tag.RowsAffected() == 1:
				cl.held.set(sent.Add(cl.lease))
				deadline = sent.Add(cl.lease - margin)
				if expiry.Stop() { // not fired yet: the lease now runs from this renewal
					expiry.Reset(time.Until(deadline))
				}
				next.Reset(time.Until(sent.Add(interval)))
				continue
			case hb.finished.Load():
				return // the record was completed or released: nothing left to renew
			}
			expiry.Stop()
			lost()
			return
		}
	})
	return hb
}

// finishing records that fn returned and the finishing write is under way; the heartbeat
// keeps renewing until stop, and ends quietly once the row is no longer in progress.
func (hb *heartbeat) finishing() { hb.finished.Store(true) }

// stop stops the heartbeat, ending a renewal in flight, and waits for its goroutine to
// exit. Safe to call more than once.
func (hb *heartbeat) stop() {
	hb.stopOnce.Do(func() {
		hb.finished.Store(true) // an expiry firing now no longer cancels fn
		hb.cancel()             // first: a renewal chosen after this fails at once
		close(hb.stopCh)
		if hb.first.Stop() { // the renewals never started, and now never will
			hb.expiry.Stop()
			close(hb.done)
		}
	})
	<-hb.done
}
