package pgidemhttp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
)

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
// its response is stored, so the retry replays it and the effect runs once. A handler
// that honours a cancelled context (a database call, a call to another service) would stop
// half-way and answer 5xx, which releases the key, and the retry would run the effect
// again. A deadline an outer handler set still applies.
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

// The client going away just before the handler starts (after the reservation, as fn is
// about to run) does not start the handler on a cancelled context: it does not run, the
// key is released, and the retry runs it once. Started on a cancelled context, it would
// answer an error that releases the key, and the retry would run the effect a second
// time.
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

// A method in another case than Config.Methods ("post") is protected like POST: a handler
// that does not check the method would run it, so it must not pass unprotected, past
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
