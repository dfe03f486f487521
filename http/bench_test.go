package pgidemhttp_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/internal/benchsql"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// benchResponse is what the raw-SQL baseline stores: the middleware's record shape.
type benchResponse struct {
	Status int         `json:"status"`
	Header http.Header `json:"header,omitempty"`
	Text   string      `json:"text,omitempty"`
}

// BenchmarkHandler measures a POST handler behind the middleware against a hand-written
// wrapper that does the same work with none of the library: read and fingerprint the body,
// send pgidem's statements for the key as the middleware orders them (reserve first,
// internal/benchsql), run the handler, store its response as JSON; for a replay, the
// reserving insert that finds the record, and the stored response written back. Both run
// in the same loop, one after the other, on one goroutine, so ratio-vs-raw-sql is the
// middleware's overhead from one run. plain-ns/op is the handler alone, without a record.
//
//	go test -run '^$' -bench Handler -count 6 ./http/
func BenchmarkHandler(b *testing.B) {
	ctx := context.Background()
	db := testdb.New(b)
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	mw, err := pgidemhttp.New(coord, &pgidemhttp.Config{Principal: func(*http.Request) (string, error) { return "bench", nil }})
	if err != nil {
		b.Fatal(err)
	}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(body)
	})
	wrapped := mw.Handler(handler)
	const payload = `{"sku":"A-1","quantity":2,"customer":"c-42"}`
	newRequest := func(key string) *http.Request {
		r := httptest.NewRequest("POST", "/orders", strings.NewReader(payload))
		r.Header.Set(pgidemhttp.HeaderKey, `"`+key+`"`)
		return r
	}
	check := func(w *httptest.ResponseRecorder) {
		if w.Code != http.StatusCreated || w.Body.String() != payload {
			b.Fatalf("unexpected response %d %q", w.Code, w.Body)
		}
	}
	middleware := func(key string) {
		w := httptest.NewRecorder()
		wrapped.ServeHTTP(w, newRequest(key))
		check(w)
	}
	rawFresh := func(key string) {
		r, w := newRequest(key), httptest.NewRecorder()
		body, _ := io.ReadAll(r.Body)
		fingerprint := pgidemhttp.FingerprintDefault(r, body)
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		err := benchsql.Fresh(ctx, db.Pool, benchsql.ReserveFirst, "raw", pgidemhttp.RecordKey("bench", key), fingerprint, pgidem.LeaseDefault, pgidemhttp.TTLDefault,
			func() ([]byte, error) {
				handler.ServeHTTP(w, r)
				return json.Marshal(benchResponse{Status: w.Code, Header: http.Header{"Content-Type": w.Header().Values("Content-Type"), "Location": w.Header().Values("Location")}, Text: w.Body.String()})
			})
		if err != nil {
			b.Fatal(err)
		}
		check(w)
	}
	rawReplay := func(key string) {
		r, w := newRequest(key), httptest.NewRecorder()
		body, _ := io.ReadAll(r.Body)
		_ = pgidemhttp.FingerprintDefault(r, body)
		result, err := benchsql.Replay(ctx, db.Pool, benchsql.ReserveFirst, "raw", pgidemhttp.RecordKey("bench", key), pgidem.LeaseDefault, pgidemhttp.TTLDefault)
		if err != nil {
			b.Fatal(err)
		}
		var s benchResponse
		if err := json.Unmarshal(result, &s); err != nil {
			b.Fatal(err)
		}
		for name, values := range s.Header {
			w.Header()[name] = values
		}
		w.Header().Set(pgidemhttp.HeaderReplayed, "true")
		w.WriteHeader(s.Status)
		_, _ = io.WriteString(w, s.Text)
		check(w)
	}
	plain := func() {
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, httptest.NewRequest("POST", "/orders", strings.NewReader(payload)))
		check(w)
	}

	// Warm the fresh database (caches, prepared statements) so neither side pays for
	// coming first.
	prefix := benchsql.KeyPrefix()
	for i := range 200 {
		middleware(prefix + "w" + strconv.Itoa(i))
		rawFresh(prefix + "w" + strconv.Itoa(i))
	}
	middleware("replayed")
	rawFresh("replayed")

	b.Run("FreshKey", func(b *testing.B) {
		prefix := benchsql.KeyPrefix()
		var mwTime, rawTime, plainTime time.Duration
		i := 0
		for b.Loop() {
			i++
			key := prefix + strconv.Itoa(i)
			t0 := time.Now()
			middleware(key)
			t1 := time.Now()
			rawFresh(key)
			t2 := time.Now()
			plain()
			mwTime, rawTime, plainTime = mwTime+t1.Sub(t0), rawTime+t2.Sub(t1), plainTime+time.Since(t2)
		}
		report(b, i, mwTime, rawTime, plainTime)
	})
	b.Run("Replay", func(b *testing.B) {
		var mwTime, rawTime, plainTime time.Duration
		i := 0
		for b.Loop() {
			i++
			t0 := time.Now()
			middleware("replayed")
			t1 := time.Now()
			rawReplay("replayed")
			t2 := time.Now()
			plain()
			mwTime, rawTime, plainTime = mwTime+t1.Sub(t0), rawTime+t2.Sub(t1), plainTime+time.Since(t2)
		}
		report(b, i, mwTime, rawTime, plainTime)
	})
}

func report(b *testing.B, n int, mw, raw, plain time.Duration) {
	if n == 0 {
		return
	}
	per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(n) }
	b.ReportMetric(per(mw), "middleware-ns/op")
	b.ReportMetric(per(raw), "raw-sql-ns/op")
	b.ReportMetric(per(plain), "plain-ns/op")
	b.ReportMetric(float64(mw)/float64(raw), "ratio-vs-raw-sql")
}
