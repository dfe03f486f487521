package pgidemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// A client creates an order, loses the response and retries with the same key: the retry
// gets the first response back and no second order is created.
func ExampleMiddleware_Handler() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // a fresh database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	mw, err := pgidemhttp.New(coord, &pgidemhttp.Config{
		// Behind authentication, return the caller's identity.
		Principal: func(r *http.Request) (string, error) { return r.Header.Get("X-User"), nil },
	})
	if err != nil {
		log.Fatal(err)
	}
	orders := 0
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		orders++
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", orders))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d created", orders)
	})
	srv := httptest.NewServer(mw.Handler(createOrder))
	defer srv.Close()

	for attempt := 1; attempt <= 2; attempt++ {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku":"A-1"}`))
		req.Header.Set("X-User", "alice")
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		resp, err := srv.Client().Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("attempt %d: %d %s, Location %s, replayed %q\n", attempt, resp.StatusCode, body,
			resp.Header.Get("Location"), resp.Header.Get("Idempotent-Replayed"))
	}
	fmt.Println("orders created:", orders)
	// Output:
	// attempt 1: 201 order 1 created, Location /orders/1, replayed ""
	// attempt 2: 201 order 1 created, Location /orders/1, replayed "true"
	// orders created: 1
}
