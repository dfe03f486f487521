// Package pgidemhttp makes net/http handlers idempotent under the Idempotency-Key request
// header (IETF draft-ietf-httpapi-idempotency-key-header; section numbers here are those of
// revision -07), with each key's record in Postgres, kept by a [pgidem.Coordinator].
//
// A client that sends a POST and loses the response cannot know whether the server acted.
// With an idempotency key it retries safely: the first request runs the handler and its
// response is stored; a retry with the same key gets the stored response, marked
// Idempotent-Replayed: true, and the handler does not run again.
//
// # Quick start
//
//	mw, err := pgidemhttp.New(coord, &pgidemhttp.Config{
//		Principal: func(r *http.Request) (string, error) { return auth.UserID(r.Context()) },
//	})
//	if err != nil { ... }
//	mux.Handle("POST /orders", mw.Handler(http.HandlerFunc(createOrder)))
//
// A client sends
//
//	POST /orders
//	Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"
//
// The value is a structured field string (RFC 8941); an unquoted token is accepted too.
//
// # Semantics
//
// Following the draft (section 2.7):
//   - a missing key where [Config.Required]: 400.
//   - the key reused with a different request (method, path, query or body, by
//     [Config.Fingerprint]): 422. That holds also after a response that was not stored
//     released a record that had been taken over from a server that died, since that
//     server may have acted on the first request. (Not stored, by [Config.Store]: 5xx and
//     a few retryable 4xx by default, or a panic before any status.) A first record
//     released is deleted, and the key is free.
//   - a retry while the first request is still being handled: 409 with Retry-After.
//   - a retry after it completed: the stored status, body and allowlisted headers
//     ([Config.ReplayHeaders]), with Idempotent-Replayed: true.
//
// Error responses are problem details (RFC 9457, [Problem]). Keys are scoped to the caller
// ([Config.Principal]): the record's key is [RecordKey], a digest of the principal and the
// Idempotency-Key, so one caller can never receive another's response. The record holds
// an unsalted digest, not the principal itself (a dictionary of likely principals, such as
// e-mail addresses, can still find it). A replay re-checks nothing the handler would have
// checked, so the principal must be the finest identity whose authorization can differ
// ([PrincipalFunc]).
//
// Server errors (5xx), 401, 403, 407, 408, 425, 429 and panics before any status are not
// stored by default ([Config.Store]): the key is released, so a retry runs the handler
// again. A client that goes away once the handler started does not cancel its context
// unless [Config.CancelWithClient]: its retry reads the outcome, so the handler finishes. A
// store that cannot be reached before the handler runs is answered 503 and the handler
// does not run. A request is never run unprotected unless the coordinator opted into
// [pgidem.Config.FailOpen].
//
// While the handler runs, the record is in progress under the coordinator's lease, renewed
// by the heartbeat. A server that dies mid-request stops renewing. A retry after the lease
// then takes over and runs the handler again, and the record's attempts count 2. So the
// guarantee for effects outside the database is the coordinator's: at most once while the
// holder lives.
//
// Hence key the handler's own effects too, under [ScopedKey], which is scoped to the
// caller and to the request's fingerprint. Give each effect a namespace of its own. Write
// rows with [pgidem.DoTx] or [pgidem.DoInTx], which commit them with their record, and
// call other services with [pgidem.Do]. The retry that runs the handler again then
// replays every effect whose record completed.
//
//	key, ok := pgidemhttp.ScopedKey(ctx)
//	if !ok {
//		// No Idempotency-Key (Config.Required false); pgidem.Do refuses an empty key.
//		http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
//		return
//	}
//	chargeID, err := pgidem.Do(ctx, coord, "charges", key, ttl, nil, charge)
//	...
//	orderID, err := pgidem.DoInTx(ctx, coord, "orders", key, ttl, nil, insertOrder)
//
// A call cut off mid-way runs again once its lease ends: hand the other service its own
// idempotency key too ([pgidem.KeyFromContext] in fn). Never key effects by the client's
// bare Idempotency-Key: two callers may send the same one.
//
// # Outcomes
//
// A request with a key is one [pgidem.DoResult] call, and the middleware answers by the
// call's [pgidem.Result.Outcome]:
//   - executed, taken_over, fail_open: the handler's own response.
//   - replayed, waited_replayed: the stored response.
//   - in_progress: 409 with Retry-After ([pgidem.Result.RetryAfter], within
//     [Config.RetryAfterMax]).
//   - fingerprint_mismatch: 422.
//   - store_error: 503 ("store_unavailable").
//   - a handler's response that could not be stored (not_stored, lease_lost, or a store
//     error as it completed): logged. When the handler wrote nothing, 503
//     ("outcome_unknown"), or 409 after a takeover.
//   - stored_failure (a record the middleware cannot replay), invalid_key, or none: 500,
//     or a bare 503 when the client went away.
//
// # Stored responses
//
// A response is stored as next wrote it: the status, the body (within
// [Config.MaxResponseBytes]) and the headers in [Config.ReplayHeaders] as they were when
// the status was sent; not trailers. A handler that returns without writing answers 200
// (net/http's rule), and that is stored too. A handler that gives up without an answer to
// replay should write an error status, or panic with [http.ErrAbortHandler] before it
// writes anything.
//
// The body is what next wrote, whether or not it reached the client. When a write of it
// failed (the client went away, a write timeout), it is left out unless next declared a
// Content-Length that it matches. When next wrote less than it declared it is left out
// too. A replay never passes part of a body off as all of it, since next may have stopped
// at the failed write. Bytes beyond a declared Content-Length, which net/http refuses, are
// not part of it.
//
// The body is also left out, and then the headers, when the record's JSON would be too
// long for the coordinator ([pgidem.Config.MaxValueBytes]). A replay without the body it
// had carries Idempotent-Body-Omitted: true ([HeaderBodyOmitted]).
//
// # Refused requests
//
// Requests the middleware refuses never reach next. They are answered with problem details
// (RFC 9457, Content-Type application/problem+json; [Problem]):
//   - a missing key when [Config.Required]: 400.
//   - an invalid key, or one longer than the coordinator's [pgidem.Config.MaxKeyBytes]
//     less 23 bytes: 400. It is counted as the coordinator's own refusals are:
//     [pgidem.EventInvalidKey] under [Config.Namespace].
//   - a body over [Config.MaxRequestBytes]: 413.
//   - a caller [Config.Principal] cannot name: 500.
//   - a store that cannot be reached: 503. The request is not run unprotected, unless the
//     coordinator opted into [pgidem.Config.FailOpen].
//
// The body is read before Principal is called; Principal and next may both read it, from
// memory.
//
// # The handler's context
//
// next runs with a context that carries the key: [RequestKey] and [ScopedKey] give it,
// and [pgidem.KeyFromContext] gives the record's. The client going away does not cancel
// it, unless [Config.CancelWithClient]: the client's retry reads the outcome, so next
// finishes its work. A deadline an outer handler set on the request still applies, and a
// reservation or a wait before next runs still ends with the client. The context is
// cancelled with cause [pgidem.ErrLeaseLost] when the record's lease cannot be kept: the
// store is unreachable, or another request took the key over.
//
// When next returns without writing and its response could not be stored, the middleware
// answers for it: 409 with Retry-After when the key was taken over, else 503 (code
// "outcome_unknown").
//
// The response writer given to next supports [http.ResponseController] and the interfaces
// it unwraps to (Flush, Hijack, deadlines) as far as the server's writer does. It always
// has a Hijack method, which returns an error matching [http.ErrNotSupported] when the
// server's writer cannot hijack (HTTP/2).
//
// # Observing requests
//
// [Config.Hook] sees every request the middleware applies to, refused ones included. Its
// OnRequest gives the request its context, which next runs with; OnResponse receives a
// [Response] with the call's outcome and the status the client was sent. Package
// pgidemotel's hook opens a span per request with it.
//
// # Nesting
//
// Under another Middleware (one wrapping another), a request whose record the outer one
// already holds (same namespace and record key) passes to next. Otherwise the inner one
// keeps a record of its own, by its own settings. An outer middleware with a coarser
// principal replays by that principal before the inner one is reached, so give the
// outermost the finest.
//
// # Timeouts
//
// Do not use [http.TimeoutHandler] with the middleware. Outside it, it may discard a
// response the record keeps. Inside it, around next, it answers 503 while next is still
// running. The 503 is not stored, the key is released, and a retry runs next beside the
// first run. Bound a request with the server's timeouts, or with a deadline next observes
// before it answers. After a server timeout a failed write leaves the body out unless
// next declared a Content-Length it matches, and next runs once. A handler whose effects
// are keyed with [ScopedKey] stays safe either way: a second run waits for the first
// run's effects and replays them.
//
// # Publishing the policy
//
// The draft (section 2.5) asks a server to publish its idempotency policy for its
// clients. With the defaults, it is:
//   - keys on POST and PATCH, optional unless [Config.Required].
//   - up to 232 bytes of printable ASCII, scoped to the caller.
//   - a response replayed for 24 hours after the first request completed ([Config.TTL]).
//   - the same key with another method, path, query or body answered 422.
//   - 5xx, 401, 403, 407, 408, 425 and 429 not stored, so a retry of those runs again
//     ([Config.Store]).
//   - 409 with Retry-After while the first request runs.
//
// Set [Config.ProblemType] to the page that says so.
//
// # Records
//
// Records live in pgidem_record like any other, in [Config.Namespace] ("http") under
// [RecordKey]. The result column holds the response as JSON, in plain JSON for the TTL:
// status, header, and the body. The body is "text" when it is UTF-8 without NUL characters
// (which jsonb cannot hold), else base64 "body". Expired records are deleted by a sweep you
// schedule: [pgidem.Coordinator.Sweep], `pgidem sweep` from cron, or the River periodic
// job of package pgidemriver. Every distinct key a client sends is a record until then.
package pgidemhttp
