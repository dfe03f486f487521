package protocol

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/store"
)

// Waiters for a record in progress poll it with a backoff; notifications wake them early.
// A waiter registers for its key. While any waiter of the engine waits, a listener
// goroutine holds a connection of its own that LISTENs on the schema's channel and holds
// a shared advisory lock on each key waited for (store.LockInterest). The statement that
// finishes a record (completes it, stores a failure, releases it) notifies the key when
// its lock is held (store/notify_sql.go), so records nobody waits for cost nothing. The
// listener wakes the waiters of each key it hears about, and runs only while it has
// waiters (plus listenLinger). A lost notification costs only latency: the waiter's next
// poll finds the outcome. With Settings.PollOnly no listener runs.

// listenLinger is how long the listener stays after its last waiter left, so that a
// burst of waits does not open a connection for each.
const listenLinger = 200 * time.Millisecond

// listenRetry is how long after a listener failed (its connection broke, the server
// restarted) no new one is started; the next waiter after it starts one.
const listenRetry = time.Second

// listener wakes this engine's waiters when another process (or this one) notifies that
// their key's record was finished.
type listener struct {
	mu      sync.Mutex
	waiters map[string]*interest // by store.NotifyPayload
	changed bool                 // waiters gained or lost a key since the listener last locked
	wait    context.CancelFunc   // ends the listener's current wait for a notification; nil: none
	stop    context.CancelFunc   // nil: no listener goroutine
	done    chan struct{}
	idle    *time.Timer // stops the listener once it has lingered without waiters
	idleGen uint64      // counts idle timers: a timer stops the listener only if still current
	retryAt time.Time   // after a listener failed: no new one before then
}

// interest is one key's waiters.
type interest struct {
	namespace, key string
	chans          map[chan struct{}]struct{}
}

// wakeOn registers a waiter for cl's key and returns the channel a notification for the
// key is signalled on, and the function that unregisters it (stopping the listener when
// it was the last). With PollOnly, or a key too long to notify, the channel never fires.
func (c *Engine) wakeOn(cl *Call) (<-chan struct{}, func()) {
	payload := store.NotifyPayload(cl.namespace, cl.key)
	if c.config.PollOnly || c.channel == "" || len(payload) >= store.MaxNotifyPayload {
		return nil, func() {}
	}
	l := &c.listener
	ch := make(chan struct{}, 1)
	l.mu.Lock()
	if l.waiters == nil {
		l.waiters = map[string]*interest{}
	}
	if l.idle != nil {
		l.idle.Stop()
		l.idle = nil
	}
	if l.stop == nil && !time.Now().Before(l.retryAt) {
		ctx, stop := context.WithCancel(context.Background())
		l.stop, l.done = stop, make(chan struct{})
		l.changed = true // the new listener locks every key waited for
		go c.listen(ctx, l.done)
	}
	in := l.waiters[payload]
	if in == nil {
		in = &interest{namespace: cl.namespace, key: cl.key, chans: map[chan struct{}]struct{}{}}
		l.waiters[payload] = in
		l.touch()
	}
	in.chans[ch] = struct{}{}
	l.mu.Unlock()
	return ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(in.chans, ch)
		if len(in.chans) == 0 && l.waiters[payload] == in {
			delete(l.waiters, payload)
			l.touch()
		}
		if len(l.waiters) == 0 && l.stop != nil && l.idle == nil {
			l.idleGen++
			gen := l.idleGen
			l.idle = time.AfterFunc(listenLinger, func() { l.stopIdle(gen) })
		}
	}
}

// touch marks the keys waited for as changed and interrupts the listener's wait, so that
// it locks and unlocks them. l.mu is held.
func (l *listener) touch() {
	l.changed = true
	if l.wait != nil {
		l.wait()
		l.wait = nil
	}
}

// stopIdle stops the listener if gen is still its pending idle timer (no waiter came
// since), and waits for its goroutine to end.
func (l *listener) stopIdle(gen uint64) {
	l.mu.Lock()
	if l.idle == nil || l.idleGen != gen {
		l.mu.Unlock()
		return
	}
	done := l.done
	l.forget()
	l.mu.Unlock()
	<-done
}

// forget stops the current listener and forgets it, under l.mu: the stopped listener
// takes no key change meant for its successor.
func (l *listener) forget() {
	l.stop()
	if l.idle != nil {
		l.idle.Stop()
	}
	l.stop, l.done, l.idle, l.wait = nil, nil, nil, nil
}

// listen holds a connection of its own (the pool's settings, outside the pool) that
// LISTENs on the schema's channel and holds the interest locks of the keys waited for,
// and wakes the waiters of each key notified, until ctx ends. When it cannot connect,
// listen or lock, waiters poll; its locks end with its connection.
func (c *Engine) listen(ctx context.Context, done chan struct{}) {
	defer close(done)
	defer c.listener.ended(ctx, done)
	conn, err := pgx.ConnectConfig(ctx, c.pool.Config().ConnConfig.Copy())
	if err != nil {
		c.listenFailed(ctx, "connect", err)
		return
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	var pid uint32
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{c.channel}.Sanitize()); err != nil {
		c.listenFailed(ctx, "LISTEN", err)
		return
	}
	if err := conn.QueryRow(ctx, store.BackendPID).Scan(&pid); err != nil {
		c.listenFailed(ctx, "backend pid", err)
		return
	}
	held := map[string]*interest{} // the keys whose interest lock the connection holds
	for {
		lock, unlock, wait, stopWait := c.listener.next(ctx, held)
		if wait == nil {
			if err := lockInterest(ctx, conn, pid, lock, unlock); err != nil {
				c.listenFailed(ctx, "lock", err)
				return
			}
			continue
		}
		n, err := conn.WaitForNotification(wait)
		interrupted := wait.Err() != nil // by a change of keys, or by ctx
		stopWait()
		switch {
		case err == nil:
			c.wake(n.Payload)
		case ctx.Err() != nil || !interrupted:
			return // stopped, or the connection failed: waiters poll
		}
	}
}

// ended forgets the listener whose goroutine closes done when it stopped on its own (its
// ctx not cancelled): a waiter from listenRetry on starts a new one, and meanwhile the
// waiters poll.
func (l *listener) ended(ctx context.Context, done chan struct{}) {
	if ctx.Err() != nil {
		return // stopped (stopIdle)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done != done {
		return
	}
	l.forget()
	l.retryAt = time.Now().Add(listenRetry)
}

// listenFailed logs why the listener stopped, unless it was told to.
func (c *Engine) listenFailed(ctx context.Context, step string, err error) {
	switch {
	case ctx.Err() != nil:
	case errors.Is(err, errOtherSession):
		c.config.Logger.Warn("pgidem: listener stopped; waiters poll", "step", step, "error", err.Error())
	default:
		c.config.Logger.Debug("pgidem: listener stopped; waiters poll", "step", step, "error", err.Error())
	}
}

// maxInterestLocks bounds the interest locks a listener holds (they share the server's
// lock table with every session); waiters of further keys poll.
const maxInterestLocks = 512

// next brings held up to date with the keys waited for. When they changed it returns the
// keys to lock and unlock (and a nil wait); otherwise a context for the next wait, which
// a change of keys cancels, and its cancel function. Once ctx ended it returns ctx as the
// wait and touches nothing: the keys are its successor's.
func (l *listener) next(ctx context.Context, held map[string]*interest) (lock, unlock []*interest, wait context.Context, stop context.CancelFunc) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ctx.Err() != nil {
		return nil, nil, ctx, func() {}
	}
	if !l.changed {
		wait, stop = context.WithCancel(ctx)
		l.wait = stop
		return nil, nil, wait, stop
	}
	l.changed = false
	for payload, in := range l.waiters {
		if held[payload] == nil && len(held) < maxInterestLocks {
			held[payload] = in
			lock = append(lock, in)
		}
	}
	for payload, in := range held {
		if l.waiters[payload] == nil {
			delete(held, payload)
			unlock = append(unlock, in)
		}
	}
	return lock, unlock, nil, nil
}

// errOtherSession means an interest statement reached another server session than the
// listener's: a transaction-pooling proxy is in between.
var errOtherSession = errors.New("pgidem: the listener's statements reach another server session (a transaction-pooling proxy?); set Config.PollOnly")

// lockInterest takes the interest locks of lock and gives up those of unlock, in the
// session of backend pid.
func lockInterest(ctx context.Context, conn *pgx.Conn, pid uint32, lock, unlock []*interest) error {
	for _, step := range []struct {
		sql  string
		keys []*interest
	}{{store.UnlockInterest, unlock}, {store.LockInterest, lock}} {
		if len(step.keys) == 0 {
			continue
		}
		namespaces, keys := make([]string, len(step.keys)), make([]string, len(step.keys))
		for i, in := range step.keys {
			namespaces[i], keys[i] = in.namespace, in.key
		}
		var same bool
		if err := conn.QueryRow(ctx, step.sql, namespaces, keys, pid).Scan(&same); err != nil {
			return err
		}
		if !same {
			return errOtherSession
		}
	}
	return nil
}

// wake signals the waiters of the key named by payload.
func (c *Engine) wake(payload string) {
	if !strings.Contains(payload, "\x1f") {
		return
	}
	l := &c.listener
	l.mu.Lock()
	defer l.mu.Unlock()
	if in := l.waiters[payload]; in != nil {
		for ch := range in.chans {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
}
