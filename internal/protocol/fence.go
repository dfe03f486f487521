package protocol

import "context"

// Fence identifies one holder of a record: the attempt it runs as and its owner token.
type Fence struct {
	// Attempt is the record's attempt count while this holder runs fn: 1 for the first
	// reservation, one more for each takeover of a holder whose lease ran out.
	Attempt int
	// Owner is the holder's owner token, a UUID in its canonical text form.
	Owner string
}

type fenceContextKey struct{}

// withFence returns ctx carrying f for the fn of a held reservation.
func withFence(ctx context.Context, f Fence) context.Context {
	return context.WithValue(ctx, fenceContextKey{}, f)
}

// FenceFromContext returns the fence of the reservation whose fn ctx belongs to; ok is
// false outside the fn of Do.
func FenceFromContext(ctx context.Context) (f Fence, ok bool) {
	f, ok = ctx.Value(fenceContextKey{}).(Fence)
	return f, ok
}
