package pgidemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
)

func TestResponsesNotStored(t *testing.T) {
	t.Parallel()

	for _, status := range []int{http.StatusInternalServerError, http.StatusBadGateway, http.StatusServiceUnavailable,
		http.StatusUnauthorized, http.StatusForbidden, http.StatusProxyAuthRequired,
		http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests} {
		t.Run(strconv.Itoa(status), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			var runs atomic.Int64
			h := b.handler(t, nil, statusHandler(&runs, status, http.StatusCreated))

			require.Equal(t, status, serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Code)
			second := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
			require.Equal(t, http.StatusCreated, second.Code, "the retry ran the handler again")
			require.Empty(t, second.Header().Get(pgidemhttp.HeaderReplayed))
			third := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
			require.Equal(t, "true", third.Header().Get(pgidemhttp.HeaderReplayed))
			require.Equal(t, "run 2: 201", third.Body.String())
			require.Equal(t, int64(2), runs.Load())
		})
	}

	// Stored responses replay, whatever their status.
	for _, tt := range []struct {
		name   string
		config *pgidemhttp.Config
		status int
	}{
		{"ClientErrorsAreStored", nil, http.StatusBadRequest},
		{"CustomPolicy", &pgidemhttp.Config{Store: func(int) bool { return true }}, http.StatusInternalServerError},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			var runs atomic.Int64
			h := b.handler(t, tt.config, statusHandler(&runs, tt.status, http.StatusCreated))
			require.Equal(t, tt.status, serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Code)
			again := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
			require.Equal(t, tt.status, again.Code)
			require.Equal(t, "true", again.Header().Get(pgidemhttp.HeaderReplayed))
			require.Equal(t, int64(1), runs.Load())
		})
	}
}

func TestPanicReleases(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int64
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			panic("handler failed")
		}
		w.WriteHeader(http.StatusCreated)
	}))

	require.PanicsWithValue(t, "handler failed", func() { serve(h, request("POST", "/orders", "alice", `"k"`, "x")) })
	require.Equal(t, http.StatusCreated, serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Code)
	require.Equal(t, "true", serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(2), runs.Load())
}

func TestHijackedConnectionIsNotRecorded(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := b.calls.Add(1)
		hj, ok := w.(http.Hijacker)
		require.True(t, ok, "the writer offers Hijack")
		conn, rw, err := hj.Hijack()
		require.NoError(t, err)
		defer conn.Close()
		_, _ = fmt.Fprintf(rw, "HTTP/1.1 202 Accepted\r\nContent-Length: 5\r\nConnection: close\r\n\r\nrun %d", n)
		_ = rw.Flush()
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	for i := 1; i <= 2; i++ {
		resp, body, err := postOver(t, srv, "/upgrade", `"h"`)
		require.NoError(t, err)
		require.Equal(t, http.StatusAccepted, resp.StatusCode)
		require.Equal(t, fmt.Sprintf("run %d", i), body, "a hijacked response is not replayed")
		// The client has the response before the handler returns: wait for the release.
		require.Eventually(t, func() bool {
			_, err := b.coord.Lookup(context.Background(), pgidemhttp.NamespaceDefault, pgidemhttp.RecordKey("alice", "h"))
			return errors.Is(err, pgidem.ErrNotFound)
		}, time.Minute, 10*time.Millisecond, "the key is released")
	}
}

func TestSwitchingProtocolsIsNotRecorded(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.WriteHeader(http.StatusSwitchingProtocols)
	}))
	for range 2 {
		require.Equal(t, http.StatusSwitchingProtocols, serve(h, request("POST", "/ws", "alice", `"k"`, "x")).Code)
	}
	require.Equal(t, int64(2), b.calls.Load())
}

func TestLargeResponseStoredWithoutBody(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int64
	h := b.handler(t, &pgidemhttp.Config{MaxResponseBytes: 8}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "0123456789")
		_, _ = io.WriteString(w, "abcdef")
	}))

	first := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, "0123456789abcdef", first.Body.String(), "the client gets the whole response")
	replay := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, replay.Code)
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Empty(t, replay.Body.String())
	require.Equal(t, "0", replay.Header().Get("Content-Length"))
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderBodyOmitted))
	require.Equal(t, "/orders/1", replay.Header().Get("Location"))
	require.Empty(t, replay.Header().Get("Content-Type"), "no body, no type")
	require.Equal(t, int64(1), runs.Load())
}

// A body within MaxResponseBytes whose JSON is longer than the coordinator's MaxValueBytes
// (each '<' is a six-byte escape) is stored without it, like a long one, not lost whole.
func TestResponseTooLongForTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{MaxValueBytes: 4096})
	h := b.handler(t, &pgidemhttp.Config{MaxResponseBytes: 3000}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.Header().Set("Location", "/pages/1")
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, strings.Repeat("<", 1000))
	}))
	require.Equal(t, 1000, serve(h, request("POST", "/pages", "alice", `"k"`, "x")).Body.Len())
	replay := serve(h, request("POST", "/pages", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, replay.Code)
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, "/pages/1", replay.Header().Get("Location"))
	require.Empty(t, replay.Body.String())
	require.Equal(t, int64(1), b.calls.Load())
}

// Headers too long for the record: the status alone is stored, and the handler does not
// run again.
func TestHeadersTooLongForTheRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{MaxValueBytes: 1024})
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.Header().Set("Link", "<"+strings.Repeat("l", 2000)+">; rel=next")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "ok")
	}))
	require.Equal(t, http.StatusCreated, serve(h, request("POST", "/x", "alice", `"k"`, "x")).Code)
	replay := serve(h, request("POST", "/x", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, replay.Code)
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Empty(t, replay.Header().Get("Link"))
	require.Empty(t, replay.Body.String())
	require.Equal(t, int64(1), b.calls.Load())
}

// A header value that is not UTF-8 (obs-text, which HTTP allows) cannot be stored in JSON:
// it is left out, and the rest of the response is stored.
func TestNonUTF8HeaderLeftOut(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.Header().Set("Location", "/files/caf\xe9")
		w.Header().Set("Link", "</a\x00b>")
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "ok")
	}))
	require.Equal(t, "/files/caf\xe9", serve(h, request("POST", "/files", "alice", `"k"`, "x")).Header().Get("Location"))
	replay := serve(h, request("POST", "/files", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, replay.Code)
	require.Equal(t, "ok", replay.Body.String())
	require.Equal(t, "text/plain", replay.Header().Get("Content-Type"))
	require.Empty(t, replay.Header().Get("Location"))
	require.Equal(t, int64(1), b.calls.Load())
}

func TestBinaryBodyReplaysExactly(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	payload := []byte{0x00, 0xff, 0xfe, 'a', 0x00, 0x80}
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(payload) // an implicit 200
	}))

	serve(h, request("POST", "/blobs", "alice", `"k"`, "x"))
	replay := serve(h, request("POST", "/blobs", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusOK, replay.Code)
	require.Equal(t, payload, replay.Body.Bytes())
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
}

// A response that did not reach the client whole (it went away mid-body) is stored
// without its body, and the replay says so.
func TestCutOffBodyIsNotReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	failed := make(chan struct{})
	h := b.handler(t, &pgidemhttp.Config{MaxResponseBytes: 16 << 20}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if b.calls.Add(1) > 1 {
			t.Error("the handler ran again")
			return
		}
		defer close(failed)
		w.WriteHeader(http.StatusCreated)
		chunk := []byte(strings.Repeat("x", 32<<10))
		for range 256 { // 8 MiB at most; the client leaves after the status
			if _, err := w.Write(chunk); err != nil {
				return
			}
			if err := http.NewResponseController(w).Flush(); err != nil {
				return
			}
		}
		t.Error("every write succeeded: the client did not go away")
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	req, err := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
	require.NoError(t, err)
	req.Header.Set(principalHeader, "alice")
	req.Header.Set(pgidemhttp.HeaderKey, `"k"`)
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.NoError(t, resp.Body.Close()) // leaves mid-body
	srv.CloseClientConnections()
	<-failed

	// The handler returned; the record completes once the middleware stored it.
	var replay *http.Response
	require.Eventually(t, func() bool {
		var err error
		replay, _, err = postOver(t, srv, "/", `"k"`)
		return err == nil && replay.Header.Get(pgidemhttp.HeaderReplayed) == "true"
	}, time.Minute, 20*time.Millisecond)
	require.Equal(t, http.StatusCreated, replay.StatusCode)
	require.Equal(t, "true", replay.Header.Get(pgidemhttp.HeaderBodyOmitted))
	require.Equal(t, "0", replay.Header.Get("Content-Length"))
}

// Only what reached the client is stored: bytes net/http refused (beyond a declared
// Content-Length) are not replayed.
func TestStoresWhatTheClientWasSent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.Header().Set("Content-Length", "2")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "hello")
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	_, first, _ := postOver(t, srv, "/", `"k"`) // the body is cut off: a read error
	require.Empty(t, first)
	replay, body, err := postOver(t, srv, "/", `"k"`)
	require.NoError(t, err)
	require.Equal(t, "true", replay.Header.Get(pgidemhttp.HeaderReplayed))
	require.Empty(t, body, "the refused bytes are not replayed")
	require.Equal(t, int64(1), b.calls.Load())
}

// A handler that panics after it sent its status (httputil.ReverseProxy does, with
// http.ErrAbortHandler, when copying the upstream's body fails) is stored by that status,
// without its body: the client saw the status and the effect may have happened, so the
// key is not released and the retry does not run the handler again. The panic still goes
// on.
func TestPanicAfterStatusIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int64
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"order":`)
		panic(http.ErrAbortHandler)
	}))
	require.PanicsWithValue(t, http.ErrAbortHandler, func() { serve(h, request("POST", "/orders", "alice", `"k"`, "x")) })
	replay := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, replay.Code)
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderBodyOmitted), "part of a body is never replayed")
	require.Empty(t, replay.Body.String())
	require.Equal(t, "/orders/1", replay.Header().Get("Location"))
	require.Equal(t, int64(1), runs.Load())

	// A status Store refuses is still released, as is a panic before any status.
	h = b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if r.URL.Path == "/after500" {
			w.WriteHeader(http.StatusInternalServerError)
		}
		panic(http.ErrAbortHandler)
	}))
	for _, path := range []string{"/after500", "/before"} {
		runs.Store(0)
		for range 2 {
			require.Panics(t, func() { serve(h, request("POST", path, "alice", `"k-`+path+`"`, "x")) })
		}
		require.Equal(t, int64(2), runs.Load(), path)
	}
}

// A 204 whose handler wrote a stray body (a JSON helper writing null): net/http refuses the
// bytes, and the response is still stored whole, its headers with it. The refusal is not
// a failed delivery: the ETag stays and the replay is not marked body-omitted.
func TestNoContentWithStrayBody(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"v2"`)
		w.WriteHeader(http.StatusNoContent)
		_, err := io.WriteString(w, "null\n")
		require.ErrorIs(t, err, http.ErrBodyNotAllowed)
	}))
	serve(h, request("PATCH", "/orders/1", "alice", `"k"`, "x"))
	replay := serve(h, request("PATCH", "/orders/1", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusNoContent, replay.Code)
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, `"v2"`, replay.Header().Get("ETag"))
	require.Empty(t, replay.Header().Get(pgidemhttp.HeaderBodyOmitted))
}

// A response whose writes failed (the client went away) is stored with the body the
// handler wrote when it declared a Content-Length that body matches: the retry, which is
// what reads it, gets the whole response. Without a declared length the body is left out
// (the handler may have stopped at the failed write).
func TestFailedWritesStoredWhenWhole(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Has("declared") {
			w.Header().Set("Content-Length", "11")
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"order":`)
		_, _ = io.WriteString(w, `1}`)
	}))
	for _, tc := range []struct {
		target, key, body, omitted string
	}{
		{"/orders?declared", `"k1"`, `{"order":1}`, ""},
		{"/orders", `"k2"`, "", "true"},
	} {
		h.ServeHTTP(brokenWriter{httptest.NewRecorder()}, request("POST", tc.target, "alice", tc.key, "x"))
		replay := serve(h, request("POST", tc.target, "alice", tc.key, "x"))
		require.Equal(t, http.StatusCreated, replay.Code, tc.target)
		require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed), tc.target)
		require.Equal(t, tc.body, replay.Body.String(), tc.target)
		require.Equal(t, tc.omitted, replay.Header().Get(pgidemhttp.HeaderBodyOmitted), tc.target)
	}
}

// A handler that writes less than the Content-Length it declared (net/http then cuts the
// connection) is stored without its body: a replay never passes part of a body off as
// all of it. One that writes more has the excess refused by net/http, and the declared
// body, which the client got whole, is stored: the refusal is not a failed delivery.
func TestDeclaredContentLength(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		w.WriteHeader(http.StatusCreated)
		body := r.URL.Query().Get("body")
		_, _ = io.WriteString(w, body[:min(5, len(body))])
		_, _ = io.WriteString(w, body[min(5, len(body)):]) // beyond the declared length: refused
	}))
	srv := httptest.NewServer(h) // net/http's writer, which enforces the declared length
	t.Cleanup(srv.Close)
	for _, tc := range []struct{ key, body, replayed, omitted string }{
		{`"short"`, "hel", "", "true"},
		{`"long"`, "hello_world", "hello", ""},
	} {
		_, _, _ = postOver(t, srv, "/orders?body="+tc.body, tc.key)
		replay, body, err := postOver(t, srv, "/orders?body="+tc.body, tc.key)
		require.NoError(t, err, tc.key)
		require.Equal(t, "true", replay.Header.Get(pgidemhttp.HeaderReplayed), tc.key)
		require.Equal(t, tc.replayed, string(body), tc.key)
		require.Equal(t, tc.omitted, replay.Header.Get(pgidemhttp.HeaderBodyOmitted), tc.key)
	}
}

// A handler that panics after its status is logged with its own stack (the panic is
// raised again from the middleware, so net/http's log shows the middleware's), and a
// Store that panics too does not replace the handler's panic: it goes on, and the
// response is not stored.
func TestPanicAfterStatusLogged(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var logs strings.Builder
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return logs.Write(p)
	}), nil))
	storePanics := false
	h := b.handler(t, &pgidemhttp.Config{Logger: logger, Store: func(status int) bool {
		if storePanics {
			panic("store")
		}
		return pgidemhttp.StoreDefault(status)
	}}, http.HandlerFunc(panicAfterStatus))
	require.PanicsWithValue(t, "boom", func() { serve(h, request("POST", "/orders", "alice", `"k1"`, "x")) })
	mu.Lock()
	require.Contains(t, logs.String(), "panicAfterStatus", "the handler's frame is in the logged stack")
	mu.Unlock()

	storePanics = true
	require.PanicsWithValue(t, "boom", func() { serve(h, request("POST", "/orders", "alice", `"k2"`, "x")) })
	storePanics = false
	require.PanicsWithValue(t, "boom", func() { serve(h, request("POST", "/orders", "alice", `"k2"`, "x")) },
		"not stored: the retry runs the handler again")
}

// A handler that turns content sniffing off (Content-Type: nil, net/http's way to send no
// Content-Type) gets a replay without one too: the replay is not sniffed, so a body sent
// without a type does not come back labelled text/html.
func TestSuppressedContentTypeStaysSuppressed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	srv := httptest.NewServer(b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		_, _ = io.WriteString(w, "<html><script>x</script>")
	})))
	t.Cleanup(srv.Close)
	first, _, err := postOver(t, srv, "/x", `"k"`)
	require.NoError(t, err)
	replay, body, err := postOver(t, srv, "/x", `"k"`)
	require.NoError(t, err)
	require.Equal(t, "true", replay.Header.Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, "<html><script>x</script>", body)
	require.Empty(t, first.Header.Values("Content-Type"))
	require.Empty(t, replay.Header.Values("Content-Type"))
}
