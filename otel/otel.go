// Package pgidemotel reports pgidem's outcomes as OpenTelemetry metrics and traces.
//
// [Hook] implements [pgidem.Hook]. Install it in [pgidem.Config.Hook] and every outcome
// adds one to a counter, [EventsMetric]: executed, replayed, in progress, waited, taken
// over, lease lost, store error, invalid key, fingerprint mismatch, fail-open, inbox
// recorded, inbox duplicate. Its attributes are the event kind and the record's namespace
// (the consumer, for inbox events). The rows a sweep deletes add to a second counter,
// [SweptMetric], so each counter has one unit.
//
//	hook, err := pgidemotel.NewHook(meterProvider, pgidemotel.WithTracerProvider(tracerProvider))
//	if err != nil { ... }
//	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Hook: hook})
//
// Alert on the kinds that mean an effect may have run twice (taken_over, lease_lost) and on
// fail_open and store_error.
//
// # Histograms
//
// The hook also implements [pgidem.CallHook] and [pgidem.RoundHook]. It records, in
// seconds, the time each call took before its outcome ([WaitMetric]: the reservation, any
// wait for another holder, a replay) and fn's duration ([FnMetric]). Their attributes are
// the namespace, operation and outcome. It also records each shared round's latency
// ([RoundDurationMetric]) and size ([RoundSizeMetric]).
//
// # Traces
//
// With [WithTracerProvider], each Do, DoTx, DoInTx, DoSQLTx and inbox call runs in a span
// of its own, named [SpanPrefix] and the operation, such as "pgidem.Do". It is a child of
// the span in the caller's context. Its attributes are db.system.name ("postgresql"), the
// namespace, operation, outcome, attempts, waited and took over; the key only with
// [WithKeys], since keys can carry personal data. A takeover and a lost lease add an
// event to the call's span ([TakenOverEvent], [LeaseLostEvent]); an error sets the span's
// status to Error.
//
// Put the same hook in the Config.Hook of pgidemriver and pgidemhttp too, and it opens a
// span per River job and per HTTP request their middlewares handle; the call's span is its
// child.
//
//	mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{Hook: hook})
//	httpMW, err := pgidemhttp.New(coord, &pgidemhttp.Config{Principal: principal, Hook: hook})
//
// A job's span, [JobSpanName], has OpenTelemetry's messaging attributes
// (messaging.system "river", messaging.operation.type "process", the queue as
// messaging.destination.name, the job id as messaging.message.id) and the action River
// got ([ActionAttribute]). A request's span, [RequestSpanName], has http.request.method
// and http.response.status_code; its key, with WithKeys, is the client's Idempotency-Key.
// Both have the outcome's attributes, as a call's span does. A failed job (not a snooze)
// and a 5xx response set the status to Error. Their kind is Internal: when River's
// otelriver or otelhttp wraps the middleware, pgidem's span nests under theirs, which
// stay the consumer's or the server's span.
package pgidemotel

import (
	"context"
	"fmt"
	"reflect"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgidem/pgidem/pgidem"
)

const (
	// MeterName is the instrumentation scope of the meter the hook creates.
	MeterName = "github.com/pgidem/pgidem/otel"

	// EventsMetric is the name of the counter of outcomes, one per event. Unit: {event}.
	EventsMetric = "pgidem.events"

	// SweptMetric is the name of the counter of expired rows deleted by sweeps (records
	// and inbox rows alike; [pgidem.EventSwept]), without attributes. Unit: {row}.
	SweptMetric = "pgidem.swept"

	// KindAttribute is the attribute holding the [pgidem.EventKind], e.g. "replayed".
	KindAttribute = "pgidem.event"

	// NamespaceAttribute is the attribute holding the record's namespace ("" for a sweep's
	// store error, and for an invalid_key event whose namespace was itself rejected, so
	// rejected input never becomes an attribute value). Namespaces name kinds of effect (a
	// job kind, "mail"), so their number stays small; do not put per-request values in the
	// namespace.
	NamespaceAttribute = "pgidem.namespace"
)

// Hook adds each [pgidem.Event] to an OpenTelemetry counter. Create it with [NewHook]; a
// zero Hook (or a nil *Hook) counts nothing. It is also a [pgidemriver.StartHook] and a
// [pgidemhttp.Hook], which trace jobs and requests ("Traces"). It is safe for concurrent
// use, as [pgidem.Hook] requires.
type Hook struct {
	events, swept metric.Int64Counter
	calls         callInstruments
}

var (
	_ pgidem.Hook      = (*Hook)(nil)
	_ pgidem.CallHook  = (*Hook)(nil)
	_ pgidem.RoundHook = (*Hook)(nil)
)

// NewHook creates the [EventsMetric] and [SweptMetric] counters and the histograms
// ([WaitMetric], [FnMetric], [RoundDurationMetric], [RoundSizeMetric]) on a meter named
// [MeterName] from provider; opts add traces ([WithTracerProvider]) and keys ([WithKeys]).
// It returns an error matching [pgidem.ErrInvalidArgument] when provider (or the tracer
// provider given) is nil, also a nil pointer in the interface, such as a
// (*sdkmetric.MeterProvider)(nil), and the provider's error when an instrument cannot be
// created.
func NewHook(provider metric.MeterProvider, opts ...Option) (*Hook, error) {
	if provider == nil || isNilPointer(provider) {
		return nil, fmt.Errorf("pgidemotel: NewHook: provider is nil: %w", pgidem.ErrInvalidArgument)
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.tracerSet && (o.tracerProvider == nil || isNilPointer(o.tracerProvider)) {
		return nil, fmt.Errorf("pgidemotel: NewHook: tracer provider is nil: %w", pgidem.ErrInvalidArgument)
	}
	meter := provider.Meter(MeterName)
	events, err := meter.Int64Counter(EventsMetric,
		metric.WithUnit("{event}"),
		metric.WithDescription("pgidem outcomes by kind: executed, replayed, in_progress, waited, taken_over, lease_lost, store_error, invalid_key, fingerprint_mismatch, fail_open, inbox_recorded, inbox_duplicate"))
	if err != nil {
		return nil, fmt.Errorf("pgidemotel: NewHook: create counter %s: %w", EventsMetric, err)
	}
	swept, err := meter.Int64Counter(SweptMetric,
		metric.WithUnit("{row}"),
		metric.WithDescription("expired pgidem records and inbox rows deleted by sweeps"))
	if err != nil {
		return nil, fmt.Errorf("pgidemotel: NewHook: create counter %s: %w", SweptMetric, err)
	}
	calls, err := newCallInstruments(meter, &o)
	if err != nil {
		return nil, err
	}
	return &Hook{events: events, swept: swept, calls: calls}, nil
}

// isNilPointer reports whether v holds a nil pointer, which most providers' methods
// dereference.
func isNilPointer(v any) bool {
	rv := reflect.ValueOf(v)
	return rv.Kind() == reflect.Pointer && rv.IsNil()
}

// OnEvent adds event.Count to [SweptMetric] for [pgidem.EventSwept], and to
// [EventsMetric] with the kind and namespace attributes for every other kind.
func (h *Hook) OnEvent(ctx context.Context, event pgidem.Event) {
	if h == nil || h.events == nil {
		return
	}
	if event.Kind == pgidem.EventSwept {
		h.swept.Add(ctx, event.Count)
		return
	}
	h.calls.spanEvent(ctx, event)
	h.events.Add(ctx, event.Count, metric.WithAttributes(
		attribute.String(KindAttribute, string(event.Kind)),
		attribute.String(NamespaceAttribute, event.Namespace),
	))
}
