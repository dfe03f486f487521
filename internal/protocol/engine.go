// Package protocol is pgidem's reservation protocol: reserve (alone or in a shared
// round), wait, run fn under a heartbeat, finish, take over, and the transactional
// variant and inbox. Package pgidem is its façade; every statement it sends comes from
// package store.
package protocol

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/store"
)

// Settings are the engine's settings, validated and with defaults filled in by the
// façade (pgidem.Config documents each).
type Settings struct {
	Schema                         string
	Lease, MinTTL, WaitTimeout     time.Duration
	InFlight                       InFlightPolicy
	PollIntervalMin                time.Duration
	PollIntervalMax, FinishTimeout time.Duration
	MaxBatch                       int
	Order                          Order
	MaxKeyBytes, MaxNamespaceBytes int
	MaxValueBytes                  int
	FailOpen                       bool
	// MaxAttempts caps takeovers: a dead holder's record at this many attempts is parked
	// (0: no cap).
	MaxAttempts int
	// PollOnly: waiters only poll; no notifications are sent or listened for.
	PollOnly bool
	Logger   *slog.Logger
	// Emit receives every event; nil: none.
	Emit func(ctx context.Context, kind EventKind, namespace string, count int64)
	// Round receives every shared round (RoundReserve, RoundComplete, RoundRead) once its
	// statement returned: how many calls it carried, its latency and its error; nil: none.
	// ctx is the round leader's (detached from its cancellation).
	Round func(ctx context.Context, kind RoundKind, size int, latency time.Duration, err error)
}

// RoundKind names a shared round's statement.
type RoundKind string

// The shared rounds.
const (
	// RoundReserve is a round of reserving inserts.
	RoundReserve RoundKind = "reserve"
	// RoundComplete is a round of completing (or failing) writes.
	RoundComplete RoundKind = "complete"
	// RoundRead is a round of the reads that start calls.
	RoundRead RoundKind = "read"
)

// Engine runs the protocol against one pool. It holds no connection between calls and is
// safe for concurrent use.
type Engine struct {
	pool   *pgxpool.Pool
	config Settings
	sql    *store.Statements

	reserves  *batcher[reserveReq, store.Row] // reserving inserts (round.go)
	completes *batcher[completeReq, struct{}] // completing writes (round.go)
	reads     *batcher[*Call, readRes]        // first reads (read.go)

	listener listener // wakes waiters on notifications (notify.go)
	channel  string   // the notification channel of the engine's records

	planEach []any // query mode arguments that plan a statement for each execution (planEachExecution)

	orders *orderStats // each namespace's recent share of calls finding a record (OrderAdaptive)

	clock clock // the time sweeps pace themselves by; tests replace it
}

// clock is where a sweep's pacing reads the time and waits.
type clock interface {
	Now() time.Time
	// Sleep waits for d or until ctx ends, returning ctx's error then.
	Sleep(ctx context.Context, d time.Duration) error
}

// wallClock is the clock of the process.
type wallClock struct{}

func (wallClock) Now() time.Time                                   { return time.Now() }
func (wallClock) Sleep(ctx context.Context, d time.Duration) error { return sleepCtx(ctx, d) }

// New returns an engine storing records through pool with settings s.
func New(pool *pgxpool.Pool, s Settings) *Engine {
	c := &Engine{pool: pool, config: s, sql: store.New(s.Schema), planEach: planEachExecution(pool.Config().ConnConfig),
		channel: store.Channel(s.Schema), orders: newOrderStats(), clock: wallClock{}}
	c.reserves = &batcher[reserveReq, store.Row]{max: s.MaxBatch, run: c.leadReserves,
		// Nothing was sent for a queued reservation: its caller may go.
		leave: func(ctx context.Context) error { return &notHeldError{err: ctx.Err(), callerEnded: true} }}
	c.completes = &batcher[completeReq, struct{}]{max: s.MaxBatch, // a completion must be written: no leave
		run: func(ctx context.Context, leader *batchItem[completeReq, struct{}], take func(time.Duration) []*batchItem[completeReq, struct{}]) {
			c.runCompletes(ctx, append([]*batchItem[completeReq, struct{}]{leader}, take(0)...))
		},
		size: func(r completeReq) int { return len(r.Result) + len(r.Failure) }, maxBytes: s.MaxValueBytes}
	// Reads run two rounds at once: a read waits for no WAL flush, so a second round keeps
	// the server busy while the first one's calls go on. The writes keep one: their commits
	// queue for the same flush, and more rounds in flight only split them into smaller
	// ones. Nothing was sent for a queued read: its caller may go.
	c.reads = &batcher[*Call, readRes]{max: s.MaxBatch, rounds: 2, run: c.leadReads,
		leave: func(ctx context.Context) error { return ctx.Err() }}
	return c
}

// Pool returns the pool the engine stores records through.
func (c *Engine) Pool() *pgxpool.Pool { return c.pool }

// Statements returns the engine's statements.
func (c *Engine) Statements() *store.Statements { return c.sql }

// ReportInvalid reports [EventInvalidKey] for a call whose namespace (or inbox consumer)
// is namespace: under that namespace when it is valid, else under "".
func (c *Engine) ReportInvalid(ctx context.Context, namespace string) { c.emitInvalid(ctx, namespace) }

// emitInvalid reports [EventInvalidKey] for a call whose namespace (or inbox consumer) is
// namespace: under that namespace when it is valid, else under "".
func (c *Engine) emitInvalid(ctx context.Context, namespace string) {
	if ValidatePart("namespace", namespace, c.config.MaxNamespaceBytes) != nil {
		namespace = ""
	}
	c.emit(ctx, EventInvalidKey, namespace, 1)
}

// emit hands an event to the Hook. A panic in the Hook is logged and goes no further: it
// must not cut the protocol short between two of its steps (a reservation left to its
// lease, a heartbeat goroutine crashing the process).
func (c *Engine) emit(ctx context.Context, kind EventKind, namespace string, count int64) {
	if c.config.Emit == nil {
		return
	}
	defer func() {
		if p := recover(); p != nil {
			c.config.Logger.ErrorContext(ctx, "pgidem: Hook.OnEvent panicked; the event is lost, the call goes on",
				slog.String("event", string(kind)), slog.String("namespace", namespace),
				slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
		}
	}()
	c.config.Emit(ctx, kind, namespace, count)
}

// observeRound hands a round to Settings.Round; a panic there is logged, as in emit.
func (c *Engine) observeRound(ctx context.Context, kind RoundKind, size int, latency time.Duration, err error) {
	if c.config.Round == nil {
		return
	}
	defer func() {
		if p := recover(); p != nil {
			c.config.Logger.ErrorContext(ctx, "pgidem: Hook.OnRound panicked; the round goes on",
				slog.String("round", string(kind)), slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
		}
	}()
	c.config.Round(ctx, kind, size, latency, err)
}

func (c *Engine) logStoreError(ctx context.Context, cl *Call, err error) error {
	return c.reportStoreError(ctx, cl.namespace, err, slog.String("namespace", cl.namespace), slog.String("key", cl.key))
}

// reportStoreError logs err at error with attrs and reports [EventStoreError] under
// namespace when err is a store error; it returns err. ctx is the context the failed
// statement ran on (context.WithoutCancel of the caller's for statements bounded by a
// timeout of their own). A store error once ctx has ended (the caller's deadline, e.g.
// River's JobTimeout, or a cancellation) is the caller's doing, not the store's: it is
// returned as an error matching ctx's error (not store.ErrUnavailable), neither logged nor
// counted.
func (c *Engine) reportStoreError(ctx context.Context, namespace string, err error, attrs ...slog.Attr) error {
	var se *store.Error
	if ctxErr := ctx.Err(); ctxErr != nil && errors.As(err, &se) {
		if errors.Is(se.Err, ctxErr) {
			return se.Err
		}
		// A statement that failed after ctx ended failed because of it (pgx closes a
		// connection whose query was cut off, and the next statement finds it closed).
		return fmt.Errorf("%w (then %s failed: %w)", ctxErr, se.Op, se.Err)
	}
	if errors.Is(err, store.ErrUnavailable) {
		c.config.Logger.LogAttrs(ctx, slog.LevelError, "pgidem: store error", append(attrs, slog.String("error", err.Error()))...)
		c.emit(ctx, EventStoreError, namespace, 1)
	}
	return err
}

func (c *Engine) leaseLost(ctx context.Context, cl *Call) {
	cl.lost = true
	c.config.Logger.ErrorContext(ctx, "pgidem: lease lost; the reservation was taken over and the effect may have run more than once",
		slog.String("namespace", cl.namespace), slog.String("key", cl.key))
	c.emit(ctx, EventLeaseLost, cl.namespace, 1)
}
