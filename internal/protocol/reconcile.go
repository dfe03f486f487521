package protocol

import (
	"context"
	"fmt"
	"time"
)

// Takeover is what a record shows when a holder starts on a key whose effect an earlier
// holder may have run: the input of a reconcile hook.
type Takeover struct {
	// Namespace and Key are the record's.
	Namespace, Key string
	// Attempt is this holder's attempt number (2 or more).
	Attempt int
	// LeaseExpiredAt is when the earlier holder's lease ran out (it was last seen alive up
	// to a lease before); zero when that holder released the key instead.
	LeaseExpiredAt time.Time
}

// Reconciler asks the effect's provider whether an earlier holder's effect happened:
// found reports that it did (the hook has recorded its value); an error releases the key.
type Reconciler func(ctx context.Context, t Takeover) (found bool, err error)

// reconciling wraps fn for a holder whose record shows an earlier attempt (attempts ≥ 2):
// cl's reconcile hook runs first, with fn's context; when it finds the effect, fn does
// not run and the record completes with the value the hook recorded.
func (c *Engine) reconciling(cl *Call, t Takeover, fn func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		found, err := cl.reconcile(ctx, t)
		if err != nil {
			return fmt.Errorf("pgidem: reconcile %s/%s: %w", cl.namespace, cl.key, err)
		}
		if found {
			cl.reconciled = true
			c.emit(ctx, EventReconciled, cl.namespace, 1)
			return nil
		}
		return fn(ctx)
	}
}
