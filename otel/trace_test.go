package pgidemotel_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/pgidem/pgidem/internal/testdb"
	pgidemotel "github.com/pgidem/pgidem/otel"
	"github.com/pgidem/pgidem/pgidem"
)

type traceBundle struct {
	ctx      context.Context
	db       *testdb.DB
	coord    *pgidem.Coordinator
	hook     *pgidemotel.Hook
	spans    *tracetest.InMemoryExporter
	reader   *sdkmetric.ManualReader
	provider *sdktrace.TracerProvider
}

// setupTracing returns a coordinator on a fresh database whose hook traces into an
// in-memory exporter and records metrics into a manual reader.
func setupTracing(t *testing.T, opts ...pgidemotel.Option) *traceBundle {
	t.Helper()
	ctx := context.Background()
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() {
		require.NoError(t, tp.Shutdown(ctx))
		require.NoError(t, mp.Shutdown(ctx))
	})
	hook, err := pgidemotel.NewHook(mp, append([]pgidemotel.Option{pgidemotel.WithTracerProvider(tp)}, opts...)...)
	require.NoError(t, err)
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{Hook: hook})
	require.NoError(t, err)
	return &traceBundle{ctx: ctx, db: db, coord: coord, hook: hook, spans: spans, reader: reader, provider: tp}
}

// attrs returns a span's attributes by key.
func attrs(s tracetest.SpanStub) map[string]attribute.Value {
	m := map[string]attribute.Value{}
	for _, kv := range s.Attributes {
		m[string(kv.Key)] = kv.Value
	}
	return m
}

func eventNames(s tracetest.SpanStub) []string {
	var names []string
	for _, e := range s.Events {
		if e.Name != "exception" {
			names = append(names, e.Name)
		}
	}
	return names
}

func TestSpanPerCall(t *testing.T) {
	t.Parallel()
	b := setupTracing(t)
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE ledger (ref text)`)
	require.NoError(t, err)

	parentCtx, parent := b.provider.Tracer("test").Start(b.ctx, "job")
	fn := func(context.Context) (string, error) { return "em_1", nil }
	for range 2 {
		_, err := pgidem.Do(parentCtx, b.coord, "mail", "alice@example.com.invoice", time.Hour, nil, fn)
		require.NoError(t, err)
	}
	_, err = pgidem.DoInTx(parentCtx, b.coord, "ledger", "order-9.entry", time.Hour, nil,
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ('order-9')`)
			return 1, err
		})
	require.NoError(t, err)
	errDeclined := errors.New("declined")
	_, err = pgidem.Do(parentCtx, b.coord, "pay", "order-9.charge", time.Hour, nil,
		func(context.Context) (int, error) { return 0, errDeclined })
	require.ErrorIs(t, err, errDeclined)
	for range 2 {
		_, err = b.coord.InboxHandle(parentCtx, "billing", "msg-1", nil, func(context.Context, pgx.Tx) error { return nil })
		require.NoError(t, err)
	}
	parent.End()

	type span struct {
		name, namespace, op, outcome string
		attempts                     int64
		waited, tookOver             bool
		status                       codes.Code
	}
	var got []span
	for _, s := range b.spans.GetSpans() {
		if s.Name == "job" {
			continue
		}
		require.Equal(t, parent.SpanContext().SpanID(), s.Parent.SpanID(), "a call's span is a child of the caller's")
		a := attrs(s)
		require.Equal(t, "postgresql", a[pgidemotel.DBSystemAttribute].AsString())
		_, hasKey := a[pgidemotel.KeyAttribute]
		require.False(t, hasKey, "keys are left out unless WithKeys")
		got = append(got, span{s.Name, a[pgidemotel.NamespaceAttribute].AsString(), a[pgidemotel.OperationAttribute].AsString(),
			a[pgidemotel.OutcomeAttribute].AsString(), a[pgidemotel.AttemptsAttribute].AsInt64(),
			a[pgidemotel.WaitedAttribute].AsBool(), a[pgidemotel.TookOverAttribute].AsBool(), s.Status.Code})
	}
	require.Equal(t, []span{
		{"pgidem.Do", "mail", "Do", "executed", 1, false, false, codes.Unset},
		{"pgidem.Do", "mail", "Do", "replayed", 1, false, false, codes.Unset},
		{"pgidem.DoInTx", "ledger", "DoInTx", "executed", 1, false, false, codes.Unset},
		{"pgidem.Do", "pay", "Do", "executed", 1, false, false, codes.Error},
		{"pgidem.InboxHandle", "billing", "InboxHandle", "executed", 0, false, false, codes.Unset},
		{"pgidem.InboxHandle", "billing", "InboxHandle", "replayed", 0, false, false, codes.Unset},
	}, got)

	// Histograms: one wait per call, one fn duration per call whose fn ran, rounds of
	// reserving and completing statements.
	counts := histogramCounts(t, b)
	require.Equal(t, uint64(6), counts[pgidemotel.WaitMetric])
	require.Equal(t, uint64(4), counts[pgidemotel.FnMetric])
	// The two fresh Do calls and the replay (a namespace of fresh keys starts each call with
	// the reserving insert: Config.Order) reserve in rounds.
	require.Equal(t, uint64(3), counts[pgidemotel.RoundDurationMetric+" reserve"])
	require.Equal(t, uint64(1), counts[pgidemotel.RoundDurationMetric+" complete"], "the failed Do releases outside the rounds")
	require.Equal(t, counts[pgidemotel.RoundDurationMetric+" reserve"], counts[pgidemotel.RoundSizeMetric+" reserve"])
	require.Equal(t, uint64(3), counts["size sum reserve"], "each round carried one call")
	require.Equal(t, uint64(2), counts[pgidemotel.WaitMetric+" replayed"], "the Do replay and the inbox duplicate")
}

// histogramCounts collects the reader's histograms: data points by metric name (and by
// round kind, and by outcome for WaitMetric) and the sum of round sizes.
func histogramCounts(t *testing.T, b *traceBundle) map[string]uint64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(b.ctx, &rm))
	counts := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Histogram[float64]:
				require.Equal(t, "s", m.Unit)
				for _, dp := range data.DataPoints {
					counts[m.Name] += dp.Count
					if kind, ok := dp.Attributes.Value(pgidemotel.RoundAttribute); ok {
						counts[m.Name+" "+kind.AsString()] += dp.Count
					}
					if outcome, ok := dp.Attributes.Value(pgidemotel.OutcomeAttribute); ok && m.Name == pgidemotel.WaitMetric {
						counts[m.Name+" "+outcome.AsString()] += dp.Count
						_, ok := dp.Attributes.Value(pgidemotel.WaitedAttribute)
						require.True(t, ok, "the wait histogram says whether the call waited")
					}
				}
			case metricdata.Histogram[int64]:
				require.Equal(t, "{call}", m.Unit)
				for _, dp := range data.DataPoints {
					kind, _ := dp.Attributes.Value(pgidemotel.RoundAttribute)
					counts[m.Name+" "+kind.AsString()] += dp.Count
					counts["size sum "+kind.AsString()] += uint64(dp.Sum)
				}
			}
		}
	}
	return counts
}

func TestSpanEventsOnTakeoverAndLeaseLost(t *testing.T) {
	t.Parallel()
	b := setupTracing(t, pgidemotel.WithKeys())
	var second pgidem.Result[string]
	first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", time.Hour, nil, func(context.Context) (string, error) {
		// A stall that outlived the lease: a second caller takes the key over meanwhile.
		_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second'`)
		require.NoError(t, err)
		var err2 error
		second, err2 = pgidem.DoResult(b.ctx, b.coord, "mail", "k", time.Hour, nil,
			func(context.Context) (string, error) { return "fresh", nil })
		require.NoError(t, err2)
		return "stale", nil
	})
	require.ErrorIs(t, err, pgidem.ErrLeaseLost)
	require.Equal(t, pgidem.OutcomeLeaseLost, first.Outcome)
	require.True(t, second.TookOver)

	spans := b.spans.GetSpans()
	require.Len(t, spans, 2)
	byOutcome := map[string]tracetest.SpanStub{}
	for _, s := range spans {
		a := attrs(s)
		require.Equal(t, "k", a[pgidemotel.KeyAttribute].AsString(), "WithKeys adds the key")
		byOutcome[a[pgidemotel.OutcomeAttribute].AsString()] = s
	}
	takenOver := byOutcome["taken_over"]
	require.Equal(t, []string{pgidemotel.TakenOverEvent}, eventNames(takenOver))
	require.True(t, attrs(takenOver)[pgidemotel.TookOverAttribute].AsBool())
	require.Equal(t, int64(2), attrs(takenOver)[pgidemotel.AttemptsAttribute].AsInt64())
	lost := byOutcome["lease_lost"]
	require.Equal(t, []string{pgidemotel.LeaseLostEvent}, eventNames(lost))
	require.Equal(t, codes.Error, lost.Status.Code)
}

func TestNewHookOptions(t *testing.T) {
	t.Parallel()
	mp := sdkmetric.NewMeterProvider()
	_, err := pgidemotel.NewHook(mp, pgidemotel.WithTracerProvider(nil))
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = pgidemotel.NewHook(mp, pgidemotel.WithTracerProvider((*sdktrace.TracerProvider)(nil)))
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	// Without a tracer the hook adds no span but still records the histograms.
	hook, err := pgidemotel.NewHook(mp)
	require.NoError(t, err)
	ctx := context.Background()
	require.Equal(t, ctx, hook.OnCallStart(ctx, pgidem.CallStart{Op: pgidem.OpDo, Namespace: "mail", Key: "k"}))
	hook.OnCallEnd(ctx, pgidem.CallEnd{Op: pgidem.OpDo, Namespace: "mail", Outcome: pgidem.OutcomeExecuted})

	var zero pgidemotel.Hook // does nothing rather than panic
	require.Equal(t, ctx, zero.OnCallStart(ctx, pgidem.CallStart{}))
	zero.OnCallEnd(ctx, pgidem.CallEnd{})
	zero.OnRound(ctx, pgidem.Round{})
	(*pgidemotel.Hook)(nil).OnRound(ctx, pgidem.Round{})
	require.NoError(t, mp.Shutdown(ctx))
}
