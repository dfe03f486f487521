package protocol

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/pgidem/pgidem/internal/store"
)

// waiter applies the in-flight policy to a record in progress under a live lease, for Do
// and DoTx alike.
type waiter struct {
	c        *Engine
	cl       *Call
	start    time.Time // when the wait budget started; zero: at the first wait
	backoff  time.Duration
	waited   bool
	maxSleep time.Duration // a bound on each sleep; 0: none
	// wake fires when the key's record is notified finished; unregister (set with it)
	// ends that registration: the waiter's owner calls done.
	wake       <-chan struct{}
	unregister func()
}

// done ends the waiter's registration for notifications, if any.
func (w *waiter) done() {
	if w.unregister != nil {
		w.unregister()
	}
}

func (c *Engine) newWaiter(cl *Call, start time.Time, waited bool) *waiter {
	return &waiter{c: c, cl: cl, start: start, backoff: c.config.PollIntervalMin, waited: waited}
}

// inProgress returns the error to give up with — an [*InProgressError] under
// [InFlightRaise] or once the wait budget is spent, or ctx's error — or nil after sleeping
// (jittered backoff, woken when the lease would expire or the budget ends), when the caller
// should read the record again. It never writes.
func (w *waiter) inProgress(ctx context.Context, r *store.Row) error {
	c, cl := w.c, w.cl
	retryAfter := max(r.LeaseExpires.Time.Sub(r.DBNow), time.Millisecond)
	inProgress := &InProgressError{Namespace: cl.namespace, Key: cl.key, RetryAfter: retryAfter,
		Attempts: r.Attempts, LeaseExpiresAt: r.LeaseExpires.Time, Waited: w.waited}
	if cl.policy == InFlightRaise {
		c.emit(ctx, EventInProgress, cl.namespace, 1)
		return inProgress
	}
	if !w.waited {
		w.waited, inProgress.Waited = true, true
		c.emit(ctx, EventWaited, cl.namespace, 1)
	}
	if w.start.IsZero() {
		w.start = time.Now()
	}
	remaining := cl.waitTimeout - time.Since(w.start)
	if remaining <= 0 {
		c.emit(ctx, EventInProgress, cl.namespace, 1)
		return inProgress
	}
	sleep := min(jitter(w.backoff), c.config.PollIntervalMax, retryAfter+time.Millisecond, remaining)
	if w.maxSleep > 0 {
		sleep = min(sleep, w.maxSleep)
	}
	w.backoff = min(w.backoff*2, c.config.PollIntervalMax)
	if w.unregister == nil { // register once; the channel is nil when nothing can notify
		w.wake, w.unregister = c.wakeOn(cl)
	}
	return sleepWoken(ctx, sleep, w.wake)
}

// sleepCtx sleeps for d or until ctx ends, returning ctx's error in that case.
func sleepCtx(ctx context.Context, d time.Duration) error { return sleepWoken(ctx, d, nil) }

// sleepWoken sleeps for d, until wake fires (a nil wake never does), or until ctx ends
// (returning ctx's error).
func sleepWoken(ctx context.Context, d time.Duration, wake <-chan struct{}) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
	case <-wake:
	}
	return nil
}

// jitter spreads d over [0.5d, 1.5d) so waiters do not poll in lockstep.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + time.Duration(rand.Int64N(int64(d)))
}
