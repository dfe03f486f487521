package pgidemriver

import (
	"context"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver"
)

// NewClient creates a River client with river.NewClient and, first, runs
// [Middleware.CheckTTL] for every *Middleware in config.Middleware, so the TTL warnings
// are logged when the client is created, without a separate call. It returns
// river.NewClient's error unchanged. The warnings never stop the client; read them from
// the log (or call CheckTTL yourself to get them as values). A *Middleware that only a
// worker's Middleware method returns is not in config.Middleware and is not checked: call
// its CheckTTL with config yourself.
func NewClient[TTx any](driver riverdriver.Driver[TTx], config *river.Config) (*river.Client[TTx], error) {
	if config != nil {
		for _, m := range config.Middleware {
			if mw, ok := m.(*Middleware); ok {
				mw.CheckTTL(context.Background(), config)
			}
		}
	}
	return river.NewClient(driver, config)
}
