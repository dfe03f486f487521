package pgidemhttp_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// principalHeader names the test's caller; a real service takes it from authentication.
const principalHeader = "X-Test-User"

func principalFromHeader(r *http.Request) (string, error) {
	if u := r.Header.Get(principalHeader); u != "" {
		return u, nil
	}
	return "", errors.New("no user")
}

type testBundle struct {
	db    *testdb.DB
	coord *pgidem.Coordinator
	calls atomic.Int64
}

// setup returns a fresh database and a coordinator on it.
func setup(t *testing.T, coordConfig *pgidem.Config) *testBundle {
	t.Helper()
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, coordConfig)
	require.NoError(t, err)
	return &testBundle{db: db, coord: coord}
}

// handler wraps next with a middleware of config (Principal defaults to the test header).
func (b *testBundle) handler(t *testing.T, config *pgidemhttp.Config, next http.Handler) http.Handler {
	t.Helper()
	cfg := pgidemhttp.Config{}
	if config != nil {
		cfg = *config
	}
	if cfg.Principal == nil {
		cfg.Principal = principalFromHeader
	}
	mw, err := pgidemhttp.New(b.coord, &cfg)
	require.NoError(t, err)
	return mw.Handler(next)
}

// createOrder is the effect: it counts its runs and answers 201 with the order number, the
// body it read, and headers of which only some are replayed.
func (b *testBundle) createOrder() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := b.calls.Add(1)
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", n))
		w.Header().Set("Set-Cookie", "session=secret")
		w.Header().Set("X-Run", strconv.FormatInt(n, 10))
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"order":%d,"request":%q}`, n, body)
	})
}

// request builds a request; key is the raw Idempotency-Key field ("" for none).
func request(method, target, user, key, body string) *http.Request {
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	if user != "" {
		r.Header.Set(principalHeader, user)
	}
	if key != "" {
		r.Header.Set(pgidemhttp.HeaderKey, key)
	}
	return r
}

// postOver sends alice's POST with the Idempotency-Key field key to srv over a real
// connection and returns the response, its body and the error reading the body.
func postOver(t *testing.T, srv *httptest.Server, path, key string) (*http.Response, string, error) {
	t.Helper()
	req, err := http.NewRequest("POST", srv.URL+path, strings.NewReader("x"))
	require.NoError(t, err)
	req.Header.Set(principalHeader, "alice")
	req.Header.Set(pgidemhttp.HeaderKey, key)
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, string(body), err
}

func serve(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// requireProblem asserts a problem details response with status and code.
func requireProblem(t *testing.T, w *httptest.ResponseRecorder, status int, code string) pgidemhttp.Problem {
	t.Helper()
	require.Equal(t, status, w.Code, w.Body.String())
	require.Equal(t, pgidemhttp.ProblemContentType, w.Header().Get("Content-Type"))
	var p pgidemhttp.Problem
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &p))
	require.Equal(t, code, p.Code)
	require.Equal(t, status, p.Status)
	require.Equal(t, "about:blank", p.Type)
	require.Equal(t, http.StatusText(status), p.Title)
	require.NotEmpty(t, p.Detail)
	require.Empty(t, w.Header().Get(pgidemhttp.HeaderReplayed))
	return p
}

// statusHandler answers the statuses in order, one per run, and counts runs.
func statusHandler(runs *atomic.Int64, statuses ...int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		status := statuses[min(int(n), len(statuses))-1]
		w.WriteHeader(status)
		_, _ = fmt.Fprintf(w, "run %d: %d", n, status)
	})
}

// brokenWriter is a ResponseWriter whose client went away: every body write fails.
type brokenWriter struct{ *httptest.ResponseRecorder }

func (w brokenWriter) Write([]byte) (int, error) { return 0, errors.New("write: broken pipe") }

func panicAfterStatus(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusCreated)
	panic("boom")
}

// writerFunc is an io.Writer made of a function.
type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
