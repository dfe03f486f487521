package pgidemotel_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	pgidemhttp "github.com/pgidem/pgidem/http"
	pgidemotel "github.com/pgidem/pgidem/otel"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// invoiceArgs name their effect: one invoice per order.
type invoiceArgs struct {
	OrderID int64 `json:"order_id"`
}

func (invoiceArgs) Kind() string { return "mail.invoice" }

func (a invoiceArgs) IdempotencyKey() string { return fmt.Sprintf("order-%d.invoice", a.OrderID) }

// waitSpans waits until the exporter holds n spans named name (a job's or a request's span
// ends after River or the client saw its end) and returns them.
func waitSpans(t *testing.T, b *traceBundle, name string, n int) []tracetest.SpanStub {
	t.Helper()
	var named []tracetest.SpanStub
	require.Eventually(t, func() bool {
		named = named[:0]
		for _, s := range b.spans.GetSpans() {
			if s.Name == name {
				named = append(named, s)
			}
		}
		return len(named) >= n
	}, 30*time.Second, 20*time.Millisecond)
	require.Len(t, named, n)
	return named
}

// children returns the spans whose parent is s.
func children(b *traceBundle, s tracetest.SpanStub) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, c := range b.spans.GetSpans() {
		if c.Parent.SpanID() == s.SpanContext.SpanID() {
			out = append(out, c)
		}
	}
	return out
}

// A River job through the middleware, with the hook in the coordinator's and the
// middleware's Config.Hook, runs in a span of its own with the messaging conventions'
// attributes and the outcome's, and the pgidem call's span is its child. A second job with
// the key replays.
func TestJobSpan(t *testing.T) {
	t.Parallel()
	b := setupTracing(t)
	_, err := pgidemriver.MigrateRiver(b.ctx, b.db.Pool, nil)
	require.NoError(t, err)
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{Hook: b.hook})
	require.NoError(t, err)
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, river.WorkFunc(func(context.Context, *river.Job[invoiceArgs]) error { return nil }))
	client, err := river.NewClient(riverpgxv5.New(b.db.Pool), &river.Config{
		FetchCooldown: 10 * time.Millisecond, FetchPollInterval: 50 * time.Millisecond,
		Logger:     slog.New(slog.DiscardHandler),
		Middleware: []rivertype.Middleware{mw},
		Queues:     map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}},
		TestOnly:   true,
		Workers:    workers,
	})
	require.NoError(t, err)
	require.NoError(t, client.Start(b.ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, client.Stop(ctx))
	})

	var ids []int64
	for i := range 2 {
		res, err := client.Insert(b.ctx, invoiceArgs{OrderID: 9}, nil)
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
		waitSpans(t, b, pgidemotel.JobSpanName, i+1) // one after the other: the second replays
	}

	for i, s := range waitSpans(t, b, pgidemotel.JobSpanName, 2) {
		outcome := []string{"executed", "replayed"}[i]
		require.Equal(t, trace.SpanKindInternal, s.SpanKind)
		require.Equal(t, codes.Unset, s.Status.Code)
		a := attrs(s)
		require.Equal(t, "river", a[string(semconv.MessagingSystemKey)].AsString())
		require.Equal(t, "process", a[string(semconv.MessagingOperationTypeKey)].AsString())
		require.Equal(t, river.QueueDefault, a[string(semconv.MessagingDestinationNameKey)].AsString())
		require.Equal(t, strconv.FormatInt(ids[i], 10), a[string(semconv.MessagingMessageIDKey)].AsString())
		require.Equal(t, "mail.invoice", a[pgidemotel.NamespaceAttribute].AsString())
		require.Equal(t, outcome, a[pgidemotel.OutcomeAttribute].AsString())
		require.Equal(t, outcome, a[pgidemotel.ActionAttribute].AsString())
		require.Equal(t, int64(1), a[pgidemotel.AttemptsAttribute].AsInt64())
		require.False(t, a[pgidemotel.WaitedAttribute].AsBool())
		require.False(t, a[pgidemotel.TookOverAttribute].AsBool())
		_, hasKey := a[pgidemotel.KeyAttribute]
		require.False(t, hasKey, "keys are left out unless WithKeys")

		calls := children(b, s)
		require.Len(t, calls, 1, "the call's span is the job span's child")
		require.Equal(t, "pgidem.Do", calls[0].Name)
		require.Equal(t, outcome, attrs(calls[0])[pgidemotel.OutcomeAttribute].AsString())
	}
}

// A job that takes a dead holder's key over says so in its span; the takeover's event
// stays on the call's span, the innermost, and the holder's call span records its lost
// lease. WithKeys adds the key.
func TestJobSpanTakeover(t *testing.T) {
	t.Parallel()
	b := setupTracing(t, pgidemotel.WithKeys())
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{Hook: b.hook})
	require.NoError(t, err)
	mw.Register(invoiceArgs{})
	job := &rivertype.JobRow{ID: 7, Kind: "mail.invoice", EncodedArgs: []byte(`{"order_id":9}`), Attempt: 1,
		Queue: river.QueueDefault, State: rivertype.JobStateRunning}
	_, err = pgidem.Do(b.ctx, b.coord, "mail.invoice", "order-9.invoice", time.Hour, nil, func(context.Context) (string, error) {
		// A stall that outlived the lease: the job takes the key over meanwhile.
		_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second'`)
		require.NoError(t, err)
		require.NoError(t, mw.Work(b.ctx, job, func(context.Context) error { return nil }))
		return "stale", nil
	})
	require.ErrorIs(t, err, pgidem.ErrLeaseLost)

	s := waitSpans(t, b, pgidemotel.JobSpanName, 1)[0]
	a := attrs(s)
	require.Equal(t, "taken_over", a[pgidemotel.OutcomeAttribute].AsString())
	require.True(t, a[pgidemotel.TookOverAttribute].AsBool())
	require.Equal(t, int64(2), a[pgidemotel.AttemptsAttribute].AsInt64())
	require.Equal(t, "order-9.invoice", a[pgidemotel.KeyAttribute].AsString(), "WithKeys adds the key")
	require.Empty(t, eventNames(s))
	calls := children(b, s)
	require.Len(t, calls, 1)
	require.Equal(t, []string{pgidemotel.TakenOverEvent}, eventNames(calls[0]))

	var lost []string
	for _, c := range b.spans.GetSpans() {
		if attrs(c)[pgidemotel.OutcomeAttribute].AsString() == "lease_lost" {
			lost = append(lost, eventNames(c)...)
		}
	}
	require.Equal(t, []string{pgidemotel.LeaseLostEvent}, lost)
}

// Each request the HTTP middleware applies to runs in a span of its own with the HTTP
// conventions' attributes and the outcome's; the call's span is its child. A refused
// request has a span without a call, and a 5xx is an error. WithKeys adds the client's key.
func TestRequestSpan(t *testing.T) {
	t.Parallel()
	for _, withKeys := range []bool{false, true} {
		t.Run(fmt.Sprintf("WithKeys%v", withKeys), func(t *testing.T) {
			t.Parallel()
			var opts []pgidemotel.Option
			if withKeys {
				opts = append(opts, pgidemotel.WithKeys())
			}
			b := setupTracing(t, opts...)
			mw, err := pgidemhttp.New(b.coord, &pgidemhttp.Config{
				Principal: func(*http.Request) (string, error) { return "alice", nil },
				Required:  true,
				Hook:      b.hook,
			})
			require.NoError(t, err)
			srv := httptest.NewServer(mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/fail" {
					w.WriteHeader(http.StatusBadGateway)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			t.Cleanup(srv.Close)

			type want struct {
				status     int
				outcome    string
				call       bool
				statusCode codes.Code
			}
			for i, tt := range []struct {
				path, key string
				want      want
			}{
				{"/orders", "k", want{http.StatusCreated, "executed", true, codes.Unset}},
				{"/orders", "k", want{http.StatusCreated, "replayed", true, codes.Unset}},
				{"/orders", "", want{http.StatusBadRequest, "", false, codes.Unset}},
				{"/fail", "k2", want{http.StatusBadGateway, "executed", true, codes.Error}},
			} {
				req, err := http.NewRequest("POST", srv.URL+tt.path, strings.NewReader("x"))
				require.NoError(t, err)
				if tt.key != "" {
					req.Header.Set(pgidemhttp.HeaderKey, strconv.Quote(tt.key))
				}
				resp, err := srv.Client().Do(req)
				require.NoError(t, err)
				require.NoError(t, resp.Body.Close())
				require.Equal(t, tt.want.status, resp.StatusCode)

				s := waitSpans(t, b, pgidemotel.RequestSpanName, i+1)[i]
				a := attrs(s)
				require.Equal(t, trace.SpanKindInternal, s.SpanKind)
				require.Equal(t, "POST", a[string(semconv.HTTPRequestMethodKey)].AsString())
				require.Equal(t, int64(tt.want.status), a[string(semconv.HTTPResponseStatusCodeKey)].AsInt64())
				require.Equal(t, "http", a[pgidemotel.NamespaceAttribute].AsString())
				require.Equal(t, tt.want.outcome, a[pgidemotel.OutcomeAttribute].AsString())
				require.Equal(t, tt.want.statusCode, s.Status.Code)
				key, hasKey := a[pgidemotel.KeyAttribute]
				require.Equal(t, withKeys, hasKey)
				if withKeys {
					require.Equal(t, tt.key, key.AsString(), "the client's own key")
				}
				calls := children(b, s)
				if !tt.want.call {
					require.Empty(t, calls, "a refused request makes no call")
					continue
				}
				require.Len(t, calls, 1, "the call's span is the request span's child")
				require.Equal(t, "pgidem.Do", calls[0].Name)
				require.Equal(t, tt.want.outcome, attrs(calls[0])[pgidemotel.OutcomeAttribute].AsString())
			}
		})
	}
}

// Without a tracer the span methods give back ctx and allocate nothing; a nil hook does
// nothing. Not parallel: testing.AllocsPerRun refuses parallel tests.
func TestSpanMethodsWithoutTracer(t *testing.T) {
	mp := sdkmetric.NewMeterProvider()
	t.Cleanup(func() { require.NoError(t, mp.Shutdown(context.Background())) })
	hook, err := pgidemotel.NewHook(mp)
	require.NoError(t, err)
	ctx := context.Background()
	job := &rivertype.JobRow{ID: 1, Kind: "mail.invoice", Queue: river.QueueDefault}
	r := httptest.NewRequest("POST", "/orders", nil)
	out := &pgidemriver.Outcome{Job: job, Action: pgidemriver.ActionExecuted}
	res := &pgidemhttp.Response{Status: http.StatusCreated}
	for _, h := range []*pgidemotel.Hook{hook, nil} {
		same := true
		allocs := testing.AllocsPerRun(100, func() {
			same = same && h.OnJobStart(ctx, job) == ctx
			h.OnOutcome(ctx, out)
			same = same && h.OnRequest(ctx, r) == ctx
			h.OnResponse(ctx, res)
		})
		require.True(t, same, "ctx comes back unchanged")
		require.Zero(t, allocs)
	}
}
