// Package pgidemtest has assertions for the tests of code that uses pgidem. A worker, a
// consumer or a handler runs its effect under an idempotency key. The test asks what the
// key's record says: completed once, failed permanently, or no record at all.
//
// Each helper reads the record through a [pgidem.Coordinator] (the pool form) or inside the
// test's own transaction (the Tx form). The Tx form is for tests that roll back what they
// wrote, and for [pgidem.DoTx] before its transaction commits. A helper fails the test
// with the record shown when it is not what the test expects.
//
//	pgidemtest.RequireCompleted(ctx, t, coord, "mail", "order-9.invoice",
//		&pgidemtest.RequireOpts{Attempts: 1, Result: "em_1"})
//
// A record past its TTL counts as no record, as it does for every pgidem call, whether or
// not the sweep has deleted it.
//
// A River worker under pgidemriver's middleware is asserted the same way after
// rivertest.Worker (or a real client) has worked its job. The middleware writes its
// records on the coordinator's pool, in the job's namespace (its kind, by default), under
// the key the job args name.
//
// The helpers take the small [TestingT] interface that *testing.T and *testing.B satisfy.
// They are safe for concurrent use as far as the Coordinator and tb are; a Tx form uses tx,
// so not concurrently with other uses of it.
package pgidemtest
