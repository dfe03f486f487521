// Command httpapi is a payments API behind pgidemhttp: a client that loses a response and
// retries with its Idempotency-Key gets the first response back, and the card is charged
// once.
//
//	go run ./examples/httpapi     # or: make demo
//
// The server is real: net/http on a loopback port, with POST /payments behind
// pgidemhttp.Middleware. The handler charges a card at a payment provider (in-process,
// counting its charges, taking a second) and writes a payment row. Under a key it runs both
// effects under pgidemhttp.ScopedKey too, the charge with pgidem.Do and the row with
// pgidem.DoInTx, so that even a retry that runs the handler again (after its server died
// mid-request) replays the effects that completed instead of charging and writing twice.
// (A real provider takes an idempotency key of its own as well, for a charge cut off
// mid-way: pgidem.KeyFromContext in the charge's fn.)
//
// Scene 1: the client's request times out after 100 ms (the response is lost on the way);
// it retries at once with the same key and is told 409 with Retry-After while the first
// request is still running; it waits and retries, and gets the first response, replayed.
// One charge, one payment row.
//
// Scene 2: the client reuses its key for a different amount: 422, nothing charged.
//
// Scene 3: the same lost response without a key: the retry charges the card again.
//
// Scene 4: the server fails after charging the card and writing the payment, before it
// answers (the handler aborts, which releases the request's key as the end of a dead
// server's lease would); the client's retry runs the handler again, which replays the
// charge and the payment from their own records.
//
// It creates its own database on the server found like the tests find theirs
// (DATABASE_URL, libpq PG* variables, postgres://postgres@127.0.0.1:5432), migrates it, and
// drops it at the end.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	pgidemhttp "github.com/pgidem/pgidem/http"
	"github.com/pgidem/pgidem/internal/dbserver"
	"github.com/pgidem/pgidem/pgidem"
)

// chargeTime is how long the provider takes to charge a card; the client of the lost
// response gives up after clientTimeout.
const (
	chargeTime    = time.Second
	clientTimeout = 100 * time.Millisecond
)

func main() {
	// Interrupted, it still drops its database.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "httpapi:", err)
		os.Exit(1)
	}
}

// sceneCounts are one scene's printed numbers.
type sceneCounts struct {
	Requests int    // requests the client sent
	Statuses string // their statuses, in order ("lost" for a response the client did not get)
	Charges  int    // cards charged at the provider
	Payments int    // payment rows written
}

// counts are what run prints, for the test.
type counts struct {
	LostResponse, ReusedKey, NoKey, FailAfterCharge sceneCounts
}

// provider is the payment provider: it counts charges per customer.
type provider struct {
	mu      sync.Mutex
	charges map[string]int
}

func (p *provider) charge(customer string, amountCents int) string {
	time.Sleep(chargeTime)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.charges[customer]++
	return fmt.Sprintf("ch_%s_%d", customer, p.charges[customer])
}

type api struct {
	pool     *pgxpool.Pool
	coord    *pgidem.Coordinator
	provider *provider
	failOnce sync.Map // customer → true: the handler fails after its effects, once
}

// effectTTL is how long the handler's own effects are replayed: as long as the
// middleware's records (24 h); ScopedKey ties them to the request, so an effect record
// that outlives the middleware's can only be replayed to the same request.
const effectTTL = 24 * time.Hour

// createPayment is the handler: charge the card, write the payment row, answer 201. The
// caller is the customer named in X-Customer (a real API takes it from authentication).
func (a *api) createPayment(w http.ResponseWriter, r *http.Request) {
	var req struct {
		AmountCents int `json:"amount_cents"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.AmountCents <= 0 {
		http.Error(w, "amount_cents must be a positive integer", http.StatusBadRequest) // stored: a retry gets the same 400
		return
	}
	customer := r.Header.Get("X-Customer")
	// The card is charged once the handler starts: finish the work even if the client
	// goes away, so the record holds the outcome its retry will get.
	ctx := context.WithoutCancel(r.Context())
	charge := func(context.Context) (string, error) { return a.provider.charge(customer, req.AmountCents), nil }
	insert := func(ctx context.Context, tx pgx.Tx) (int64, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO payments (customer, amount_cents) VALUES ($1, $2) RETURNING id`,
			customer, req.AmountCents).Scan(&id)
		return id, err
	}
	var chargeID string
	var id int64
	var err error
	if key, ok := pgidemhttp.ScopedKey(r.Context()); ok {
		// Each effect under the request's key, scoped to its caller, in a namespace of its own.
		if chargeID, err = pgidem.Do(ctx, a.coord, "charges", key, effectTTL, nil, charge); err == nil {
			id, err = pgidem.DoInTx(ctx, a.coord, "payments", key, effectTTL, nil, insert)
		}
		if _, fail := a.failOnce.LoadAndDelete(customer); fail && err == nil {
			panic(http.ErrAbortHandler) // the server fails before answering (scene 4)
		}
	} else {
		// No Idempotency-Key: nothing to dedupe on.
		chargeID, _ = charge(ctx)
		err = pgx.BeginFunc(ctx, a.pool, func(tx pgx.Tx) error { id, err = insert(ctx, tx); return err })
	}
	if err != nil {
		http.Error(w, "payment not recorded", http.StatusInternalServerError) // not stored: a retry runs again
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/payments/%d", id))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]any{"payment_id": id, "charge_id": chargeID, "amount_cents": req.AmountCents})
}

func run(ctx context.Context, w io.Writer) (counts, error) {
	var out counts
	scratch, err := dbserver.NewScratch(ctx, "pgidem_httpapi_")
	if err != nil {
		return out, err
	}
	defer scratch.Close(ctx)
	pool := scratch.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE payments (
		id bigserial PRIMARY KEY, customer text NOT NULL, amount_cents int NOT NULL)`); err != nil {
		return out, err
	}
	coord, err := pgidem.NewCoordinator(pool, nil)
	if err != nil {
		return out, err
	}
	mw, err := pgidemhttp.New(coord, &pgidemhttp.Config{
		// DEMO ONLY: the caller names itself in a header anyone can set. A real API puts the
		// middleware behind authentication and returns the authenticated user here.
		Principal: func(r *http.Request) (string, error) {
			if c := r.Header.Get("X-Customer"); c != "" {
				return c, nil
			}
			return "", errors.New("no customer")
		},
		RetryAfterMax: time.Second, // its requests take well under a second
	})
	if err != nil {
		return out, err
	}
	a := &api{pool: pool, coord: coord, provider: &provider{charges: map[string]int{}}}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Handler(http.HandlerFunc(a.createPayment)))

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return out, err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		_ = srv.Shutdown(context.WithoutCancel(ctx))
		<-served
	}()
	c := &client{base: "http://" + ln.Addr().String(), w: w}
	defer c.http.CloseIdleConnections()

	fmt.Fprintf(w, "the provider takes %s to charge a card; a client that loses its response gives up after %s\n", chargeTime, clientTimeout)
	fmt.Fprintln(w, "scene 1  the response is lost; the client retries with its Idempotency-Key")
	s := &out.LostResponse
	c.post(ctx, s, "cus_1", `"pay-1"`, 1500, clientTimeout)
	for {
		resp := c.post(ctx, s, "cus_1", `"pay-1"`, 1500, 0)
		if resp.status != http.StatusConflict {
			break
		}
		time.Sleep(time.Duration(resp.retryAfter) * time.Second)
	}
	if err := a.count(ctx, w, s, "cus_1", sceneCounts{}); err != nil {
		return out, err
	}

	fmt.Fprintln(w, "  (409: the first request was still charging the card; the replay is its response)")
	fmt.Fprintln(w, "scene 2  the same key for a different amount")
	s = &out.ReusedKey
	c.post(ctx, s, "cus_1", `"pay-1"`, 9900, 0)
	if err := a.count(ctx, w, s, "cus_1", out.LostResponse); err != nil {
		return out, err
	}

	fmt.Fprintln(w, "scene 3  the response is lost; the client retries without a key")
	s = &out.NoKey
	c.post(ctx, s, "cus_2", "", 1500, clientTimeout)
	time.Sleep(2 * chargeTime) // the client waits a little before retrying
	c.post(ctx, s, "cus_2", "", 1500, 0)
	time.Sleep(2 * chargeTime) // let the first request finish before counting
	if err := a.count(ctx, w, s, "cus_2", sceneCounts{}); err != nil {
		return out, err
	}
	fmt.Fprintln(w, "  (the lost first request charged the card and wrote a payment too: two of each)")

	fmt.Fprintln(w, "scene 4  the server fails after the charge and the payment, before answering; the client retries")
	s = &out.FailAfterCharge
	a.failOnce.Store("cus_3", true)
	// A fresh connection: on a reused one, Go's http.Transport would itself resend a
	// request that carries an Idempotency-Key once the server closed it, and the client
	// would not see the failure.
	c.http.CloseIdleConnections()
	c.post(ctx, s, "cus_3", `"pay-3"`, 2500, 0)
	c.post(ctx, s, "cus_3", `"pay-3"`, 2500, 0)
	if err := a.count(ctx, w, s, "cus_3", sceneCounts{}); err != nil {
		return out, err
	}
	fmt.Fprintln(w, "  (the retry ran the handler again: charge and payment came from their records, not done twice)")
	return out, nil
}

// count sets s's charges and payment rows: customer's, less those counted in before (an
// earlier scene's), and prints them.
func (a *api) count(ctx context.Context, w io.Writer, s *sceneCounts, customer string, before sceneCounts) error {
	a.provider.mu.Lock()
	s.Charges = a.provider.charges[customer] - before.Charges
	a.provider.mu.Unlock()
	if err := a.pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE customer = $1`, customer).Scan(&s.Payments); err != nil {
		return err
	}
	s.Payments -= before.Payments
	fmt.Fprintf(w, "  requests=%d cards charged=%d payment rows=%d\n", s.Requests, s.Charges, s.Payments)
	return nil
}

// client sends the scenes' requests and prints each outcome.
type client struct {
	base string
	http http.Client
	w    io.Writer
}

type response struct {
	status     int
	retryAfter int
}

// post sends POST /payments as customer with the Idempotency-Key field key ("" for none);
// timeout > 0 makes the client give up after it, losing the response.
func (c *client) post(ctx context.Context, s *sceneCounts, customer, key string, amountCents int, timeout time.Duration) response {
	s.Requests++
	reqCtx := ctx
	if timeout > 0 {
		var cancel context.CancelFunc
		reqCtx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(reqCtx, "POST", c.base+"/payments", strings.NewReader(fmt.Sprintf(`{"amount_cents":%d}`, amountCents)))
	if err != nil {
		panic(err) // a constant URL and body: cannot fail
	}
	req.Header.Set("X-Customer", customer)
	if key != "" {
		req.Header.Set(pgidemhttp.HeaderKey, key)
	}
	label := fmt.Sprintf("  POST /payments %-13s amount=%d", cmp.Or(key, "(no key)"), amountCents)
	resp, err := c.http.Do(req)
	if err != nil {
		fmt.Fprintf(c.w, "%s → no response (%s)\n", label, describe(err))
		s.Statuses = strings.TrimSpace(s.Statuses + " lost")
		return response{}
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	s.Statuses = strings.TrimSpace(s.Statuses + " " + strconv.Itoa(resp.StatusCode))
	retryAfter, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	extra := ""
	if resp.Header.Get(pgidemhttp.HeaderReplayed) == "true" {
		extra = " (Idempotent-Replayed: true)"
	}
	if retryAfter > 0 {
		extra += fmt.Sprintf(" (Retry-After: %d)", retryAfter)
	}
	fmt.Fprintf(c.w, "%s → %d %s%s\n", label, resp.StatusCode, summarize(resp.Header.Get("Content-Type"), body), extra)
	return response{status: resp.StatusCode, retryAfter: retryAfter}
}

func describe(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return "the client gave up"
	}
	if errors.Is(err, io.EOF) {
		return "the server closed the connection"
	}
	return err.Error()
}

// summarize shows a response body on one line: a problem's code, or the JSON.
func summarize(contentType string, body []byte) string {
	if contentType == pgidemhttp.ProblemContentType {
		var p pgidemhttp.Problem
		if json.Unmarshal(body, &p) == nil {
			return p.Code
		}
	}
	return strings.TrimSpace(string(body))
}
