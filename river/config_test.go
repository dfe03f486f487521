package pgidemriver_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// NewMiddleware refuses invalid settings with an error naming the field and matching
// pgidem.ErrInvalidArgument, and fills the documented defaults.
func TestNewMiddlewareValidates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for field, config := range map[string]*pgidemriver.Config{
		"Config.TTL":         {TTL: 30 * time.Second}, // below the coordinator's MinTTL (1 minute)
		"Config.InFlight":    {InFlight: pgidem.InFlightPolicy(9)},
		"Config.WaitTimeout": {WaitTimeout: -1},
		"Config.SnoozeMin":   {SnoozeMin: -1},
		"Config.SnoozeMax":   {SnoozeMin: time.Second, SnoozeMax: time.Millisecond},
		"Config.SQLTimeout":  {SQLTimeout: -1},
	} {
		mw, err := pgidemriver.NewMiddleware(b.coord, config)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, field)
		require.ErrorContains(t, err, field)
		require.Nil(t, mw)
	}
	_, err := pgidemriver.NewMiddleware(nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	mw, err := pgidemriver.NewMiddleware(b.coord, nil)
	require.NoError(t, err)
	cfg := mw.Config()
	require.Equal(t, pgidemriver.TTLDefault, cfg.TTL)
	require.Equal(t, pgidem.InFlightRaise, cfg.InFlight)
	require.Equal(t, pgidemriver.SnoozeMinDefault, cfg.SnoozeMin)
	require.Equal(t, pgidemriver.SnoozeMaxDefault, cfg.SnoozeMax)
	require.Equal(t, pgidemriver.SQLTimeoutDefault, cfg.SQLTimeout)
	mw, err = pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{SnoozeMin: 10 * time.Second})
	require.NoError(t, err)
	require.Equal(t, 10*time.Second, mw.Config().SnoozeMax, "the default SnoozeMax is at least SnoozeMin")
}
