package protocol

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// PrepareAwait validates an Await of (namespace, key): the key rules, the in-flight policy
// and wait budget of opts (its Lease and ReserveFirst are not used), and a call from
// within the fn of a call holding the key (it would wait for itself).
func (c *Engine) PrepareAwait(ctx context.Context, namespace, key string, opts *Opts) (*Call, error) {
	o := Opts{}
	if opts != nil {
		o = Opts{Fingerprint: opts.Fingerprint, InFlight: opts.InFlight, WaitTimeout: opts.WaitTimeout}
	}
	// No record is written, so no TTL applies: one that passes the checks stands in.
	ttl := max(c.config.MinTTL, 2*c.config.Lease)
	return c.Prepare(ctx, "Await", namespace, key, ttl, &o)
}

// Await reads cl's record until it holds an outcome, never writing: a completed record or
// a stored failure comes back in the report's Row (OutcomeReplayed, or
// OutcomeWaitedReplayed after a wait; OutcomeStoredFailure). A record in progress under a
// live lease is waited for under cl's in-flight policy and wait budget, as Do waits. No
// record, an expired one, or one whose holder's lease ran out returns an error matching
// [ErrNotFound] at once: nobody is running the effect, and Await never runs it.
func (c *Engine) Await(ctx context.Context, cl *Call) (rep Report, err error) {
	defer func() { rep.failed(err) }()
	w := c.newWaiter(cl, time.Time{}, false)
	defer w.done()
	for {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		r, err := c.probe(ctx, cl)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return rep, fmt.Errorf("%w: %s/%s", ErrNotFound, cl.namespace, cl.key)
		case err != nil && ctx.Err() != nil:
			return rep, ctx.Err()
		case err != nil:
			return rep, c.logStoreError(ctx, cl, store.Wrap("lookup", err))
		}
		if err := c.checkFingerprint(ctx, cl, &r); err != nil {
			return rep, err
		}
		switch {
		case r.Finished():
			rep.Row, rep.Attempts, rep.Outcome = r, r.Attempts, replayOutcome(&r, w.waited)
			c.emit(ctx, EventReplayed, cl.namespace, 1)
			return rep, nil
		case !r.Live():
			return rep, fmt.Errorf("%w: %s/%s has no live holder (expired, or its holder's lease ran out)", ErrNotFound, cl.namespace, cl.key)
		}
		err = w.inProgress(ctx, &r)
		rep.Waited = w.waited
		if err != nil {
			return rep, err
		}
	}
}
