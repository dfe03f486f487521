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

// startHeartbeat starts renewing the lease of cl's reservation. When a renewal finds the
// row no longer owned, or no renewal has succeeded for a whole lease (so another caller may
// already have taken over), it cancels fn's context with cause ErrLeaseLost and stops. That
// verdict only stops fn: whether the lease really was lost is decided by the finishing
// write, which is conditional on the owner token.
func (c *Coordinator) startHeartbeat(ctx context.Context, cl *call, owner pgtype.UUID, cancelFn context.CancelCauseFunc) *heartbeat {
	hb := &heartbeat{stopCh: make(chan struct{}), done: make(chan struct{})}
	ctx = context.WithoutCancel(ctx) // the heartbeat outlives a cancelled caller until fn returns
	interval := cl.lease / 3
	go func() {
		defer close(hb.done)
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		lastRenewed := time.Now()
		for {
			select {
			case <-hb.stopCh:
				return
			case <-ticker.C:
			}
			renewCtx, cancel := context.WithTimeout(ctx, interval)
			tag, err := c.pool.Exec(renewCtx, c.sql.heartbeat, cl.namespace, cl.key, owner, micros(cl.lease), micros(cl.ttl))
			cancel()
			switch {
			case err != nil:
				c.config.Logger.WarnContext(ctx, "pgidem: heartbeat failed",
					slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("error", err.Error()))
				c.emit(ctx, EventStoreError, cl.namespace, 1)
				if time.Since(lastRenewed) < cl.lease {
					continue
				}
				// The lease may have expired and been taken over: stop fn rather than run
				// two holders side by side.
			case tag.RowsAffected() == 1:
				lastRenewed = time.Now()
				continue
			case hb.finished.Load():
				return // the record was completed or released: nothing left to renew
			}
			c.config.Logger.WarnContext(ctx, "pgidem: heartbeat could not renew the lease; cancelling fn",
				slog.String("namespace", cl.namespace), slog.String("key", cl.key))
			cancelFn(ErrLeaseLost)
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
