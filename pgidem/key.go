package pgidem

import (
	"context"

	"github.com/pgidem/pgidem/internal/protocol"
)

// KeyFromContext returns the namespace and idempotency key of the reservation fn runs
// under; ok is false outside the fn of Do or DoTx (an [Coordinator.InboxHandle] fn holds
// no record key, unless a Do's fn encloses it). Pass the key downstream as the external API's own
// idempotency key (a payment provider's Idempotency-Key header, say): the provider's dedupe
// is the only crash-safe boundary for a foreign effect, and reusing the same key there makes
// a takeover's second run harmless.
func KeyFromContext(ctx context.Context) (namespace, key string, ok bool) {
	return protocol.KeyFromContext(ctx)
}
