// Package pgidemotel reports pgidem's outcomes as OpenTelemetry metrics.
//
// [Hook] implements [pgidem.Hook]: install it in [pgidem.Config.Hook] and every outcome
// (executed, replayed, in progress, waited, taken over, lease lost, store error, invalid
// key, fingerprint mismatch, fail-open, swept, inbox recorded, inbox duplicate) adds to
// one counter, [EventsMetric], with the event kind and the record's namespace (the
// consumer, for inbox events) as attributes:
//
//	hook, err := pgidemotel.NewHook(meterProvider)
//	if err != nil { ... }
//	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Hook: hook})
//
// Alert on the kinds that mean an effect may have run twice (taken_over, lease_lost) and on
// fail_open and store_error.
package pgidemotel

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgidem/pgidem/pgidem"
)

const (
	// MeterName is the instrumentation scope of the meter the hook creates.
	MeterName = "github.com/pgidem/pgidem/otel"

	// EventsMetric is the counter's name. Unit: events ({event}); for the swept kind, rows.
	EventsMetric = "pgidem.events"

	// KindAttribute is the attribute holding the [pgidem.EventKind], e.g. "replayed".
	KindAttribute = "pgidem.event"

	// NamespaceAttribute is the attribute holding the record's namespace ("" for sweeps).
	// Namespaces name kinds of effect (a job kind, "mail"), so their number stays small;
	// do not put per-request values in the namespace.
	NamespaceAttribute = "pgidem.namespace"
)

// Hook adds each [pgidem.Event] to an OpenTelemetry counter. Create it with [NewHook]. It
// is safe for concurrent use, as [pgidem.Hook] requires.
type Hook struct {
	events metric.Int64Counter
}

var _ pgidem.Hook = (*Hook)(nil)

// NewHook creates the [EventsMetric] counter on a meter named [MeterName] from provider.
// It returns an error when provider is nil or the counter cannot be created.
func NewHook(provider metric.MeterProvider) (*Hook, error) {
	if provider == nil {
		return nil, errors.New("pgidemotel: NewHook: provider is nil")
	}
	events, err := provider.Meter(MeterName).Int64Counter(EventsMetric,
		metric.WithUnit("{event}"),
		metric.WithDescription("pgidem outcomes by kind: executed, replayed, in_progress, waited, taken_over, lease_lost, store_error, invalid_key, fingerprint_mismatch, fail_open, swept (rows), inbox_recorded, inbox_duplicate"))
	if err != nil {
		return nil, fmt.Errorf("pgidemotel: NewHook: create counter: %w", err)
	}
	return &Hook{events: events}, nil
}

// OnEvent adds event.Count to the counter with the kind and namespace attributes.
func (h *Hook) OnEvent(ctx context.Context, event pgidem.Event) {
	h.events.Add(ctx, event.Count, metric.WithAttributes(
		attribute.String(KindAttribute, string(event.Kind)),
		attribute.String(NamespaceAttribute, event.Namespace),
	))
}
