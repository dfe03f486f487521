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

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, pgidemotel.MeterName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			require.Equal(t, pgidemotel.EventsMetric, m.Name)
			sum, ok := m.Data.(metricdata.Sum[int64])
			require.True(t, ok, "a monotonic int64 sum")
			require.True(t, sum.IsMonotonic)
			for _, dp := range sum.DataPoints {
				kind, _ := dp.Attributes.Value(attribute.Key(pgidemotel.KindAttribute))
				ns, _ := dp.Attributes.Value(attribute.Key(pgidemotel.NamespaceAttribute))
				require.Equal(t, "mail", ns.AsString())
				got[kind.AsString()] += dp.Value
			}
		}
	}
	require.Equal(t, map[string]int64{"executed": 1, "replayed": 2, "invalid_key": 1}, got)

	_, err = pgidemotel.NewHook(nil)
	require.Error(t, err)
}
