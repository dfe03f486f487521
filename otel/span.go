package pgidemotel

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/riverqueue/river/rivertype"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

const (
	// JobSpanName is the name of the span of each River job execution the pgidemriver
	// middleware handles ([Hook.OnJobStart]).
	JobSpanName = "pgidem.river.job"
	// RequestSpanName is the name of the span of each request the pgidemhttp middleware
	// applies to ([Hook.OnRequest]).
	RequestSpanName = "pgidem.http.request"
	// ActionAttribute holds a job's [pgidemriver.Action], what River got: "executed",
	// "replayed", "snoozed" and so on.
	ActionAttribute = "pgidem.river.action"
)

var (
	_ pgidemriver.StartHook = (*Hook)(nil)
	_ pgidemhttp.Hook       = (*Hook)(nil)
)

// riverSystem is the messaging.system of a job's span: River, named as OpenTelemetry's
// conventions name other systems.
var riverSystem = semconv.MessagingSystemKey.String("river")

// jobSpanKey and requestSpanKey carry the span the hook opened for a job or a request, so
// that OnOutcome and OnResponse end their own span and no other.
type (
	jobSpanKey     struct{}
	requestSpanKey struct{}
)

// OnJobStart starts the job's span ([JobSpanName]) with [WithTracerProvider] and returns
// ctx carrying it; without a tracer it returns ctx. Its attributes follow OpenTelemetry's
// messaging conventions: messaging.system "river", messaging.operation.type "process",
// the queue as messaging.destination.name, the job id as messaging.message.id. Part of
// [pgidemriver.StartHook].
func (h *Hook) OnJobStart(ctx context.Context, job *rivertype.JobRow) context.Context {
	if h == nil || h.calls.tracer == nil {
		return ctx
	}
	return h.calls.startSpan(ctx, jobSpanKey{}, JobSpanName, riverSystem, semconv.MessagingOperationTypeProcess,
		semconv.MessagingDestinationName(job.Queue), semconv.MessagingMessageID(strconv.FormatInt(job.ID, 10)))
}

// OnOutcome ends the job's span that OnJobStart started, with the outcome's attributes
// and [ActionAttribute]. Its status is Error when the job failed (out.Err, but not a
// snooze). Part of [pgidemriver.Hook].
func (h *Hook) OnOutcome(ctx context.Context, out *pgidemriver.Outcome) {
	if h == nil {
		return
	}
	h.calls.endSpan(ctx, jobSpanKey{}, spanEnd{namespace: out.Namespace, key: out.Key, outcome: out.Outcome,
		attempts: out.Attempts, waited: out.Waited, tookOver: out.TookOver, err: out.Err,
		failed: out.Err != nil && out.Action != pgidemriver.ActionSnoozed,
		extra:  attribute.String(ActionAttribute, string(out.Action))})
}

// OnRequest starts the request's span ([RequestSpanName]) with [WithTracerProvider] and
// returns ctx carrying it; without a tracer it returns ctx. Its attribute
// http.request.method follows OpenTelemetry's HTTP conventions. Part of [pgidemhttp.Hook].
func (h *Hook) OnRequest(ctx context.Context, r *http.Request) context.Context {
	if h == nil || h.calls.tracer == nil {
		return ctx
	}
	return h.calls.startSpan(ctx, requestSpanKey{}, RequestSpanName, requestMethod(r.Method)...)
}

// OnResponse ends the request's span that OnRequest started, with the outcome's
// attributes and http.response.status_code. Its status is Error for a 5xx response and
// when the handler panicked. Part of [pgidemhttp.Hook].
func (h *Hook) OnResponse(ctx context.Context, res *pgidemhttp.Response) {
	if h == nil {
		return
	}
	h.calls.endSpan(ctx, requestSpanKey{}, spanEnd{namespace: res.Namespace, key: res.Key, outcome: res.Outcome,
		attempts: res.Attempts, waited: res.Waited, tookOver: res.TookOver, err: res.Err,
		failed: res.Status >= 500 || errors.Is(res.Err, pgidem.ErrPanicked),
		extra:  semconv.HTTPResponseStatusCode(res.Status)})
}

// requestMethod returns the http.request.method of method: itself when it is one of the
// methods RFC 9110 and RFC 5789 define, else "_OTHER" with the method as sent in
// http.request.method_original (OpenTelemetry's rule).
func requestMethod(method string) []attribute.KeyValue {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return []attribute.KeyValue{semconv.HTTPRequestMethodKey.String(method)}
	}
	return []attribute.KeyValue{semconv.HTTPRequestMethodOther, semconv.HTTPRequestMethodOriginal(method)}
}

// startSpan starts a job's or a request's span and returns ctx carrying it, also under
// key.
func (ci *callInstruments) startSpan(ctx context.Context, key any, name string, attrs ...attribute.KeyValue) context.Context {
	ctx, span := ci.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
	return context.WithValue(ctx, key, span)
}

// spanEnd is how a job or a request ended, for its span.
type spanEnd struct {
	namespace, key   string
	outcome          pgidem.Outcome
	attempts         int
	waited, tookOver bool
	err              error
	failed           bool               // the span's status is Error
	extra            attribute.KeyValue // the job's action, the response's status
}

// endSpan ends the span ctx carries under key, if there is one, with e's attributes.
func (ci *callInstruments) endSpan(ctx context.Context, key any, e spanEnd) {
	span, ok := ctx.Value(key).(trace.Span)
	if !ok {
		return
	}
	attrs := []attribute.KeyValue{attribute.String(NamespaceAttribute, e.namespace),
		attribute.String(OutcomeAttribute, string(e.outcome)), attribute.Int(AttemptsAttribute, e.attempts),
		attribute.Bool(WaitedAttribute, e.waited), attribute.Bool(TookOverAttribute, e.tookOver), e.extra}
	if ci.keys {
		attrs = append(attrs, attribute.String(KeyAttribute, e.key))
	}
	span.SetAttributes(attrs...)
	if e.failed {
		var description string
		if e.err != nil {
			span.RecordError(e.err)
			description = e.err.Error()
		}
		span.SetStatus(codes.Error, description)
	}
	span.End()
}
