package pgidemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

func TestReplay(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())

	first := serve(h, request("POST", "/orders", "alice", `"k-1"`, `{"sku":"A"}`))
	require.Equal(t, http.StatusCreated, first.Code)
	require.Empty(t, first.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, "session=secret", first.Header().Get("Set-Cookie"))

	second := serve(h, request("POST", "/orders", "alice", `"k-1"`, `{"sku":"A"}`))
	require.Equal(t, http.StatusCreated, second.Code)
	require.Equal(t, "true", second.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, first.Body.String(), second.Body.String())
	require.Equal(t, `{"order":1,"request":"{\"sku\":\"A\"}"}`, second.Body.String())
	require.Equal(t, "application/json", second.Header().Get("Content-Type"))
	require.Equal(t, "/orders/1", second.Header().Get("Location"))
	require.Empty(t, second.Header().Get("Set-Cookie"), "only allowlisted headers are replayed")
	require.Empty(t, second.Header().Get("X-Run"))
	require.Equal(t, strconv.Itoa(second.Body.Len()), second.Header().Get("Content-Length"))

	// The same key unquoted is the same key.
	third := serve(h, request("POST", "/orders", "alice", `k-1`, `{"sku":"A"}`))
	require.Equal(t, "true", third.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(1), b.calls.Load())

	// The record is an ordinary one, readable by key.
	rec, err := b.coord.Lookup(context.Background(), pgidemhttp.NamespaceDefault, pgidemhttp.RecordKey("alice", "k-1"))
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.Equal(t, 1, rec.Attempts)
	require.NotEmpty(t, rec.Fingerprint)
	var stored struct {
		Status int                 `json:"status"`
		Header map[string][]string `json:"header"`
		Text   string              `json:"text"`
	}
	require.NoError(t, json.Unmarshal(rec.Result, &stored))
	require.Equal(t, http.StatusCreated, stored.Status)
	require.Equal(t, first.Body.String(), stored.Text, "a text body is readable in the record")
	require.NotContains(t, stored.Header, "Set-Cookie")
}

// After its TTL a record counts as absent: a retry runs the handler again, and the same
// key with another body is a new request, not a 422.
func TestExpiredRecordRunsAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{MinTTL: time.Second, Lease: 500 * time.Millisecond})
	h := b.handler(t, &pgidemhttp.Config{TTL: time.Second}, b.createOrder())

	require.Equal(t, http.StatusCreated, serve(h, request("POST", "/orders", "alice", `"k"`, "a")).Code)
	require.Equal(t, "true", serve(h, request("POST", "/orders", "alice", `"k"`, "a")).Header().Get(pgidemhttp.HeaderReplayed))
	// Expire it by the database clock rather than by sleeping.
	_, err := b.db.Pool.Exec(context.Background(), `UPDATE pgidem_record SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	w := serve(h, request("POST", "/orders", "alice", `"k"`, "b"))
	require.Equal(t, http.StatusCreated, w.Code)
	require.Empty(t, w.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(2), b.calls.Load())
}

func TestFingerprintMismatch(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())

	require.Equal(t, http.StatusCreated, serve(h, request("POST", "/orders", "alice", `"k"`, `{"sku":"A"}`)).Code)
	for _, r := range []*http.Request{
		request("POST", "/orders", "alice", `"k"`, `{"sku":"B"}`),       // another body
		request("POST", "/payments", "alice", `"k"`, `{"sku":"A"}`),     // another endpoint
		request("POST", "/orders?dry=1", "alice", `"k"`, `{"sku":"A"}`), // another query
		request("PATCH", "/orders", "alice", `"k"`, `{"sku":"A"}`),      // another method
	} {
		requireProblem(t, serve(h, r), http.StatusUnprocessableEntity, "idempotency_key_reused")
	}
	require.Equal(t, int64(1), b.calls.Load())
}

func TestInProgress(t *testing.T) {
	t.Parallel()

	t.Run("Raise", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		entered, release := make(chan struct{}), make(chan struct{})
		slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(entered)
			<-release
			b.createOrder().ServeHTTP(w, r)
		})
		h := b.handler(t, nil, slow)

		done := make(chan *httptest.ResponseRecorder)
		go func() { done <- serve(h, request("POST", "/orders", "alice", `"k"`, "x")) }()
		<-entered
		w := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
		requireProblem(t, w, http.StatusConflict, "idempotency_key_in_progress")
		retry, err := strconv.Atoi(w.Header().Get("Retry-After"))
		require.NoError(t, err)
		require.Equal(t, 5, retry, "the holder's 30 s lease, bounded by RetryAfterMax")

		// A bound with a fraction of a second is a bound all the same.
		fractional := b.handler(t, &pgidemhttp.Config{RetryAfterMax: 1500 * time.Millisecond}, slow)
		w = serve(fractional, request("POST", "/orders", "alice", `"k"`, "x"))
		requireProblem(t, w, http.StatusConflict, "idempotency_key_in_progress")
		require.Equal(t, "1", w.Header().Get("Retry-After"))

		close(release)
		first := <-done
		require.Equal(t, http.StatusCreated, first.Code)
		again := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
		require.Equal(t, "true", again.Header().Get(pgidemhttp.HeaderReplayed))
		require.Equal(t, first.Body.String(), again.Body.String())
		require.Equal(t, int64(1), b.calls.Load())
	})

	t.Run("Wait", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		entered, release := make(chan struct{}), make(chan struct{})
		slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(entered)
			<-release
			b.createOrder().ServeHTTP(w, r)
		})
		h := b.handler(t, &pgidemhttp.Config{InFlight: pgidem.InFlightWait, WaitTimeout: time.Minute}, slow)

		done := make(chan *httptest.ResponseRecorder, 2)
		go func() { done <- serve(h, request("POST", "/orders", "alice", `"k"`, "x")) }()
		<-entered
		go func() { done <- serve(h, request("POST", "/orders", "alice", `"k"`, "x")) }()
		// The second request waits for the first (it cannot finish before release).
		select {
		case w := <-done:
			t.Fatalf("a request finished before the handler was released: %d %s", w.Code, w.Body)
		case <-time.After(200 * time.Millisecond):
		}
		close(release)
		a, c := <-done, <-done
		require.Equal(t, http.StatusCreated, a.Code)
		require.Equal(t, http.StatusCreated, c.Code)
		require.Equal(t, a.Body.String(), c.Body.String())
		require.Equal(t, "true", a.Header().Get(pgidemhttp.HeaderReplayed)+c.Header().Get(pgidemhttp.HeaderReplayed))
		require.Equal(t, int64(1), b.calls.Load())
	})
}

func TestConcurrentRequestsRunOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, &pgidemhttp.Config{InFlight: pgidem.InFlightWait, WaitTimeout: time.Minute}, b.createOrder())

	const n = 20
	var wg sync.WaitGroup
	responses := make([]*httptest.ResponseRecorder, n)
	for i := range n {
		wg.Go(func() { responses[i] = serve(h, request("POST", "/orders", "alice", `"same"`, "body")) })
	}
	wg.Wait()
	require.Equal(t, int64(1), b.calls.Load())
	replayed := 0
	for _, w := range responses {
		require.Equal(t, http.StatusCreated, w.Code)
		require.Equal(t, responses[0].Body.String(), w.Body.String())
		if w.Header().Get(pgidemhttp.HeaderReplayed) == "true" {
			replayed++
		}
	}
	require.Equal(t, n-1, replayed)
}

func TestMissingKey(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	required := b.handler(t, &pgidemhttp.Config{Required: true}, b.createOrder())
	requireProblem(t, serve(required, request("POST", "/orders", "alice", "", "x")), http.StatusBadRequest, "idempotency_key_missing")
	require.Equal(t, int64(0), b.calls.Load())

	// Without Required a request without a key is the application's business: it runs
	// every time, unprotected.
	optional := b.handler(t, nil, b.createOrder())
	for range 2 {
		w := serve(optional, request("POST", "/orders", "alice", "", "x"))
		require.Equal(t, http.StatusCreated, w.Code)
		require.Empty(t, w.Header().Get(pgidemhttp.HeaderReplayed))
	}
	require.Equal(t, int64(2), b.calls.Load())
}

func TestInvalidKey(t *testing.T) {
	t.Parallel()
	var invalid atomic.Int64
	b := setup(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventInvalidKey && e.Namespace == "http" {
			invalid.Add(e.Count)
		}
	})})
	h := b.handler(t, &pgidemhttp.Config{Required: true, Namespace: "http"}, b.createOrder())

	fields := []string{
		`""`, `"abc`, `"a\x"`, "a b", "\"caf\xc3\xa9\"", `"a", "b"`,
		`"` + strings.Repeat("k", 300) + `"`, // longer than the coordinator's MaxKeyBytes with its principal
	}
	for _, field := range fields {
		requireProblem(t, serve(h, request("POST", "/orders", "alice", field, "x")), http.StatusBadRequest, "idempotency_key_invalid")
	}
	twice := request("POST", "/orders", "alice", `"a"`, "x")
	twice.Header.Add(pgidemhttp.HeaderKey, `"b"`)
	requireProblem(t, serve(h, twice), http.StatusBadRequest, "idempotency_key_invalid")
	require.Equal(t, int64(0), b.calls.Load(), "an invalid key never runs the handler")
	require.Equal(t, int64(len(fields)+1), invalid.Load(), "every refused key is counted as the coordinator's own refusals are")

	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pgidem_record`).Scan(&n))
	require.Zero(t, n)
}

func TestKeysAreScopedToThePrincipal(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())

	alice := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	bob := serve(h, request("POST", "/orders", "bob", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, alice.Code)
	require.Equal(t, http.StatusCreated, bob.Code)
	require.Empty(t, bob.Header().Get(pgidemhttp.HeaderReplayed), "bob must not receive alice's response")
	require.NotEqual(t, alice.Body.String(), bob.Body.String())
	require.Equal(t, int64(2), b.calls.Load())

	// Each replays its own.
	require.Equal(t, alice.Body.String(), serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Body.String())
	require.Equal(t, bob.Body.String(), serve(h, request("POST", "/orders", "bob", `"k"`, "x")).Body.String())

	// A caller Principal cannot name is a server fault (the middleware belongs behind
	// authentication): 500, and nothing runs.
	requireProblem(t, serve(h, request("POST", "/orders", "", `"k"`, "x")), http.StatusInternalServerError, "principal_unknown")
	empty := b.handler(t, &pgidemhttp.Config{Principal: func(*http.Request) (string, error) { return "", nil }}, b.createOrder())
	requireProblem(t, serve(empty, request("POST", "/orders", "alice", `"k"`, "x")), http.StatusInternalServerError, "principal_unknown")
	require.Equal(t, int64(2), b.calls.Load())
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

// A handler that returns without writing has answered 200 (net/http's rule), even when its
// client went away: its effect may be done, so the answer is stored and the client's retry
// replays it. A handler that gives up says so with http.ErrAbortHandler.
func TestClientGone(t *testing.T) {
	t.Parallel()

	for _, abort := range []bool{false, true} {
		t.Run(map[bool]string{false: "ReturnWithoutWriting", true: "ErrAbortHandler"}[abort], func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			var runs atomic.Int64
			h := b.handler(t, &pgidemhttp.Config{CancelWithClient: true}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 {
					<-r.Context().Done() // the client goes away
					if abort {
						panic(http.ErrAbortHandler)
					}
					return // the effect was done; no answer written
				}
				w.WriteHeader(http.StatusCreated)
			}))

			ctx, cancel := context.WithCancel(context.Background())
			r := request("POST", "/orders", "alice", `"k"`, "x").WithContext(ctx)
			go func() {
				for runs.Load() == 0 {
					time.Sleep(time.Millisecond)
				}
				cancel()
			}()
			if abort {
				require.PanicsWithValue(t, http.ErrAbortHandler, func() { serve(h, r) })
			} else {
				serve(h, r)
			}
			retry := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
			if abort {
				require.Equal(t, http.StatusCreated, retry.Code, "an aborted request is not stored: the retry runs")
				require.Equal(t, int64(2), runs.Load())
			} else {
				require.Equal(t, http.StatusOK, retry.Code)
				require.Equal(t, "true", retry.Header().Get(pgidemhttp.HeaderReplayed))
				require.Equal(t, int64(1), runs.Load(), "the effect is not repeated for the client's retry")
			}
		})
	}
}

// By default the client going away does not cancel the handler: it finishes its work and
// its response is stored, so the retry replays it and the effect runs once. The handler's
// context used to be cancelled: a handler that honours it (a database call, a call to
// another service) stopped half-way, answered 5xx, which released the key, and the retry
// ran the effect again. A deadline an outer handler set still applies.
func TestClientGoneHandlerFinishes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int64
	var handlerErr error
	started, gone := make(chan struct{}), make(chan struct{})
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		close(started)
		// The client leaves while the effect is under way; the effect observes the
		// context, as a database or HTTP call does.
		<-gone
		_, handlerErr = b.db.Pool.Exec(r.Context(), "SELECT 1")
		if handlerErr == nil {
			handlerErr = r.Context().Err() // nor later, asynchronously
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"order":1}`)
	}))

	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-started
		cancel()
		close(gone)
	}()
	serve(h, request("POST", "/orders", "alice", `"k"`, "x").WithContext(ctx))
	require.NoError(t, handlerErr, "the handler's context is not cancelled with the client")
	retry := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, retry.Code)
	require.Equal(t, "true", retry.Header().Get(pgidemhttp.HeaderReplayed))
	require.JSONEq(t, `{"order":1}`, retry.Body.String())
	require.Equal(t, int64(1), runs.Load())

	// An outer handler's deadline still ends the handler's context.
	dctx, dcancel := context.WithTimeout(context.Background(), time.Hour)
	defer dcancel()
	var deadline time.Time
	h2 := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		deadline, _ = r.Context().Deadline()
	}))
	serve(h2, request("POST", "/orders", "alice", `"k2"`, "x").WithContext(dctx))
	want, _ := dctx.Deadline()
	require.Equal(t, want, deadline)
}

// A handler whose key is taken over while it runs (its lease could not be kept) and that
// then returns without writing: the middleware answers for it instead of an empty 200.
func TestLeaseLostAnswersConflict(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Lease: 300 * time.Millisecond})
	var cause error
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Set-Cookie", "session=1")                                                   // set, never sent
		_, err := b.db.Pool.Exec(r.Context(), `UPDATE pgidem_record SET owner = gen_random_uuid()`) // a takeover
		require.NoError(t, err)
		<-r.Context().Done()
		cause = context.Cause(r.Context())
	}))

	w := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.ErrorIs(t, cause, pgidem.ErrLeaseLost)
	requireProblem(t, w, http.StatusConflict, "idempotency_key_in_progress")
	require.Equal(t, "1", w.Header().Get("Retry-After"))
	require.Empty(t, w.Header().Get("Set-Cookie"), "the handler's unsent headers do not go out with the problem")
}

// A handler that ran and wrote nothing, whose outcome the store could not take: 503 with
// a code that says it ran.
func TestOutcomeUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.Header().Set("Content-Encoding", "gzip") // set, never sent
		_, err := b.db.Pool.Exec(r.Context(), `ALTER TABLE pgidem_record RENAME TO pgidem_record_gone`)
		require.NoError(t, err)
	}))
	// An outer handler's headers (CORS, a request id) survive the problem; next's do not.
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Access-Control-Allow-Origin", "*")
		h.ServeHTTP(w, r)
	})
	w := serve(outer, request("POST", "/orders", "alice", `"k"`, "x"))
	requireProblem(t, w, http.StatusServiceUnavailable, "outcome_unknown")
	require.Equal(t, "*", w.Header().Get("Access-Control-Allow-Origin"))
	require.Empty(t, w.Header().Get("Content-Encoding"))
	require.Equal(t, int64(1), b.calls.Load())
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

func TestOtherMethodsPassThrough(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())
	for range 2 {
		w := serve(h, request("GET", "/orders", "", `"k"`, ""))
		require.Equal(t, http.StatusCreated, w.Code)
		require.Empty(t, w.Header().Get(pgidemhttp.HeaderReplayed))
	}
	require.Equal(t, int64(2), b.calls.Load())

	put := b.handler(t, &pgidemhttp.Config{Methods: []string{"PUT"}}, b.createOrder())
	serve(put, request("PUT", "/orders/1", "alice", `"k"`, "x"))
	require.Equal(t, "true", serve(put, request("PUT", "/orders/1", "alice", `"k"`, "x")).Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(3), b.calls.Load())
}

func TestRequestTooLarge(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, &pgidemhttp.Config{MaxRequestBytes: 16}, b.createOrder())

	requireProblem(t, serve(h, request("POST", "/orders", "alice", `"k"`, strings.Repeat("x", 17))), http.StatusRequestEntityTooLarge, "request_too_large")
	unknownLength := request("POST", "/orders", "alice", `"k"`, "")
	unknownLength.Body, unknownLength.ContentLength = io.NopCloser(strings.NewReader(strings.Repeat("x", 17))), -1
	requireProblem(t, serve(h, unknownLength), http.StatusRequestEntityTooLarge, "request_too_large")
	// A limit set by an outer http.MaxBytesReader is a 413 too.
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 4)
		h.ServeHTTP(w, r)
	})
	requireProblem(t, serve(outer, request("POST", "/orders", "alice", `"k"`, "0123456789")), http.StatusRequestEntityTooLarge, "request_too_large")
	require.Equal(t, int64(0), b.calls.Load())
	// At the limit the handler reads the whole body.
	w := serve(h, request("POST", "/orders", "alice", `"k"`, strings.Repeat("y", 16)))
	require.Equal(t, http.StatusCreated, w.Code)
	require.Contains(t, w.Body.String(), strings.Repeat("y", 16))

	// A request without a body (a direct caller's; a server always sets one).
	noBody := request("POST", "/orders", "alice", `"nb"`, "")
	noBody.Body = nil
	require.Equal(t, http.StatusCreated, serve(h, noBody).Code)

	// No limit at all.
	unlimited := b.handler(t, &pgidemhttp.Config{MaxRequestBytes: math.MaxInt64}, b.createOrder())
	w = serve(unlimited, request("POST", "/orders", "alice", `"u"`, "whole body"))
	require.Equal(t, http.StatusCreated, w.Code)
	require.Contains(t, w.Body.String(), "whole body")
}

// Principal may read the body (to check a signature); the handler still reads all of it.
func TestPrincipalReadsBody(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, &pgidemhttp.Config{Principal: func(r *http.Request) (string, error) {
		body, err := io.ReadAll(r.Body)
		return "signed:" + strconv.Itoa(len(body)), err
	}}, b.createOrder())
	w := serve(h, request("POST", "/orders", "alice", `"k"`, "payload"))
	require.Equal(t, http.StatusCreated, w.Code)
	require.Contains(t, w.Body.String(), `"request":"payload"`)
	_, err := b.coord.Lookup(context.Background(), pgidemhttp.NamespaceDefault, pgidemhttp.RecordKey("signed:7", "k"))
	require.NoError(t, err)
}

func TestStoreUnavailable(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Schema: "no_such_schema"})
	h := b.handler(t, nil, b.createOrder())

	w := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	requireProblem(t, w, http.StatusServiceUnavailable, "store_unavailable")
	require.Equal(t, "1", w.Header().Get("Retry-After"))
	require.Equal(t, int64(0), b.calls.Load(), "a request is never run unprotected")
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

func TestHandlerSeesKey(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var ns, recordKey, principal, key, scoped string
	var ok, scopedOK bool
	h := b.handler(t, &pgidemhttp.Config{Namespace: "api"}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ns, recordKey, _ = pgidem.KeyFromContext(r.Context())
		principal, key, ok = pgidemhttp.RequestKey(r.Context())
		scoped, scopedOK = pgidemhttp.ScopedKey(r.Context())
	}))
	require.Equal(t, http.StatusOK, serve(h, request("POST", "/orders", "alice", `"k:1"`, "x")).Code)
	require.Equal(t, "api", ns)
	require.Equal(t, pgidemhttp.RecordKey("alice", "k:1"), recordKey)
	require.True(t, ok)
	require.Equal(t, "alice", principal)
	require.Equal(t, "k:1", key)
	require.True(t, scopedOK)
	require.Len(t, scoped, len(recordKey))
	require.True(t, strings.HasSuffix(scoped, ":k:1"))
	require.NotEqual(t, recordKey, scoped, "scoped to the request's fingerprint too")
	_, _, ok = pgidemhttp.RequestKey(context.Background())
	require.False(t, ok)
	_, ok = pgidemhttp.ScopedKey(context.Background())
	require.False(t, ok)
	// A request without a key (Required false) has nothing to dedupe on.
	require.Equal(t, http.StatusOK, serve(h, request("POST", "/orders", "alice", "", "x")).Code)
	require.False(t, ok)
	require.False(t, scopedOK)
	require.Empty(t, scoped)
}

// Any principal works, of any length or content: the record holds a digest of it.
func TestAnyPrincipal(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, principal := range []string{"bad\x00user\xff", strings.Repeat("iss|sub-", 200)} {
		h := b.handler(t, &pgidemhttp.Config{Principal: func(*http.Request) (string, error) { return principal, nil }}, b.createOrder())
		key := `"` + strings.Repeat("k", 200) + `"` // a long key still fits beside any principal
		require.Equal(t, http.StatusCreated, serve(h, request("POST", "/orders", "alice", key, "x")).Code)
		require.Equal(t, "true", serve(h, request("POST", "/orders", "alice", key, "x")).Header().Get(pgidemhttp.HeaderReplayed))
	}
	require.Equal(t, int64(2), b.calls.Load())
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pgidem_record WHERE key LIKE '%iss|sub%'`).Scan(&n))
	require.Zero(t, n, "principals are not written to the record")
}

// A middleware inside another (a global one and a route's own) passes: the outer protects.
// One middleware inside another: when the outer one holds the very record the inner one
// would (same namespace, same caller and key), the inner passes; otherwise the inner keeps
// a record of its own.
func TestNestedMiddleware(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	count := func() (n int) {
		require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pgidem_record`).Scan(&n))
		return n
	}

	same := b.handler(t, nil, b.handler(t, nil, b.createOrder()))
	require.Equal(t, http.StatusCreated, serve(same, request("POST", "/orders", "alice", `"k"`, "x")).Code)
	require.Equal(t, "true", serve(same, request("POST", "/orders", "alice", `"k"`, "x")).Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, count(), "the inner one passed: one record")

	own := b.handler(t, nil, b.handler(t, &pgidemhttp.Config{Namespace: "inner"}, b.createOrder()))
	require.Equal(t, http.StatusCreated, serve(own, request("POST", "/orders", "bob", `"k"`, "x")).Code)
	require.Equal(t, "true", serve(own, request("POST", "/orders", "bob", `"k"`, "x")).Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(2), b.calls.Load())
	require.Equal(t, 3, count(), "the inner one kept its own record")
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

// The pattern the docs give for rows in the same database: the handler writes them with
// DoTx under ScopedKey, so a retry after its server died (here: the handler panics after
// its commit, which also releases the middleware's record) replays them; and a different
// request under the released key (another body) writes its own row, not the first's.
func TestDoTxInHandler(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(context.Background(), `CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL)`)
	require.NoError(t, err)
	var runs atomic.Int64
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, key, _ := pgidemhttp.RequestKey(r.Context())
		scoped, ok := pgidemhttp.ScopedKey(r.Context())
		require.True(t, ok)
		id, err := pgidem.DoInTx(r.Context(), b.coord, "orders", scoped, time.Hour, nil,
			func(ctx context.Context, tx pgx.Tx) (int64, error) {
				var id int64
				err := tx.QueryRow(ctx, `INSERT INTO orders (key) VALUES ($1) RETURNING id`, key).Scan(&id)
				return id, err
			})
		require.NoError(t, err)
		if runs.Add(1) == 1 {
			panic("the server dies after the commit")
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "order %d", id)
	}))

	require.Panics(t, func() { serve(h, request("POST", "/orders", "alice", `"k"`, "x")) })
	retry := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, retry.Code)
	require.Equal(t, "order 1", retry.Body.String(), "the retry replays the first order")
	var n int
	require.NoError(t, b.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&n))
	require.Equal(t, 1, n)

	// Released (the panic above was its first run's; a 5xx or an expiry does the same):
	// another request under the key is a new request with effects of its own.
	_, err = b.db.Pool.Exec(context.Background(), `DELETE FROM pgidem_record WHERE namespace = 'http'`)
	require.NoError(t, err)
	other := serve(h, request("POST", "/orders", "alice", `"k"`, "another body"))
	require.Equal(t, http.StatusCreated, other.Code)
	require.Equal(t, "order 2", other.Body.String(), "not the first request's order")
}

// Over a real connection: a handler that flushes mid-response streams it, and the retry
// gets it back whole.
func TestRealServer(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "part 1, ")
		require.NoError(t, http.NewResponseController(w).Flush())
		_, _ = io.WriteString(w, "part 2")
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	first, body1, err := postOver(t, srv, "/stream", `"stream-1"`)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, first.StatusCode)
	require.Equal(t, "part 1, part 2", body1)
	require.Equal(t, []string{"chunked"}, first.TransferEncoding, "the flush streamed the response")
	second, body2, err := postOver(t, srv, "/stream", `"stream-1"`)
	require.NoError(t, err)
	require.Equal(t, "part 1, part 2", body2)
	require.Equal(t, "true", second.Header.Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, "text/plain; charset=utf-8", second.Header.Get("Content-Type"))
	require.Equal(t, int64(1), b.calls.Load())
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	principal := func(*http.Request) (string, error) { return "p", nil }

	_, err := pgidemhttp.New(nil, &pgidemhttp.Config{Principal: principal})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	for _, tt := range []struct {
		config pgidemhttp.Config
		field  string
	}{
		{pgidemhttp.Config{}, "Config.Principal"},
		{pgidemhttp.Config{Principal: principal, TTL: time.Second}, "Config.TTL"},
		{pgidemhttp.Config{Principal: principal, InFlight: 9}, "Config.InFlight"},
		{pgidemhttp.Config{Principal: principal, WaitTimeout: -1}, "Config.WaitTimeout"},
		{pgidemhttp.Config{Principal: principal, RetryAfterMax: time.Millisecond}, "Config.RetryAfterMax"},
		{pgidemhttp.Config{Principal: principal, MaxRequestBytes: -1}, "Config.MaxRequestBytes"},
		{pgidemhttp.Config{Principal: principal, MaxResponseBytes: -1}, "Config.MaxResponseBytes"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{"post"}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{""}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Methods: []string{"PO ST"}}, "Config.Methods"},
		{pgidemhttp.Config{Principal: principal, Namespace: strings.Repeat("n", 65)}, "Config.Namespace"},
		{pgidemhttp.Config{Principal: principal, Namespace: "a\x00b"}, "Config.Namespace"},
	} {
		_, err := pgidemhttp.New(b.coord, &tt.config)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, tt.field)
		require.ErrorContains(t, err, tt.field)
	}

	_, err = pgidemhttp.New(b.coord, &pgidemhttp.Config{Principal: principal, Methods: []string{"M-SEARCH", "VERSION-CONTROL"}})
	require.NoError(t, err, "method tokens with digits and dashes")

	mw, err := pgidemhttp.New(b.coord, &pgidemhttp.Config{Principal: principal})
	require.NoError(t, err)
	cfg := mw.Config()
	require.Equal(t, pgidemhttp.NamespaceDefault, cfg.Namespace)
	require.Equal(t, pgidemhttp.TTLDefault, cfg.TTL)
	require.Equal(t, []string{"POST", "PATCH"}, cfg.Methods)
	require.Equal(t, pgidem.InFlightRaise, cfg.InFlight)
	require.Equal(t, b.coord.Config().WaitTimeout, cfg.WaitTimeout, "the coordinator's, filled in")
	require.EqualValues(t, pgidemhttp.MaxRequestBytesDefault, cfg.MaxRequestBytes)
	require.Contains(t, cfg.ReplayHeaders, "Location")
}

// A handler that panics after it sent its status (httputil.ReverseProxy does, with
// http.ErrAbortHandler, when copying the upstream's body fails) is stored by that status,
// without its body: the client saw the status and the effect may have happened. The key
// used to be released, and the retry ran the handler again. The panic still goes on.
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
// bytes, and the response is still stored whole, its headers with it. The refusal used to
// count as a failed delivery: the ETag was dropped and the replay marked body-omitted.
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

// brokenWriter is a ResponseWriter whose client went away: every body write fails.
type brokenWriter struct{ *httptest.ResponseRecorder }

func (w brokenWriter) Write([]byte) (int, error) { return 0, errors.New("write: broken pipe") }

// A response whose writes failed (the client went away) is stored with the body the
// handler wrote when it declared a Content-Length that body matches: the retry, which is
// what reads it, gets the whole response. Without a declared length the body is left out
// (the handler may have stopped at the failed write). Every failed write used to drop it.
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

// A handler outside the middleware that parses the form (a CSRF check reading a form
// field) consumes the body before the middleware reads it. The fingerprint is then taken
// over the parsed form, so the same key with another form is 422, and the same form is
// replayed. Every such request used to fingerprint as the empty body: a request for sku=B
// was replayed the response to sku=A.
func TestFormParsedOutside(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int64
	inner := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d for %s", n, r.FormValue("sku"))
	}))
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseMultipartForm(1 << 20) // parses URL-encoded forms too
		inner.ServeHTTP(w, r)
	})
	urlencoded := func(key, sku string) *http.Request {
		r := request("POST", "/orders", "alice", key, "sku="+sku)
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		return r
	}
	multipartReq := func(key, sku, file string) *http.Request {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		require.NoError(t, mw.WriteField("sku", sku))
		f, err := mw.CreateFormFile("invoice", "invoice.txt")
		require.NoError(t, err)
		_, _ = io.WriteString(f, file)
		require.NoError(t, mw.Close())
		r := request("POST", "/orders", "alice", key, body.String())
		r.Header.Set("Content-Type", mw.FormDataContentType())
		return r
	}

	require.Equal(t, "order 1 for A", serve(h, urlencoded(`"k1"`, "A")).Body.String())
	requireProblem(t, serve(h, urlencoded(`"k1"`, "B")), http.StatusUnprocessableEntity, "idempotency_key_reused")
	replay := serve(h, urlencoded(`"k1"`, "A"))
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, "order 1 for A", replay.Body.String())

	require.Equal(t, "order 2 for A", serve(h, multipartReq(`"k2"`, "A", "one")).Body.String())
	requireProblem(t, serve(h, multipartReq(`"k2"`, "A", "two")), http.StatusUnprocessableEntity, "idempotency_key_reused")
	requireProblem(t, serve(h, multipartReq(`"k2"`, "B", "one")), http.StatusUnprocessableEntity, "idempotency_key_reused")
	replay = serve(h, multipartReq(`"k2"`, "A", "one"))
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(2), runs.Load())
}

// The client going away just before the handler starts (after the reservation, as fn is
// about to run) does not start the handler on a cancelled context: it does not run, the
// key is released, and the retry runs it once. The handler used to start with its context
// already cancelled, answer an error that released the key, and the retry ran the effect
// a second time.
func TestClientGoneAsHandlerStarts(t *testing.T) {
	t.Parallel()
	var cancelRequest atomic.Pointer[context.CancelFunc]
	b := setup(t, &pgidem.Config{Hook: pgidem.HookFunc(func(ctx context.Context, e pgidem.Event) {
		if cancel := cancelRequest.Swap(nil); cancel != nil && e.Kind == pgidem.EventExecuted {
			(*cancel)()
			select { // the call's context ends with the request's, next not started yet
			case <-ctx.Done():
			case <-time.After(30 * time.Second): // failure cap, not a timing assertion
			}
		}
	})})
	var runs atomic.Int64
	h := b.handler(t, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if r.Context().Err() != nil {
			w.WriteHeader(http.StatusInternalServerError) // the effect cut off half-way
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	cancelRequest.Store(&cancel)
	first := serve(h, request("POST", "/orders", "alice", `"k"`, "x").WithContext(ctx))
	require.Equal(t, http.StatusServiceUnavailable, first.Code)
	require.Zero(t, runs.Load(), "the handler does not start once the client is gone")
	retry := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, http.StatusCreated, retry.Code)
	require.Equal(t, int64(1), runs.Load())
}

// A handler that writes less than the Content-Length it declared (net/http then cuts the
// connection) is stored without its body: a replay never passes part of a body off as
// all of it. One that writes more has the excess refused by net/http, and the declared
// body, which the client got whole, is stored: the refusal used to count as a failed
// delivery and drop it.
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

func panicAfterStatus(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusCreated)
	panic("boom")
}

// writerFunc is an io.Writer made of a function.
type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// The parsed form stands for the body only when the body was consumed: a method whose body
// ParseForm leaves alone (DELETE) is fingerprinted by its body, so another body under the
// key is 422 rather than a replay of the first. And a form an outer handler parsed from a
// chunked body (no Content-Length to check first) is held to MaxRequestBytes.
func TestFormParsedOutsideEdges(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	inner := b.handler(t, &pgidemhttp.Config{Methods: []string{"POST", "DELETE"}, MaxRequestBytes: 64},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }))
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseMultipartForm(1 << 20)
		inner.ServeHTTP(w, r)
	})
	del := func(body string) *http.Request {
		r := request("DELETE", "/orders", "alice", `"d"`, body)
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		return r
	}
	require.Equal(t, http.StatusOK, serve(h, del("id=1")).Code)
	requireProblem(t, serve(h, del("id=2")), http.StatusUnprocessableEntity, "idempotency_key_reused")

	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	require.NoError(t, mw.WriteField("note", strings.Repeat("x", 200)))
	require.NoError(t, mw.Close())
	r := request("POST", "/orders", "alice", `"m"`, body.String())
	r.Header.Set("Content-Type", mw.FormDataContentType())
	r.ContentLength = -1 // chunked
	requireProblem(t, serve(h, r), http.StatusRequestEntityTooLarge, "request_too_large")
}

// The fingerprint holds the path the client sent, not r.URL.Path after a router rewrote it:
// two endpoints under http.StripPrefix both see "/new", and the second used to replay the
// first's response for the same key (a refund answered "payment charged").
func TestFingerprintUsesTheRequestTarget(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	mw, err := pgidemhttp.New(b.coord, &pgidemhttp.Config{Principal: principalFromHeader})
	require.NoError(t, err)
	answer := func(text string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, text)
		})
	}
	mux := http.NewServeMux()
	mux.Handle("/payments/", http.StripPrefix("/payments", mw.Handler(answer("payment charged"))))
	mux.Handle("/refunds/", http.StripPrefix("/refunds", mw.Handler(answer("refund issued"))))
	require.Equal(t, "payment charged", serve(mux, request("POST", "/payments/new", "alice", `"k"`, `{"amount":5}`)).Body.String())
	requireProblem(t, serve(mux, request("POST", "/refunds/new", "alice", `"k"`, `{"amount":5}`)), http.StatusUnprocessableEntity, "idempotency_key_reused")
	replay := serve(mux, request("POST", "/payments/new", "alice", `"k"`, `{"amount":5}`))
	require.Equal(t, "payment charged", replay.Body.String())
	require.Equal(t, "true", replay.Header().Get(pgidemhttp.HeaderReplayed))
}

// A handler that turns content sniffing off (Content-Type: nil, net/http's way to send no
// Content-Type) gets a replay without one too; the replay used to be sniffed, and a body
// sent without a type came back labelled text/html.
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

// A method in another case than Config.Methods ("post") is protected like POST: a handler
// that does not check the method would run it, and it used to pass unprotected, past
// Required.
func TestMethodCaseDoesNotBypass(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, &pgidemhttp.Config{Required: true}, b.createOrder())
	requireProblem(t, serve(h, request("post", "/orders", "alice", "", "x")), http.StatusBadRequest, "idempotency_key_missing")
	serve(h, request("post", "/orders", "alice", `"k"`, "x"))
	require.Equal(t, "true", serve(h, request("post", "/orders", "alice", `"k"`, "x")).Header().Get(pgidemhttp.HeaderReplayed))
	require.Equal(t, int64(1), b.calls.Load())
	requireProblem(t, serve(h, request("POST", "/orders", "alice", `"k"`, "x")), http.StatusUnprocessableEntity, "idempotency_key_reused")
}
