package pgidemriver_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"

	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// A worker that panics (River recovers the panic around the middleware chain) still gets
// an outcome and a count: released, since pgidem released the reservation; a panic
// before the worker (in the key method) is an error outcome. Both panics continue.
func TestPanicOutcome(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, nil)
	mw.Register(InvoiceArgs{}, PanickyKeyArgs{})

	require.PanicsWithValue(t, "boom", func() {
		_ = mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error { panic("boom") })
	})
	out := outs.waitFor(t, pgidemriver.ActionReleased)
	require.ErrorContains(t, out.Err, "panicked: boom")
	_, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-1.invoice")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "the reservation was released")

	require.PanicsWithValue(t, "no key", func() {
		_ = mw.Work(b.ctx, jobRow(2, "edge.panickykey", `{}`), func(context.Context) error { return nil })
	})
	outs.waitFor(t, pgidemriver.ActionError)
	stats := mw.Stats()
	require.EqualValues(t, 1, stats.Released)
	require.EqualValues(t, 1, stats.Errors)
}

// PanickyKeyArgs panic when asked for their key.
type PanickyKeyArgs struct{}

func (PanickyKeyArgs) Kind() string { return "edge.panickykey" }

func (PanickyKeyArgs) IdempotencyKey() string { panic("no key") }

// A Hook that panics is a metrics bug, not the job's: the panic is logged, the execution is
// counted once (not as executed and as an error), and the job's result stands: River gets
// no panic for a job whose effect was recorded.
func TestHookPanicIsContained(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs syncBuffer
	var calls []pgidemriver.Action
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Hook: pgidemriver.HookFunc(func(_ context.Context, o *pgidemriver.Outcome) {
			calls = append(calls, o.Action)
			panic("metrics exporter bug")
		}),
	})
	require.NoError(t, err)
	mw.Register(InvoiceArgs{})
	for range 2 {
		require.NotPanics(t, func() {
			require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error { return nil }))
		})
	}
	require.Equal(t, []pgidemriver.Action{pgidemriver.ActionExecuted, pgidemriver.ActionReplayed}, calls)
	stats := mw.Stats()
	require.EqualValues(t, 1, stats.Executed)
	require.EqualValues(t, 1, stats.Replayed)
	require.Zero(t, stats.Errors)
	require.Contains(t, logs.String(), "Hook.OnOutcome panicked")
	require.Contains(t, logs.String(), "metrics exporter bug")
}

// startHook is a StartHook that marks the execution's context with the job id and records
// what each method saw; panicStart makes OnJobStart panic instead.
type startHook struct {
	mu         sync.Mutex
	panicStart bool
	started    []int64
	outcomes   []string // action and the mark OnOutcome's context carried
}

type startMarkKey struct{}

func (h *startHook) OnJobStart(ctx context.Context, job *rivertype.JobRow) context.Context {
	h.mu.Lock()
	h.started = append(h.started, job.ID)
	h.mu.Unlock()
	if h.panicStart {
		panic("tracer bug")
	}
	return context.WithValue(ctx, startMarkKey{}, job.ID)
}

func (h *startHook) OnOutcome(ctx context.Context, out *pgidemriver.Outcome) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.outcomes = append(h.outcomes, fmt.Sprintf("%s %v", out.Action, ctx.Value(startMarkKey{})))
}

// A StartHook sees every execution the middleware takes up, excluded kinds included, once
// even when the middleware is registered twice; the context it returns reaches the worker
// and OnOutcome.
func TestStartHook(t *testing.T) {
	t.Parallel()
	b := setup(t)
	hook := &startHook{}
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{Hook: hook, Logger: testLogger(t), ExcludeKinds: []string{"mail.plain"}})
	require.NoError(t, err)
	mw.Register(InvoiceArgs{})

	var seen []any
	worker := func(ctx context.Context) error {
		seen = append(seen, ctx.Value(startMarkKey{}))
		return nil
	}
	job := jobRow(1, "mail.invoice", `{"order_id":1}`)
	// Registered twice: the inner registration passes the job through without a start.
	require.NoError(t, mw.Work(b.ctx, job, func(ctx context.Context) error { return mw.Work(ctx, job, worker) }))
	require.NoError(t, mw.Work(b.ctx, jobRow(2, "mail.invoice", `{"order_id":1}`), worker))
	require.NoError(t, mw.Work(b.ctx, jobRow(3, "mail.plain", `{"order_id":1}`), worker))

	require.Equal(t, []any{int64(1), int64(3)}, seen, "job 2 replayed without the worker")
	require.Equal(t, []int64{1, 2, 3}, hook.started)
	require.Equal(t, []string{"executed 1", "replayed 2", "skipped 3"}, hook.outcomes)
}

// A StartHook that panics is logged; the job goes on with River's context and its
// outcome stands.
func TestStartHookPanicIsContained(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs syncBuffer
	hook := &startHook{panicStart: true}
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{Hook: hook, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	mw.Register(InvoiceArgs{})
	ran := false
	require.NotPanics(t, func() {
		require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error {
			ran = true
			return nil
		}))
	})
	require.True(t, ran)
	require.Equal(t, []string{"executed <nil>"}, hook.outcomes)
	require.EqualValues(t, 1, mw.Stats().Executed)
	require.Contains(t, logs.String(), "Hook.OnJobStart panicked")
	require.Contains(t, logs.String(), "tracer bug")
	require.Contains(t, logs.String(), "job_id=1")
}
