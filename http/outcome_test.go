package pgidemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
)

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

func TestStoreUnavailable(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Schema: "no_such_schema"})
	h := b.handler(t, nil, b.createOrder())

	w := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
	requireProblem(t, w, http.StatusServiceUnavailable, "store_unavailable")
	require.Equal(t, "1", w.Header().Get("Retry-After"))
	require.Equal(t, int64(0), b.calls.Load(), "a request is never run unprotected")
}

// A record that holds a failure instead of a response (written by another caller in the
// middleware's namespace) cannot be replayed: 500, and the handler does not run. A value
// the store refused is "response_not_stored"; any other failure "internal_error".
func TestStoredFailureIsNotReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())
	ctx := context.Background()
	_, err := pgidem.Do(ctx, b.coord, pgidemhttp.NamespaceDefault, pgidemhttp.RecordKey("alice", "failed"), time.Hour, nil,
		func(context.Context) (int, error) { return 0, pgidem.Permanent(errors.New("declined")) })
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	_, err = pgidem.Do(ctx, b.coord, pgidemhttp.NamespaceDefault, pgidemhttp.RecordKey("alice", "unstorable"), time.Hour, nil,
		func(context.Context) (string, error) { return "nul \x00", nil })
	require.ErrorIs(t, err, pgidem.ErrResultNotStorable)

	requireProblem(t, serve(h, request("POST", "/orders", "alice", `"failed"`, "x")), http.StatusInternalServerError, "internal_error")
	requireProblem(t, serve(h, request("POST", "/orders", "alice", `"unstorable"`, "x")), http.StatusInternalServerError, "response_not_stored")
	require.Equal(t, int64(0), b.calls.Load())
}

// A key whose record is parked (its holders kept dying until the coordinator's
// MaxAttempts) is refused with 409 idempotency_key_parked and no Retry-After: a retry
// does not help until an operator forgets the record, after which the handler runs.
func TestParkedKeyIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{MaxAttempts: 2})
	h := b.handler(t, nil, b.createOrder())
	ctx := context.Background()
	key := pgidemhttp.RecordKey("alice", "parked")
	_, err := b.db.Pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at, updated_at)
		VALUES ($1, $2, 'in_progress', gen_random_uuid(), 2, now() - interval '1 second', now() + interval '1 hour', now() - interval '1 minute')`,
		pgidemhttp.NamespaceDefault, key)
	require.NoError(t, err)

	for range 2 { // the request that parks the record, then one that finds it parked
		w := serve(h, request("POST", "/orders", "alice", `"parked"`, "x"))
		requireProblem(t, w, http.StatusConflict, "idempotency_key_parked")
		require.Empty(t, w.Header().Get("Retry-After"))
	}
	require.Equal(t, int64(0), b.calls.Load())
	rec, err := b.coord.Lookup(ctx, pgidemhttp.NamespaceDefault, key)
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusParked, rec.Status)

	_, err = b.coord.Forget(ctx, pgidemhttp.NamespaceDefault, key, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, serve(h, request("POST", "/orders", "alice", `"parked"`, "x")).Code)
	require.Equal(t, int64(1), b.calls.Load())
}

// A call the coordinator refuses (here: the request comes in within a pgidem.Do that holds
// its very record, and would wait for itself) is a server fault: 500, and the handler
// never runs.
func TestRefusedCallIsInternalError(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())
	var w *httptest.ResponseRecorder
	_, err := pgidem.Do(context.Background(), b.coord, pgidemhttp.NamespaceDefault, pgidemhttp.RecordKey("alice", "k"), time.Hour, nil,
		func(ctx context.Context) (int, error) {
			w = serve(h, request("POST", "/orders", "alice", `"k"`, "x").WithContext(ctx))
			return w.Code, nil
		})
	require.NoError(t, err)
	requireProblem(t, w, http.StatusInternalServerError, "internal_error")
	require.Equal(t, int64(0), b.calls.Load())
}

// A request whose client went away before its call reached an outcome gets a bare 503
// (nobody reads it), and the handler does not run.
func TestClientGoneBeforeTheCall(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.handler(t, nil, b.createOrder())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w := serve(h, request("POST", "/orders", "alice", `"k"`, "x").WithContext(ctx))
	require.Equal(t, http.StatusServiceUnavailable, w.Code)
	require.Empty(t, w.Body.String())
	require.Equal(t, int64(0), b.calls.Load())
	require.Equal(t, http.StatusCreated, serve(h, request("POST", "/orders", "alice", `"k"`, "x")).Code, "nothing was reserved")
}

// With a store that cannot be reached, a coordinator with FailOpen runs the handler
// unprotected: every request runs it and nothing is replayed. Without FailOpen: 503.
func TestFailOpenRunsUnprotected(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.DialFunc = func(context.Context, string, string) (net.Conn, error) {
		return nil, errors.New("network unreachable")
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	for _, failOpen := range []bool{true, false} {
		coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{FailOpen: failOpen})
		require.NoError(t, err)
		mw, err := pgidemhttp.New(coord, &pgidemhttp.Config{Principal: principalFromHeader})
		require.NoError(t, err)
		h := mw.Handler(b.createOrder())
		for range 2 {
			w := serve(h, request("POST", "/orders", "alice", `"k"`, "x"))
			if !failOpen {
				requireProblem(t, w, http.StatusServiceUnavailable, "store_unavailable")
				continue
			}
			require.Equal(t, http.StatusCreated, w.Code)
			require.Empty(t, w.Header().Get(pgidemhttp.HeaderReplayed))
		}
	}
	require.Equal(t, int64(2), b.calls.Load())
}
