package pgidemhttp_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
)

// recordingHook marks each request's context with its path and keeps the responses it
// is given, with the mark their context carried; panicRequest and panicResponse make a
// method panic instead.
type recordingHook struct {
	mu                          sync.Mutex
	panicRequest, panicResponse bool
	responses                   []pgidemhttp.Response
	marks                       []any
}

type pathMarkKey struct{}

func (h *recordingHook) OnRequest(ctx context.Context, r *http.Request) context.Context {
	if h.panicRequest {
		panic("tracer bug")
	}
	return context.WithValue(ctx, pathMarkKey{}, r.URL.Path)
}

func (h *recordingHook) OnResponse(ctx context.Context, res *pgidemhttp.Response) {
	h.mu.Lock()
	h.responses = append(h.responses, *res)
	h.marks = append(h.marks, ctx.Value(pathMarkKey{}))
	h.mu.Unlock()
	if h.panicResponse {
		panic("exporter bug")
	}
}

func (h *recordingHook) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.responses)
}

// last returns the last response the hook was given and the mark of its context.
func (h *recordingHook) last(t *testing.T) (pgidemhttp.Response, any) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	require.NotEmpty(t, h.responses)
	return h.responses[len(h.responses)-1], h.marks[len(h.marks)-1]
}

// A Hook sees every request the middleware applies to, refused ones included, with the
// status the client got and the call's outcome; its context reaches next.
func TestHookSeesEveryRequest(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	hook := &recordingHook{}
	var handlerMark any
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handlerMark = r.Context().Value(pathMarkKey{})
		b.createOrder().ServeHTTP(w, r)
	})
	h := b.handler(t, &pgidemhttp.Config{Hook: hook}, next)
	required := b.handler(t, &pgidemhttp.Config{Hook: hook, Required: true, Namespace: "required"}, next)
	silent := b.handler(t, &pgidemhttp.Config{Hook: hook}, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))

	for _, tt := range []struct {
		name    string
		handler http.Handler
		r       *http.Request
		want    pgidemhttp.Response
		next    bool // next (that reads the mark) runs
	}{
		{"Executed", h, request("POST", "/orders", "alice", `"k"`, "x"),
			pgidemhttp.Response{Namespace: "http", Key: "k", Outcome: pgidem.OutcomeExecuted, Status: http.StatusCreated, Attempts: 1}, true},
		{"Replayed", h, request("POST", "/orders", "alice", `"k"`, "x"),
			pgidemhttp.Response{Namespace: "http", Key: "k", Outcome: pgidem.OutcomeReplayed, Status: http.StatusCreated, Replayed: true, Attempts: 1}, false},
		{"KeyReused", h, request("POST", "/orders", "alice", `"k"`, "other"),
			pgidemhttp.Response{Namespace: "http", Key: "k", Outcome: pgidem.OutcomeFingerprintMismatch, Status: http.StatusUnprocessableEntity}, false},
		{"NoKey", h, request("POST", "/orders", "alice", "", "x"),
			pgidemhttp.Response{Namespace: "http", Status: http.StatusCreated}, true},
		{"InvalidKey", h, request("POST", "/orders", "alice", "not a key", "x"),
			pgidemhttp.Response{Namespace: "http", Status: http.StatusBadRequest}, false},
		{"NoCaller", h, request("POST", "/orders", "", `"k2"`, "x"),
			pgidemhttp.Response{Namespace: "http", Key: "k2", Status: http.StatusInternalServerError}, false},
		{"KeyRequired", required, request("POST", "/orders", "alice", "", "x"),
			pgidemhttp.Response{Namespace: "required", Status: http.StatusBadRequest}, false},
		{"WroteNothing", silent, request("POST", "/silent", "alice", `"k3"`, "x"),
			pgidemhttp.Response{Namespace: "http", Key: "k3", Outcome: pgidem.OutcomeExecuted, Status: http.StatusOK, Attempts: 1}, false},
	} {
		handlerMark = nil
		w := serve(tt.handler, tt.r)
		got, mark := hook.last(t)
		if tt.want.Outcome == pgidem.OutcomeFingerprintMismatch {
			require.ErrorIs(t, got.Err, pgidem.ErrFingerprintMismatch, tt.name)
			got.Err = nil
		}
		require.Equal(t, tt.want, got, tt.name)
		require.Equal(t, w.Code, got.Status, tt.name)
		require.Equal(t, tt.r.URL.Path, mark, tt.name)
		if tt.next {
			require.Equal(t, tt.r.URL.Path, handlerMark, "%s: next runs with the hook's context", tt.name)
		}
	}
	n := hook.count()
	serve(h, request("GET", "/orders", "alice", `"k"`, ""))
	require.Equal(t, n, hook.count(), "a method the middleware does not apply to is not seen")
}

// OnResponse learns of next's panic, which goes on; a response not stored has no error.
func TestHookPanicAndNotStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	hook := &recordingHook{}
	failing := b.handler(t, &pgidemhttp.Config{Hook: hook}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadGateway)
	}))
	serve(failing, request("POST", "/orders", "alice", `"k"`, "x"))
	got, _ := hook.last(t)
	require.Equal(t, pgidemhttp.Response{Namespace: "http", Key: "k", Outcome: pgidem.OutcomeExecuted,
		Status: http.StatusBadGateway, Attempts: 1}, got, "released by Config.Store: no error")

	panicking := b.handler(t, &pgidemhttp.Config{Hook: hook}, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		panic("boom")
	}))
	require.PanicsWithValue(t, "boom", func() { serve(panicking, request("POST", "/orders", "alice", `"k2"`, "x")) })
	got, _ = hook.last(t)
	require.ErrorIs(t, got.Err, pgidem.ErrPanicked)
	require.Zero(t, got.Status, "no status was sent")
	require.Equal(t, "k2", got.Key)
}

// A Hook that panics is logged; the request goes on with its own context, and its
// response stands.
func TestHookPanicIsContained(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var logs strings.Builder // the handler runs on the test's goroutine
	hook := &recordingHook{panicRequest: true, panicResponse: true}
	h := b.handler(t, &pgidemhttp.Config{Hook: hook, Logger: slog.New(slog.NewTextHandler(&logs, nil))}, b.createOrder())
	var w *httptest.ResponseRecorder
	require.NotPanics(t, func() { w = serve(h, request("POST", "/orders", "alice", `"k"`, "x")) })
	require.Equal(t, http.StatusCreated, w.Code)
	got, mark := hook.last(t)
	require.Equal(t, pgidem.OutcomeExecuted, got.Outcome)
	require.Nil(t, mark, "the request kept its own context")
	require.Contains(t, logs.String(), "Hook.OnRequest panicked")
	require.Contains(t, logs.String(), "tracer bug")
	require.Contains(t, logs.String(), "Hook.OnResponse panicked")
	require.Contains(t, logs.String(), "exporter bug")
	require.Equal(t, "true", serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Header().Get(pgidemhttp.HeaderReplayed))
}

// With a Hook, the writer next gets still flushes and hijacks through
// http.ResponseController, and a flush before any status counts as the 200 it sends.
func TestHookWriterUnwraps(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	hook := &recordingHook{}
	var flushErr error
	h := b.handler(t, &pgidemhttp.Config{Hook: hook}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		flushErr = http.NewResponseController(w).Flush()
	}))
	w := serve(h, request("POST", "/orders", "alice", "", "x")) // no key: next gets the hook's writer itself
	require.NoError(t, flushErr)
	require.True(t, w.Flushed)
	got, _ := hook.last(t)
	require.Equal(t, http.StatusOK, got.Status)

	srv := httptest.NewServer(b.handler(t, &pgidemhttp.Config{Hook: hook}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_, _ = conn.Write([]byte("HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"))
			_ = conn.Close()
		}
	})))
	defer srv.Close()
	n := hook.count()
	resp, _, err := postOver(t, srv, "/orders", `"k"`)
	require.NoError(t, err)
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	// The client may have its answer before the handler returned.
	require.Eventually(t, func() bool { return hook.count() > n }, 10*time.Second, 10*time.Millisecond)
	got, _ = hook.last(t)
	require.Zero(t, got.Status, "a hijacked connection has no status")
	require.Equal(t, pgidem.OutcomeExecuted, got.Outcome)
}
