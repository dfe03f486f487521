package pgidem

import (
	"context"

	"github.com/pgidem/pgidem/internal/protocol"
)

// KeyFromContext returns the namespace and idempotency key of the reservation fn runs
// under; ok is false outside the fn of Do or DoTx (an [Coordinator.InboxHandle] fn holds
// no record key, unless a Do's fn encloses it). Pass the key downstream as the external
// API's own idempotency key (a payment provider's Idempotency-Key header, say). The
// provider's dedupe is the only crash-safe boundary for a foreign effect, and reusing the
// same key there makes a takeover's second run harmless.
func KeyFromContext(ctx context.Context) (namespace, key string, ok bool) {
	return protocol.KeyFromContext(ctx)
}

// Fence identifies the holder of a record while its fn runs: see [FenceFromContext].
type Fence = protocol.Fence

// FenceFromContext returns the fence of the reservation the fn of [Do] runs under; ok is
// false elsewhere (DoTx's fn needs none: its writes commit with the record or not at all).
// Attempt grows with every takeover of a holder whose lease ran out. So the effect's own
// writes can refuse a stale holder that still runs after being taken over. Store the
// attempt with the write and make it conditional:
// `UPDATE … SET fence = $1 WHERE id = $2 AND fence <= $1`. [Coordinator.Forget] deletes the record, and with it the count: a
// record made after it starts at attempt 1 again. Owner is the holder's token, unique to
// this holder.
func FenceFromContext(ctx context.Context) (f Fence, ok bool) {
	return protocol.FenceFromContext(ctx)
}
