package pgidem

import (
	"context"
)

// Await returns the outcome of the effect stored under (namespace, key) without ever
// running anything: for producers and status endpoints that want the result of work a
// [Do] elsewhere runs or ran.
//
//   - A completed record: its value, decoded into T (as a replay of [Do]; a value that
//     does not decode returns an error matching [ErrReplayNotDecodable]).
//   - A stored failure: a [*StoredFailureError].
//   - A parked record ([Config.MaxAttempts]): a [*ParkedError]. Await never parks one
//     itself: a dead holder's record below is "no live holder".
//   - In progress under a live lease: Await waits for it as [Do] does, under the in-flight
//     policy and wait budget of opts (an [*InProgressError] when the budget runs out or
//     under [InFlightRaise]; ctx's error when ctx ends).
//   - No record, an expired one, or one whose holder's lease ran out: an error matching
//     [ErrNotFound], at once.
//
// opts' Fingerprint is compared as in [Do] ([ErrFingerprintMismatch]); its Lease and
// ReserveFirst are not used; nil means the coordinator's defaults. An invalid key returns
// an [*InvalidKeyError], a database error a [*StoreError]. Await never writes. Safe for
// concurrent use.
func Await[T any](ctx context.Context, c *Coordinator, namespace, key string, opts *DoOpts) (Result[T], error) {
	var res Result[T]
	if c == nil {
		return Result[T]{Outcome: OutcomeInvalid}, invalidArgument("Await: the coordinator must not be nil")
	}
	cl, err := c.engine.PrepareAwait(ctx, namespace, key, opts.engineOpts())
	if err != nil {
		res.Outcome = OutcomeInvalid
		return res, err
	}
	rep, err := c.engine.Await(ctx, cl)
	res = result(rep, res.Value)
	if err == nil {
		err = decodeReplay(namespace, key, &rep.Row, &res.Value)
	}
	return res, err
}
