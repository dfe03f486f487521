package pgidem_test

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// acquireSignal is a pool tracer (pgxpool.AcquireTracer; pgx.QueryTracer only because
// ConnConfig.Tracer must be one) that calls onAcquire when an Acquire of the pool starts,
// with the acquire's context: a test can then act once a call is waiting for a connection,
// instead of sleeping and hoping it is.
type acquireSignal struct {
	onAcquire func(ctx context.Context)
}

func (a *acquireSignal) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	if a.onAcquire != nil {
		a.onAcquire(ctx)
	}
	return ctx
}
func (*acquireSignal) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {}
func (*acquireSignal) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (*acquireSignal) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
