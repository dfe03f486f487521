package pgidemhttp_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/pgidem"
)

// The middleware behind PgBouncer in transaction pooling, with pgx's exec mode and the
// simple protocol: 16 clients post every one of 30 idempotency keys at once (in-flight
// retries wait for the first request); each key's handler runs once, its effect is one
// row, and every client receives the same response for a key, replayed where it did not
// run.
func TestPoolerHTTP(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			b := setup(t, nil)
			_, err := b.db.Pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL)`)
			require.NoError(t, err)
			cfg, err := pgxpool.ParseConfig(pgbouncer.URL(t, b.db.URL, mode))
			require.NoError(t, err)
			cfg.MaxConns = 32
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: 5 * time.Second, FinishTimeout: 30 * time.Second, PollOnly: true})
			require.NoError(t, err)
			mw, err := pgidemhttp.New(coord, &pgidemhttp.Config{Principal: principalFromHeader, InFlight: pgidem.InFlightWait})
			require.NoError(t, err)
			create := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				var id int64
				err := pool.QueryRow(r.Context(), `INSERT INTO orders (key) VALUES ($1) RETURNING id`, r.Header.Get("Idempotency-Key")).Scan(&id)
				if err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"order":%d}`, id)
			})
			server := httptest.NewServer(mw.Handler(create))
			defer server.Close()
			client := server.Client()
			defer client.CloseIdleConnections()

			const callers, keys = 16, 30
			type answer struct {
				status   int
				body     string
				replayed bool
			}
			var mu sync.Mutex
			answers := map[string][]answer{}
			errs := make(chan error, callers)
			var wg sync.WaitGroup
			for caller := range callers {
				wg.Go(func() {
					for i := range keys {
						key := fmt.Sprintf("order-%d", (i+caller*3)%keys)
						req, err := http.NewRequestWithContext(ctx, http.MethodPost, server.URL+"/orders", bytes.NewReader([]byte(`{"sku":"a"}`)))
						if err != nil {
							errs <- err
							return
						}
						req.Header.Set("Idempotency-Key", `"`+key+`"`)
						req.Header.Set(principalHeader, "alice")
						req.Header.Set("Content-Type", "application/json")
						resp, err := client.Do(req)
						if err != nil {
							errs <- err
							return
						}
						body, err := io.ReadAll(resp.Body)
						resp.Body.Close()
						if err != nil {
							errs <- err
							return
						}
						mu.Lock()
						answers[key] = append(answers[key], answer{resp.StatusCode, string(body), resp.Header.Get("Idempotent-Replayed") == "true"})
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			close(errs)
			require.NoError(t, <-errs)

			rows, err := b.db.Pool.Query(ctx, `SELECT key, count(*) FROM orders GROUP BY key`)
			require.NoError(t, err)
			effects := map[string]int{}
			for rows.Next() {
				var key string
				var n int
				require.NoError(t, rows.Scan(&key, &n))
				effects[key] = n
			}
			require.NoError(t, rows.Err())
			require.Len(t, effects, keys)
			for key, got := range answers {
				require.Equal(t, 1, effects[`"`+key+`"`], "orders created for %s", key)
				require.Len(t, got, callers)
				fresh := 0
				for _, a := range got {
					require.Equal(t, http.StatusCreated, a.status, "%s: %s", key, a.body)
					require.Equal(t, got[0].body, a.body, "every client gets the same response for %s", key)
					if !a.replayed {
						fresh++
					}
				}
				require.Equal(t, 1, fresh, "one response for %s is not a replay", key)
			}
		})
	}
}
