package pgidemhttp_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
)

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	principal := func(*http.Request) (string, error) { return "p", nil }

	_, err := pgidemhttp.New(nil, &pgidemhttp.Config{Principal: principal})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	for _, tt := range []struct {
		config pgidemhttp.Config
		field  string
	}{
		{pgidemhttp.Config{}, "Config.Principal"},
		{pgidemhttp.Config{Principal: principal, TTL: time.Second}, "Config.TTL"},
		{pgidemhttp.Config{Principal: principal, InFlight: 9}, "Config.InFlight"},
		{pgidemhttp.Config{Principal: principal, WaitTimeout: -1}, "Config.WaitTimeout"},
		{pgidemhttp.Config{Principal: principal, RetryAfterMax: time.Millisecond}, "Config.RetryAfterMax"},
		{pgidemhttp.Config{Principal: principal, MaxRequestBytes: -1}, "Config.MaxRequestBytes"},
		{pgidemhttp.Config{Principal: principal, MaxResponseBytes: -1}, "Config.MaxResponseBytes"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{"post"}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{""}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{"PO ST"}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Namespace: strings.Repeat("n", 65)}, "Config.Namespace"},
		{pgidemhttp.Config{Principal: principal, Namespace: "a\x00b"}, "Config.Namespace"},
	} {
		_, err := pgidemhttp.New(b.coord, &tt.config)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, tt.field)
		require.ErrorContains(t, err, tt.field)
	}

	_, err = pgidemhttp.New(b.coord, &pgidemhttp.Config{Principal: principal, Methods: []string{"M-SEARCH", "VERSION-CONTROL"}})
	require.NoError(t, err, "method tokens with digits and dashes")

	mw, err := pgidemhttp.New(b.coord, &pgidemhttp.Config{Principal: principal})
	require.NoError(t, err)
	cfg := mw.Config()
	require.Equal(t, pgidemhttp.NamespaceDefault, cfg.Namespace)
	require.Equal(t, pgidemhttp.TTLDefault, cfg.TTL)
	require.Equal(t, []string{"POST", "PATCH"}, cfg.Methods)
	require.Equal(t, pgidem.InFlightRaise, cfg.InFlight)
	require.Equal(t, b.coord.Config().WaitTimeout, cfg.WaitTimeout, "the coordinator's, filled in")
	require.EqualValues(t, pgidemhttp.MaxRequestBytesDefault, cfg.MaxRequestBytes)
	require.Contains(t, cfg.ReplayHeaders, "Location")
}
