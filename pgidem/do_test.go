package pgidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func TestDoBasic(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context) (string, error) {
		ns, key, ok := pgidem.KeyFromContext(ctx)
		require.True(t, ok)
		return ns + "/" + key + "#" + string(rune('0'+runs.Add(1))), nil
	}
	first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil, fn)
	require.NoError(t, err)
	require.False(t, first.Replayed)
	require.Equal(t, 1, first.Attempts)
	require.Equal(t, "mail/order-9.invoice#1", first.Value)

	second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, second.Replayed)
	require.Equal(t, first.Value, second.Value)
	require.EqualValues(t, 1, runs.Load())

	rec := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"mail/order-9.invoice#1"`, string(rec.Result))

	_, err = b.coord.Lookup(b.ctx, "mail", "nope")
	require.True(t, errors.Is(err, pgidem.ErrNotFound))
}
