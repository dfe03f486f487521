package pgidemotel_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.uber.org/goleak"

	"github.com/pgidem/pgidem/internal/testdb"
	pgidemotel "github.com/pgidem/pgidem/otel"
	"github.com/pgidem/pgidem/pgidem"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestHookCountsOutcomes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { require.NoError(t, provider.Shutdown(ctx)) })

	hook, err := pgidemotel.NewHook(provider)
	require.NoError(t, err)
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{Hook: hook})
	require.NoError(t, err)

	fn := func(context.Context) (string, error) { return "em_1", nil }
	for range 3 {
		_, err := pgidem.Do(ctx, coord, "mail", "order-9.invoice", time.Hour, nil, fn)
		require.NoError(t, err)
	}
	_, err = pgidem.Do(ctx, coord, "mail", "bad\x00key", time.Hour, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrInvalidKey)
	_, err = pgidem.Do(ctx, coord, "bad\x00namespace", "k", time.Hour, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrInvalidKey)
	_, err = db.Pool.Exec(ctx, `UPDATE pgidem_record SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	_, err = coord.Sweep(ctx, nil)
	require.NoError(t, err)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]int64{}
	units := map[string]string{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, pgidemotel.MeterName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			if m.Name != pgidemotel.EventsMetric && m.Name != pgidemotel.SweptMetric {
				switch m.Data.(type) { // the call and round histograms (trace_test.go)
				case metricdata.Histogram[float64], metricdata.Histogram[int64]:
					continue
				}
			}
			units[m.Name] = m.Unit
			sum, ok := m.Data.(metricdata.Sum[int64])
			require.True(t, ok, "a monotonic int64 sum")
			require.True(t, sum.IsMonotonic)
			for _, dp := range sum.DataPoints {
				if m.Name == pgidemotel.SweptMetric {
					require.Zero(t, dp.Attributes.Len())
					got["swept rows"] += dp.Value
					continue
				}
				kind, _ := dp.Attributes.Value(attribute.Key(pgidemotel.KindAttribute))
				ns, _ := dp.Attributes.Value(attribute.Key(pgidemotel.NamespaceAttribute))
				got[kind.AsString()+" "+ns.AsString()] += dp.Value
			}
		}
	}
	require.Equal(t, map[string]string{pgidemotel.EventsMetric: "{event}", pgidemotel.SweptMetric: "{row}"}, units)
	require.Equal(t, map[string]int64{"executed mail": 1, "replayed mail": 2, "invalid_key mail": 1,
		"invalid_key ": 1, "swept rows": 1}, got, "a rejected namespace is not an attribute value")

	_, err = pgidemotel.NewHook(nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = pgidemotel.NewHook((*sdkmetric.MeterProvider)(nil)) // used to panic
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	var zero pgidemotel.Hook // counts nothing rather than panic
	zero.OnEvent(context.Background(), pgidem.Event{Kind: pgidem.EventExecuted, Namespace: "mail", Count: 1})
	(*pgidemotel.Hook)(nil).OnEvent(context.Background(), pgidem.Event{Kind: pgidem.EventSwept, Count: 1})
}
