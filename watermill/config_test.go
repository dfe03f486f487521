package pgidemwatermill_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemwatermill "github.com/pgidem/pgidem/watermill"
)

func TestNewMiddleware(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	t.Run("Defaults", func(t *testing.T) {
		t.Parallel()
		mw, err := pgidemwatermill.NewMiddleware(b.coord, nil)
		require.NoError(t, err)
		c := mw.Config()
		require.Equal(t, pgidemwatermill.KeyMetadataDefault, c.KeyMetadata)
		require.Equal(t, pgidemwatermill.TTLDefault, c.TTL)
		require.Equal(t, pgidemwatermill.StoredFailureAck, c.StoredFailure)
		require.NotNil(t, c.Logger)
	})

	t.Run("Invalid", func(t *testing.T) {
		t.Parallel()
		for name, tc := range map[string]struct {
			config *pgidemwatermill.Config
			want   string
		}{
			"TTLBelowMinTTL":    {&pgidemwatermill.Config{TTL: time.Second}, "Config.TTL"},
			"NegativeWait":      {&pgidemwatermill.Config{WaitTimeout: -time.Second}, "Config.WaitTimeout"},
			"UnknownInFlight":   {&pgidemwatermill.Config{InFlight: pgidem.InFlightPolicy(42)}, "Config.InFlight"},
			"UnknownFailPolicy": {&pgidemwatermill.Config{StoredFailure: 7}, "Config.StoredFailure"},
		} {
			_, err := pgidemwatermill.NewMiddleware(b.coord, tc.config)
			require.ErrorContains(t, err, tc.want, name)
		}
		_, err := pgidemwatermill.NewMiddleware(nil, nil)
		require.Error(t, err)
	})
}
