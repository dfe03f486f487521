package pgidemotel

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/pgidem/pgidem"
)

const (
	// TracerName is the instrumentation scope of the tracer the hook creates.
	TracerName = MeterName

	// SpanPrefix starts every span's name; the operation ([pgidem.CallStart.Op]) follows:
	// "pgidem.Do", "pgidem.DoTx", "pgidem.InboxHandle".
	SpanPrefix = "pgidem."

	// WaitMetric is the histogram of the time a call took before its outcome: until fn
	// began or, when fn did not run, until the call returned ([pgidem.CallEnd.Wait]).
	// Attributes: namespace, operation, outcome, waited. Unit: s.
	WaitMetric = "pgidem.call.wait.duration"

	// FnMetric is the histogram of fn's duration, for calls whose fn ran. Attributes:
	// namespace, operation, outcome. Unit: s.
	FnMetric = "pgidem.fn.duration"

	// RoundDurationMetric is the histogram of each shared round's latency, from sending
	// its statement to reading its last row. Attributes: round kind, db.system.name. Unit: s.
	RoundDurationMetric = "pgidem.round.duration"

	// RoundSizeMetric is the histogram of the calls each shared round carried.
	// Attributes: round kind, db.system.name. Unit: {call}.
	RoundSizeMetric = "pgidem.round.size"

	// OperationAttribute holds the call's operation ([pgidem.CallStart.Op]).
	OperationAttribute = "pgidem.operation"
	// OutcomeAttribute holds the call's [pgidem.Outcome] ("" when it ended before one).
	OutcomeAttribute = "pgidem.outcome"
	// AttemptsAttribute holds the record's attempts after the call (spans only).
	AttemptsAttribute = "pgidem.attempts"
	// WaitedAttribute says whether the call waited for another holder.
	WaitedAttribute = "pgidem.waited"
	// TookOverAttribute says whether the call took over an expired lease (spans only).
	TookOverAttribute = "pgidem.took_over"
	// KeyAttribute holds the idempotency key (the message id for inbox calls), only with
	// [WithKeys].
	KeyAttribute = "pgidem.key"
	// RoundAttribute holds a shared round's kind: "reserve", "complete" or "read".
	RoundAttribute = "pgidem.round"
	// DBSystemAttribute is OpenTelemetry's semantic-convention attribute for the database
	// system; its value is always "postgresql".
	DBSystemAttribute = "db.system.name"

	// TakenOverEvent is the span event of a takeover: the effect may have run twice.
	TakenOverEvent = "pgidem.taken_over"
	// LeaseLostEvent is the span event of a lost lease: the effect may have run twice.
	LeaseLostEvent = "pgidem.lease_lost"
)

// durationBuckets are the bucket bounds of the duration histograms, in seconds
// (OpenTelemetry's semantic conventions advise these for HTTP and database durations).
var durationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10}

// sizeBuckets are the bucket bounds of [RoundSizeMetric].
var sizeBuckets = []float64{1, 2, 4, 8, 16, 32, 64, 128, 256}

var dbSystem = attribute.String(DBSystemAttribute, "postgresql")

// Option configures [NewHook].
type Option func(*options)

type options struct {
	tracerProvider trace.TracerProvider
	tracerSet      bool
	keys           bool
}

// WithTracerProvider makes the hook trace each call in a span from a tracer named
// [TracerName] of provider. Default: no spans (metrics only).
func WithTracerProvider(provider trace.TracerProvider) Option {
	return func(o *options) { o.tracerProvider, o.tracerSet = provider, true }
}

// WithKeys adds the idempotency key (the message id for inbox calls) to each span as
// [KeyAttribute]. Keys can carry personal data (an e-mail address, an order of a named
// customer): turn it on only where your traces may hold it. Default: off.
func WithKeys() Option { return func(o *options) { o.keys = true } }

// callInstruments are the hook's histograms and tracer (nil: no spans).
type callInstruments struct {
	wait, fn, roundDuration metric.Float64Histogram
	roundSize               metric.Int64Histogram
	tracer                  trace.Tracer
	keys                    bool
}

func newCallInstruments(meter metric.Meter, o *options) (callInstruments, error) {
	ci := callInstruments{keys: o.keys}
	if o.tracerProvider != nil {
		ci.tracer = o.tracerProvider.Tracer(TracerName)
	}
	var err error
	for _, h := range []struct {
		dst        *metric.Float64Histogram
		name, desc string
	}{
		{&ci.wait, WaitMetric, "time pgidem calls took before their outcome: reservation, waits for another holder, replay"},
		{&ci.fn, FnMetric, "duration of the effects (fn) pgidem ran"},
		{&ci.roundDuration, RoundDurationMetric, "latency of pgidem's shared reading, reserving and completing statements"},
	} {
		*h.dst, err = meter.Float64Histogram(h.name, metric.WithUnit("s"), metric.WithDescription(h.desc),
			metric.WithExplicitBucketBoundaries(durationBuckets...))
		if err != nil {
			return ci, fmt.Errorf("pgidemotel: NewHook: create histogram %s: %w", h.name, err)
		}
	}
	ci.roundSize, err = meter.Int64Histogram(RoundSizeMetric, metric.WithUnit("{call}"),
		metric.WithDescription("calls carried by each of pgidem's shared statements"),
		metric.WithExplicitBucketBoundaries(sizeBuckets...))
	if err != nil {
		return ci, fmt.Errorf("pgidemotel: NewHook: create histogram %s: %w", RoundSizeMetric, err)
	}
	return ci, nil
}

// OnCallStart starts the call's span (with [WithTracerProvider]) and returns ctx carrying
// it; without a tracer it returns ctx. Part of [pgidem.CallHook].
func (h *Hook) OnCallStart(ctx context.Context, call pgidem.CallStart) context.Context {
	if h == nil || h.calls.tracer == nil {
		return ctx
	}
	attrs := []attribute.KeyValue{dbSystem, attribute.String(NamespaceAttribute, call.Namespace),
		attribute.String(OperationAttribute, call.Op)}
	if h.calls.keys {
		attrs = append(attrs, attribute.String(KeyAttribute, call.Key))
	}
	ctx, _ = h.calls.tracer.Start(ctx, SpanPrefix+call.Op, trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(attrs...))
	return ctx
}

// OnCallEnd records the call's [WaitMetric] and [FnMetric] and ends its span with the
// outcome's attributes. Part of [pgidem.CallHook].
func (h *Hook) OnCallEnd(ctx context.Context, call pgidem.CallEnd) {
	if h == nil || h.calls.wait == nil {
		return
	}
	attrs := metric.WithAttributes(attribute.String(NamespaceAttribute, call.Namespace),
		attribute.String(OperationAttribute, call.Op), attribute.String(OutcomeAttribute, string(call.Outcome)))
	h.calls.wait.Record(ctx, call.Wait.Seconds(), attrs, metric.WithAttributes(attribute.Bool(WaitedAttribute, call.Waited)))
	if call.Fn > 0 {
		h.calls.fn.Record(ctx, call.Fn.Seconds(), attrs)
	}
	if h.calls.tracer == nil {
		return
	}
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String(OutcomeAttribute, string(call.Outcome)),
		attribute.Int(AttemptsAttribute, call.Attempts), attribute.Bool(WaitedAttribute, call.Waited),
		attribute.Bool(TookOverAttribute, call.TookOver))
	if call.Err != nil {
		span.RecordError(call.Err)
		span.SetStatus(codes.Error, call.Err.Error())
	}
	span.End()
}

// OnRound records a shared round's [RoundDurationMetric] and [RoundSizeMetric]. Part of
// [pgidem.RoundHook].
func (h *Hook) OnRound(ctx context.Context, round pgidem.Round) {
	if h == nil || h.calls.roundDuration == nil {
		return
	}
	attrs := metric.WithAttributes(attribute.String(RoundAttribute, round.Kind), dbSystem)
	h.calls.roundDuration.Record(ctx, round.Latency.Seconds(), attrs)
	h.calls.roundSize.Record(ctx, int64(round.Size), attrs)
}

// spanEvent adds a takeover's or a lost lease's event to the call's span.
func (ci *callInstruments) spanEvent(ctx context.Context, event pgidem.Event) {
	if ci.tracer == nil {
		return
	}
	var name string
	switch event.Kind {
	case pgidem.EventTakenOver:
		name = TakenOverEvent
	case pgidem.EventLeaseLost:
		name = LeaseLostEvent
	default:
		return
	}
	trace.SpanFromContext(ctx).AddEvent(name, trace.WithAttributes(attribute.String(NamespaceAttribute, event.Namespace)))
}
