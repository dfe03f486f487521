package pgidemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"mime/multipart"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/pgidem"
)

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

// A handler outside the middleware that parses the form (a CSRF check reading a form
// field) consumes the body before the middleware reads it. The fingerprint is then taken
// over the parsed form, so the same key with another form is 422, and the same form is
// replayed. Fingerprinted as the empty body, a request for sku=B would be replayed the
// response to sku=A.
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
// two endpoints under http.StripPrefix both see "/new", and the second must not replay the
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
