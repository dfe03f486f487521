package pgidemriver_test

import (
	"strings"
	"testing"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	pgidemriver "github.com/pgidem/pgidem/river"
)

func TestNewClientChecksTTL(t *testing.T) {
	t.Parallel()
	mw, logs, pool := offlineMiddleware(t)
	mw.Register(InvoiceArgs{})

	client, err := pgidemriver.NewClient(riverpgxv5.New(pool), &river.Config{Middleware: []rivertype.Middleware{mw}})
	require.NoError(t, err)
	require.NotNil(t, client)
	require.Contains(t, logs.String(), "record TTL is shorter than River's redelivery horizon")
	require.Contains(t, logs.String(), "job_kind=mail.invoice")

	// Installed as a plugin (River's preferred field) or through the deprecated
	// WorkerMiddleware: checked too, once each even when listed twice.
	for _, config := range []*river.Config{
		{Plugins: []rivertype.Plugin{mw, mw}},
		{WorkerMiddleware: []rivertype.WorkerMiddleware{mw}}, // the deprecated field, on purpose
	} {
		logs.Reset()
		_, err := pgidemriver.NewClient(riverpgxv5.New(pool), config)
		require.NoError(t, err)
		require.Equal(t, 1, strings.Count(logs.String(), "job_kind=mail.invoice"), logs.String())
	}
}
