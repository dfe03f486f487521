package pgidemhttp

import (
	"bufio"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"

	"github.com/pgidem/pgidem/pgidem"
)

// Hook observes the requests a [Middleware] applies to (their method is in
// [Config.Methods]), refused ones included, for tracing and metrics: package pgidemotel
// opens a span per request. Set it in [Config.Hook]. Its methods are called on the
// request's goroutine, from many goroutines at once: they must be fast and safe for
// concurrent use. A panic in either is recovered and logged at error ([Config.Logger]);
// the request goes on, and its response stands.
type Hook interface {
	// OnRequest is called first, before the middleware reads the key; r must not be
	// modified. The context it returns is the request's from then on: the middleware's
	// call for the record, its events and next receive it or one derived from it. Return
	// ctx itself to add nothing; after a nil context or a panic the request keeps ctx.
	OnRequest(ctx context.Context, r *http.Request) context.Context
	// OnResponse is called once the middleware answered the request, with the context
	// OnRequest returned. It is called also when next panicked; the panic then goes on.
	// res is valid only during the call.
	OnResponse(ctx context.Context, res *Response)
}

// Response describes how a [Middleware] answered a request, for a [Hook].
type Response struct {
	// Namespace is the record namespace, [Config.Namespace].
	Namespace string
	// Key is the request's Idempotency-Key as parsed from the field, the client's own (not
	// [RecordKey]); "" when the request has none or an invalid one. Keys can carry
	// personal data: record them only where that is allowed.
	Key string
	// Outcome is pgidem's outcome of the request's call ([pgidem.Result.Outcome]), as in
	// "Outcomes" of the package documentation. [pgidem.OutcomeNone] when there was no
	// call: the request was refused or passed to next without a key, an outer Middleware
	// holds its record, or next panicked before sending a status.
	Outcome pgidem.Outcome
	// Status is the status code sent to the client: next's, a replay's or a problem's;
	// 101 for a protocol switch. 0 when none was sent: a hijacked connection, a panic
	// before any status.
	Status int
	// Replayed is true when a stored response was sent (Idempotent-Replayed: true).
	Replayed bool
	// Waited, TookOver and Attempts are the call's ([pgidem.Result]); zero without one.
	Waited, TookOver bool
	Attempts         int
	// Err is the call's error: next's response could not be stored, another request
	// holds the key, the store failed, and so on. It is nil on success, for a response
	// [Config.Store] chose not to store, and without a call. [pgidem.ErrPanicked] when
	// next panicked.
	Err error
}

// serveHooked is [Middleware.serve] for a middleware with a [Hook]: the request goes on
// with the context OnRequest returned, and OnResponse gets what serve reported and the
// status the client was sent.
func (m *Middleware) serveHooked(w http.ResponseWriter, r *http.Request, next http.Handler) {
	ctx := m.onRequest(r)
	sw := &statusWriter{ResponseWriter: w}
	res := &Response{Namespace: m.config.Namespace}
	returned := false
	defer func() {
		switch {
		case !returned:
			res.Err = pgidem.ErrPanicked
		case sw.status == 0 && !sw.hijacked:
			sw.status = http.StatusOK // net/http's answer for a handler that wrote nothing
		}
		res.Status = sw.status
		m.onResponse(ctx, res)
	}()
	m.serve(sw, r.WithContext(ctx), next, res)
	returned = true
}

// onRequest returns the context OnRequest gives r, or r's own when it gives none or
// panics.
func (m *Middleware) onRequest(r *http.Request) (ctx context.Context) {
	defer func() {
		if p := recover(); p != nil {
			m.hookPanicked(r.Context(), "pgidemhttp: Hook.OnRequest panicked; the request goes on", p)
			ctx = r.Context()
		}
	}()
	if ctx = m.config.Hook.OnRequest(r.Context(), r); ctx == nil {
		return r.Context()
	}
	return ctx
}

// onResponse hands res to OnResponse; a panic there is logged and goes no further.
func (m *Middleware) onResponse(ctx context.Context, res *Response) {
	defer func() {
		if p := recover(); p != nil {
			m.hookPanicked(ctx, "pgidemhttp: Hook.OnResponse panicked; the response stands", p)
		}
	}()
	m.config.Hook.OnResponse(ctx, res)
}

// hookPanicked logs the panic p of a Hook method with msg.
func (m *Middleware) hookPanicked(ctx context.Context, msg string, p any) {
	m.config.Logger.ErrorContext(ctx, msg, slog.String("namespace", m.config.Namespace),
		slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
}

// admitted reports the key the middleware admitted (or "" for none); nil res reports
// nothing, as for a middleware without a Hook.
func (res *Response) admitted(key string) {
	if res != nil {
		res.Key = key
	}
}

// called reports c's call once the middleware answered.
func (res *Response) called(c *call) {
	if res == nil {
		return
	}
	res.Outcome, res.Replayed = c.res.Outcome, c.replayed
	res.Waited, res.TookOver, res.Attempts = c.res.Waited, c.res.TookOver, c.res.Attempts
	if !errors.Is(c.err, errNotStored) {
		res.Err = c.err
	}
}

// statusWriter passes a response through and keeps the status code sent, for the Hook.
// Like [recorder], it has Flush and Hijack methods and unwraps for
// [http.ResponseController].
type statusWriter struct {
	http.ResponseWriter
	status   int
	hijacked bool
}

func (sw *statusWriter) WriteHeader(code int) {
	if sw.status == 0 && !sw.hijacked && (code >= 200 || code == http.StatusSwitchingProtocols) {
		sw.status = code
	}
	sw.ResponseWriter.WriteHeader(code)
}

// implicitOK notes the 200 net/http sends for a write or a flush before any status.
func (sw *statusWriter) implicitOK() {
	if sw.status == 0 && !sw.hijacked {
		sw.status = http.StatusOK
	}
}

func (sw *statusWriter) Write(p []byte) (int, error) {
	sw.implicitOK()
	return sw.ResponseWriter.Write(p)
}

// FlushError sends buffered data to the client ([http.ResponseController]).
func (sw *statusWriter) FlushError() error {
	sw.implicitOK()
	return http.NewResponseController(sw.ResponseWriter).Flush()
}

// Flush implements [http.Flusher] for handlers that assert it.
func (sw *statusWriter) Flush() { _ = sw.FlushError() }

// Hijack hands the connection to the handler ([http.Hijacker]).
func (sw *statusWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(sw.ResponseWriter).Hijack()
	sw.hijacked = sw.hijacked || err == nil
	return conn, rw, err
}

// Unwrap returns the server's writer, for [http.ResponseController].
func (sw *statusWriter) Unwrap() http.ResponseWriter { return sw.ResponseWriter }
