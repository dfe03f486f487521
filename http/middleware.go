package pgidemhttp

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strings"
	"sync"

	"github.com/pgidem/pgidem/pgidem"
)

// Header names.
const (
	// HeaderKey is the request header that carries the idempotency key
	// (draft-ietf-httpapi-idempotency-key-header).
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is set to "true" on a response replayed from a record, so a client can
	// tell a replay from a fresh execution. It is not in the draft; Stripe's API uses the
	// same name.
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderBodyOmitted is set to "true" on a replay whose stored response has no body
	// although the first response had one, or may have had one. The body was too long for
	// the record, or cut off on its way to the client, or its handler panicked after
	// sending the status, which aborts the response. A client can so tell it from a
	// response that was empty. pgidem's own.
	HeaderBodyOmitted = "Idempotent-Body-Omitted"
)

// Middleware makes POST and PATCH handlers idempotent under the Idempotency-Key request
// header (draft-ietf-httpapi-idempotency-key-header), with records in Postgres kept by a
// [pgidem.Coordinator]. Create it with [New] and wrap handlers with [Middleware.Handler].
// It is safe for concurrent use.
type Middleware struct {
	coord   *pgidem.Coordinator
	config  Config
	methods map[string]bool
	replay  []string // canonical header names
	maxKey  int      // the longest Idempotency-Key, in bytes: what RecordKey leaves of the coordinator's MaxKeyBytes
}

// Handler wraps next. For a request whose method is in [Config.Methods] and that carries
// an Idempotency-Key field:
//   - the first request with a key runs next; its response streams to the client as usual.
//     When [Config.Store] accepts its status, it is stored for [Config.TTL] (see "Stored
//     responses" in the package documentation).
//   - a retry with the key and the same fingerprint gets the stored response, marked
//     Idempotent-Replayed: true, and next does not run.
//   - a retry with a different fingerprint (another body, path, query or method): 422.
//   - a retry while the first is still running: 409 with Retry-After in seconds (or a
//     wait, [Config.InFlight]).
//   - a response not stored (by default 5xx, 401, 403, 407, 408, 425 and 429; a panic
//     before any status, a hijacked connection, 101 Switching Protocols) releases the
//     key: a retry runs next again. A panic after a status is stored by that status,
//     without its body ([Config.Store]), and goes on.
//   - a request the middleware refuses never reaches next and gets problem details: see
//     "Refused requests".
//
// next runs with a context that carries the key ([RequestKey], [ScopedKey]), that the
// client going away does not cancel, and that is cancelled with cause
// [pgidem.ErrLeaseLost] when the record's lease cannot be kept ("The handler's context").
// Do not use [http.TimeoutHandler] with the middleware ("Timeouts"). The response writer
// given to next supports [http.ResponseController] as far as the server's writer does.
// Safe for concurrent use.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Without regard to case: methods are case-sensitive (RFC 9110, section 9.1), so
		// "post" is not POST, but a handler that does not check the method would run it as
		// one, unprotected and past Required.
		if !m.methods[r.Method] && !m.methods[strings.ToUpper(r.Method)] {
			next.ServeHTTP(w, r)
			return
		}
		if m.config.Hook != nil {
			m.serveHooked(w, r, next)
			return
		}
		m.serve(w, r, next, nil)
	})
}

// serve handles a request the middleware applies to: it admits the request, runs the call
// for its record, and answers by the call's outcome ([actionFor]). It reports the key and
// the call in res, for the [Hook] (nil without one).
func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler, res *Response) {
	rk, ok := m.admit(w, r, next)
	res.admitted(rk.key)
	if !ok {
		return
	}
	recordKey := RecordKey(rk.principal, rk.key)
	if outer, nested := r.Context().Value(requestKeyContextKey{}).(requestKey); nested && outer.namespace == rk.namespace && RecordKey(outer.principal, outer.key) == recordKey {
		next.ServeHTTP(w, r) // an outer middleware holds this very record
		return
	}
	c := &call{m: m, w: w, r: r, next: next, recordKey: recordKey,
		outer: w.Header().Clone()} // what outer handlers set: kept if the middleware answers after next
	defer res.called(c)
	ctx, start, stop := m.callContext(context.WithValue(r.Context(), requestKeyContextKey{}, rk))
	defer stop()
	c.ctx, c.start = ctx, start
	opts := &pgidem.DoOpts{
		Fingerprint: rk.fingerprint,
		InFlight:    m.config.InFlight,
		WaitTimeout: m.config.WaitTimeout,
		// Most requests name a new key (a retry is the exception): the reserving insert
		// saves the read a call would start with (docs/performance.md).
		ReserveFirst: true,
	}
	c.res, c.err = pgidem.DoResult(ctx, m.coord, m.config.Namespace, recordKey, m.config.TTL, opts, c.run)
	if c.panicked != nil {
		panic(c.panicked) // as net/http expects: it aborts the response
	}
	actionFor(c.res.Outcome)(c)
}

// call is one request's call for its record: what the outcome's action needs to answer.
type call struct {
	m         *Middleware
	w         http.ResponseWriter
	r         *http.Request // as the middleware received it
	next      http.Handler
	recordKey string
	outer     http.Header     // the response headers outer handlers set before the call
	ctx       context.Context // the call's ([Middleware.callContext])
	start     func() bool

	rec      *recorder // set once next starts
	panicked any       // next's panic after it sent a status, raised again once it is stored
	replayed bool      // the stored response was sent
	res      pgidem.Result[json.RawMessage]
	err      error
}

// run is the call's fn: it runs next with a recorder and returns the response to store,
// or errNotStored to release the key. A panic of next after it sent its status is
// recovered into c.panicked once the response is stored; one before goes on.
func (c *call) run(ctx context.Context) (v json.RawMessage, err error) {
	if !c.start() {
		return nil, errNotStored // the client went away as next was about to start
	}
	m := c.m
	c.rec = &recorder{ResponseWriter: c.w, max: m.config.MaxResponseBytes, replay: m.replay}
	returned := false
	defer func() {
		if returned || !c.rec.wrote || c.rec.hijacked || c.rec.switched {
			return // a panic before any status: it goes on, and the key is released
		}
		c.panicked = recover()
		v, err = c.storePanicked(ctx)
	}()
	c.next.ServeHTTP(c.rec, c.r.WithContext(ctx))
	returned = true
	if c.rec.hijacked || c.rec.switched {
		return nil, errNotStored
	}
	return m.stored(ctx, c.rec, c.recordKey)
}

// storePanicked logs next's panic after it sent its status (unless it is
// [http.ErrAbortHandler]) and returns the response to store, without its body.
func (c *call) storePanicked(ctx context.Context) (json.RawMessage, error) {
	m := c.m
	if c.panicked != http.ErrAbortHandler {
		// It is raised again from serve, so net/http's log would show that stack, not next's.
		m.config.Logger.ErrorContext(ctx, "pgidemhttp: the handler panicked after it sent its status; the response is stored without its body",
			slog.String("namespace", m.config.Namespace), slog.String("key", c.recordKey),
			slog.Any("panic", c.panicked), slog.String("stack", string(debug.Stack())))
	}
	c.rec.omitBody()
	return m.storedAfterPanic(ctx, c.rec, c.recordKey)
}

// callContext returns the context the call runs with, from the request's (ctx). Unless
// [Config.CancelWithClient], the request's cancellation cancels it only until start is
// called (when next is about to start). So a reservation or a wait still ends with the
// client, but next runs to the end. start reports false when the cancellation came first:
// next must not start. The request's deadline (an outer handler's) still applies, and the
// values stay. stop releases it.
func (m *Middleware) callContext(ctx context.Context) (call context.Context, start func() bool, stop func()) {
	if m.config.CancelWithClient {
		return ctx, func() bool { return true }, func() {}
	}
	call, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	stopDeadline := context.CancelFunc(func() {})
	if deadline, ok := ctx.Deadline(); ok {
		call, stopDeadline = context.WithDeadline(call, deadline)
	}
	var mu sync.Mutex
	running := false
	stopAfter := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if !running {
			cancel(context.Cause(ctx))
		}
	})
	start = func() bool {
		mu.Lock()
		defer mu.Unlock()
		running = true
		return call.Err() == nil
	}
	return call, start, func() { stopAfter(); stopDeadline(); cancel(nil) }
}
