package pgidemriver_test

import (
	"context"
	"log/slog"
	"testing"

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
