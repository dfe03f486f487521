package protocol

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/store"
)

// Waiters for a record in progress poll it with a backoff; notifications wake them early.
// A holder that finishes a record (completes it, stores a failure, releases it) queues a
// notification on the schema's channel, which a notifier goroutine sends (one statement
// for every key queued meanwhile) through the pool. A waiter registers for its key; while
// any waiter of the engine waits, a listener goroutine holds a connection of its own that
// LISTENs on the channel and wakes the waiters of each key it hears about. Both goroutines
// run only while they have work: the notifier until its queue is empty, the listener
// until its last waiter leaves. A lost notification costs only latency: the waiter's next
// poll finds the outcome. With Settings.PollOnly neither runs.

// maxNotifyPayload bounds a notification's payload below the server's limit (8000 bytes);
// a longer key is not notified (its waiters poll).
const maxNotifyPayload = 7900

// notifyPayload is the payload naming (namespace, key); control characters never occur in
// a valid namespace, so the separator is unambiguous.
func notifyPayload(namespace, key string) string { return namespace + "\x1f" + key }

// notifier queues and sends the notifications of records finished by this engine.
type notifier struct {
	mu      sync.Mutex
	queue   []string
	sending bool
}

// notifyDone queues the notification that cl's record was finished.
func (c *Engine) notifyDone(cl *Call) {
	if c.config.PollOnly {
		return
	}
	payload := notifyPayload(cl.namespace, cl.key)
	if len(payload) > maxNotifyPayload {
		return
	}
	n := &c.notifier
	n.mu.Lock()
	n.queue = append(n.queue, payload)
	start := !n.sending
	n.sending = true
	n.mu.Unlock()
	if start {
		go c.sendNotifications()
	}
}

// sendNotifications sends queued notifications until the queue is empty. A failed send
// drops its batch: waiters poll.
func (c *Engine) sendNotifications() {
	n := &c.notifier
	for {
		n.mu.Lock()
		batch := n.queue
		n.queue = nil
		if len(batch) == 0 {
			n.sending = false
			n.mu.Unlock()
			return
		}
		n.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), c.config.FinishTimeout)
		_, err := c.pool.Exec(ctx, store.Notify, c.channel, batch)
		cancel()
		if err != nil {
			c.config.Logger.Debug("pgidem: notification not sent; waiters poll", "error", err.Error())
		}
	}
}

// listenLinger is how long the listener stays after its last waiter left, so that a
// burst of waits does not open a connection for each.
const listenLinger = 200 * time.Millisecond

// listener wakes this engine's waiters when another process (or this one) notifies that
// their key's record was finished.
type listener struct {
	mu      sync.Mutex
	waiters map[string]map[chan struct{}]struct{}
	stop    context.CancelFunc // nil: no listener goroutine
	done    chan struct{}
	idle    *time.Timer // stops the listener once it has lingered without waiters
	idleGen uint64      // counts idle timers: a timer stops the listener only if still current
}

// wakeOn registers a waiter for cl's key and returns the channel a notification for the
// key is signalled on, and the function that unregisters it (stopping the listener when
// it was the last). With PollOnly, or a key too long to notify, the channel never fires.
func (c *Engine) wakeOn(cl *Call) (<-chan struct{}, func()) {
	payload := notifyPayload(cl.namespace, cl.key)
	if c.config.PollOnly || len(payload) > maxNotifyPayload {
		return nil, func() {}
	}
	l := &c.listener
	ch := make(chan struct{}, 1)
	l.mu.Lock()
	if l.waiters == nil {
		l.waiters = map[string]map[chan struct{}]struct{}{}
	}
	if l.idle != nil {
		l.idle.Stop()
		l.idle = nil
	}
	if l.stop == nil {
		ctx, stop := context.WithCancel(context.Background())
		l.stop, l.done = stop, make(chan struct{})
		go c.listen(ctx, l.done)
	}
	if l.waiters[payload] == nil {
		l.waiters[payload] = map[chan struct{}]struct{}{}
	}
	l.waiters[payload][ch] = struct{}{}
	l.mu.Unlock()
	return ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.waiters[payload], ch)
		if len(l.waiters[payload]) == 0 {
			delete(l.waiters, payload)
		}
		if len(l.waiters) == 0 && l.stop != nil && l.idle == nil {
			l.idleGen++
			gen := l.idleGen
			l.idle = time.AfterFunc(listenLinger, func() { l.stopIdle(gen) })
		}
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
	stop, done := l.stop, l.done
	l.stop, l.done, l.idle = nil, nil, nil
	l.mu.Unlock()
	stop()
	<-done
}

// listen holds a connection of its own (the pool's settings, outside the pool) that
// LISTENs on the schema's channel, and wakes the waiters of each key notified, until ctx
// ends. When it cannot connect or listen, waiters poll.
func (c *Engine) listen(ctx context.Context, done chan struct{}) {
	defer close(done)
	conn, err := pgx.ConnectConfig(ctx, c.pool.Config().ConnConfig.Copy())
	if err != nil {
		if ctx.Err() == nil {
			c.config.Logger.Debug("pgidem: listener cannot connect; waiters poll", "error", err.Error())
		}
		return
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{c.channel}.Sanitize()); err != nil {
		if ctx.Err() == nil {
			c.config.Logger.Debug("pgidem: listener cannot LISTEN; waiters poll", "error", err.Error())
		}
		return
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return // ctx ended, or the connection failed: waiters poll
		}
		c.wake(n.Payload)
	}
}

// wake signals the waiters of the key named by payload.
func (c *Engine) wake(payload string) {
	if !strings.Contains(payload, "\x1f") {
		return
	}
	l := &c.listener
	l.mu.Lock()
	defer l.mu.Unlock()
	for ch := range l.waiters[payload] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}
