package pgidemotel_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	pgidemotel "github.com/pgidem/pgidem/otel"
	"github.com/pgidem/pgidem/pgidem"
)

// Wiring pgidem's spans to an OpenTelemetry collector over OTLP/HTTP (localhost:4318, or
// OTEL_EXPORTER_OTLP_ENDPOINT) and its metrics to a meter provider (give it the reader or
// exporter of your choice). Every Do then shows as a "pgidem.Do" span under the caller's.
// It needs a collector and a database, so it is compiled, not run.
func Example_otlp() {
	ctx := context.Background()
	exporter, err := otlptracehttp.New(ctx, otlptracehttp.WithInsecure())
	if err != nil {
		log.Fatal(err)
	}
	tracerProvider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter))
	defer tracerProvider.Shutdown(ctx) //nolint:errcheck // flushes the last spans
	meterProvider := sdkmetric.NewMeterProvider()
	defer meterProvider.Shutdown(ctx) //nolint:errcheck

	hook, err := pgidemotel.NewHook(meterProvider, pgidemotel.WithTracerProvider(tracerProvider))
	if err != nil {
		log.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Hook: hook})
	if err != nil {
		log.Fatal(err)
	}
	receipt, err := pgidem.Do(ctx, coord, "mail", "order-9.invoice", 24*time.Hour, nil,
		func(ctx context.Context) (string, error) { return "em_1", nil })
	if err != nil {
		log.Fatal(err)
	}
	log.Println("sent", receipt)
}
