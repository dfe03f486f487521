package pgidemriver

import (
	"context"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver"
)

// NewClient creates a River client with river.NewClient and, first, runs
// [Middleware.CheckTTL] for every *Middleware installed in config (config.Middleware,
// config.Plugins or the deprecated config.WorkerMiddleware; once each), so the TTL
// warnings are logged when the client is created, without a separate call. It returns
// river.NewClient's error unchanged. The warnings never stop the client; read them from
// the log (or call CheckTTL yourself to get them as values). A *Middleware that only a
// worker's Middleware method (or a job's plugins) returns is not in config and is not
// checked: call its CheckTTL with config yourself.
func NewClient[TTx any](driver riverdriver.Driver[TTx], config *river.Config) (*river.Client[TTx], error) {
	if config != nil {
		//lint:ignore SA1019 a *Middleware may still be installed through the deprecated field
		workerMiddleware := config.WorkerMiddleware
		installed := make([]any, 0, len(config.Middleware)+len(config.Plugins)+len(workerMiddleware))
		for _, m := range config.Middleware {
			installed = append(installed, m)
		}
		for _, p := range config.Plugins {
			installed = append(installed, p)
		}
		for _, m := range workerMiddleware {
			installed = append(installed, m)
		}
		checked := map[*Middleware]bool{}
		for _, m := range installed {
			if mw, ok := m.(*Middleware); ok && !checked[mw] {
				checked[mw] = true
				mw.CheckTTL(context.Background(), config)
			}
		}
	}
	return river.NewClient(driver, config)
}
