package pgidem

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
)

// heartbeat renews a held lease every lease/3 until stopped.
type heartbeat struct {
	finished atomic.Bool // fn returned: a renewal that finds no row means the finishing write won
	stopOnce sync.Once
	stopCh   chan struct{}
	done     chan struct{}
}

// startHeartbeat starts renewing the lease of cl's reservation, granted by a statement sent
// no earlier than leaseFrom, every lease/3. When a renewal finds the row no longer owned,
// or the lease runs out without a renewal (the store could not be reached, or renewals
// kept timing out), it cancels fn's context with cause ErrLeaseLost; a row no longer owned
// also stops the renewals. The lease is counted from the client's send time of the
// statement that granted or last renewed it, which is no later than that statement's
// start on the server, and fn is cancelled a tenth of a lease before it ends, by a timer,
// whatever a renewal in flight is waiting for: before another caller can take the key
// over. That verdict only stops fn: whether the lease really was lost is decided by the
// finishing write, which is conditional on the owner token.
func (c *Coordinator) startHeartbeat(ctx context.Context, cl *call, owner pgtype.UUID, leaseFrom time.Time, cancelFn context.CancelCauseFunc) *heartbeat {
	hb := &heartbeat{stopCh: make(chan struct{}), done: make(chan struct{})}
	ctx = context.WithoutCancel(ctx) // the heartbeat outlives a cancelled caller until fn returns
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
	// Fires a tenth of a lease before the lease ends unless a renewal moves it.
	expiry := time.AfterFunc(time.Until(leaseFrom.Add(cl.lease-margin)), lost)
	go func() {
		defer close(hb.done)
		defer expiry.Stop()
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		for {
			select {
			case <-hb.stopCh:
				return
			case <-ticker.C:
			}
			renewCtx, cancel := context.WithTimeout(ctx, interval)
			sent := time.Now()
			tag, err := c.pool.Exec(renewCtx, c.sql.heartbeat, cl.namespace, cl.key, owner, micros(cl.lease), micros(cl.ttl))
			cancel()
			switch {
			case err != nil:
				c.config.Logger.WarnContext(ctx, "pgidem: heartbeat failed",
					slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("error", err.Error()))
				c.emit(ctx, EventStoreError, cl.namespace, 1)
				continue // the expiry timer cancels fn if no renewal succeeds in time
			case tag.RowsAffected() == 1:
				if expiry.Stop() { // not fired yet: the lease now runs from this renewal
					expiry.Reset(time.Until(sent.Add(cl.lease - margin)))
				}
				continue
			case hb.finished.Load():
				return // the record was completed or released: nothing left to renew
			}
			expiry.Stop()
			lost()
			return
		}
	}()
	return hb
}

// finishing records that fn returned and the finishing write is under way; the heartbeat
// keeps renewing until stop, and ends quietly once the row is no longer in progress.
func (hb *heartbeat) finishing() { hb.finished.Store(true) }

// stop stops the heartbeat and waits for its goroutine to exit. Safe to call more than once.
func (hb *heartbeat) stop() {
	hb.stopOnce.Do(func() { close(hb.stopCh) })
	<-hb.done
}
