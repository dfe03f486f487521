package pgidem_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// The tests here run a random concurrent workload — Do, DoInTx, Lookup and Forget from
// many goroutines and several coordinators on a few keys — record every call's start,
// end and outcome, and check with porcupine that the history is linearizable against a
// one-line specification of a key: absent, completed with a value, or failed with a
// stored message. The specification is the protocol's promise seen from outside: fn runs
// only on an absent key, a replay returns exactly what the execution that completed the
// key returned, ErrInProgress is answered only while the key is not finished, a forgotten
// record makes the key absent. Values are unique per call, so a replay names the very
// execution it came from. The effect rows DoInTx writes are counted against the calls
// that reported them.
//
// BackendsTerminated runs the same workload while connections are terminated at random
// and one coordinator is cut off from the server, now and then, for longer than a lease:
// its holders' keys are taken over and their late writes must be fenced off by the owner
// token. A call that met a fault may or may not have taken effect; the specification
// allows both for it, and fn's executions are bounded by the calls that report them plus
// the ambiguous ones.

// linKind is the outcome of one call in the history.
type linKind int

const (
	linExecuted     linKind = iota // fn ran and its value was recorded
	linReleased                    // fn ran, returned an ordinary error, nothing recorded
	linStored                      // fn ran, returned a Permanent error, which was recorded
	linReplayed                    // a completed record's value, fn not run
	linReplayedFail                // a stored failure, fn not run
	linInProgress                  // ErrInProgress, fn not run
	linFound                       // Lookup: a completed or failed record (state in value/msg)
	linFoundRunning                // Lookup: a record in progress
	linNotFound                    // Lookup or Forget: no record
	linForgot                      // Forget deleted a completed or failed record
	linAmbiguous                   // a store fault: the call may or may not have taken effect
)

var linKindNames = [...]string{"executed", "released", "stored", "replayed", "replayed failure",
	"in progress", "found", "found in progress", "not found", "forgot", "ambiguous"}

// linState is the specification's state of one key.
type linState struct {
	status pgidem.Status // "" for absent
	value  int           // completed: the value
	msg    string        // failed: the stored message
}

type linInput struct {
	key string
	op  string // "do", "dotx", "lookup", "forget"
	id  int    // the value this call's fn returns, or the n of its failure "perm-n"
}

type linOutput struct {
	kind linKind
	// ran: fn ran (for linAmbiguous: it may have recorded its outcome, permanent telling
	// which).
	ran, permanent bool
	// value and msg: the value or stored message the call returned or found, or
	// (linAmbiguous) the one it may have recorded.
	value int
	msg   string
}

func linStep(state, input, output any) []any {
	s, in, out := state.(linState), input.(linInput), output.(linOutput)
	absent := s.status == ""
	finished := linState{status: pgidem.StatusCompleted, value: out.value}
	if out.permanent {
		finished = linState{status: pgidem.StatusFailed, msg: out.msg}
	}
	switch out.kind {
	case linExecuted, linStored:
		if absent {
			return []any{finished}
		}
	case linReleased, linInProgress, linNotFound, linFoundRunning:
		if absent {
			return []any{s}
		}
	case linReplayed:
		if s.status == pgidem.StatusCompleted && s.value == out.value {
			return []any{s}
		}
	case linReplayedFail:
		if s.status == pgidem.StatusFailed && s.msg == out.msg {
			return []any{s}
		}
	case linFound:
		if s == finished {
			return []any{s}
		}
	case linForgot:
		if s == finished {
			return []any{linState{}}
		}
	case linAmbiguous:
		if out.ran && absent && in.op != "lookup" && in.op != "forget" {
			return []any{s, finished}
		}
		if in.op == "forget" && !absent {
			return []any{s, linState{}}
		}
		return []any{s}
	}
	return nil
}

func linModel() porcupine.Model {
	m := porcupine.NondeterministicModel{
		Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
			byKey := map[string][]porcupine.Operation{}
			var keys []string
			for _, op := range history {
				k := op.Input.(linInput).key
				if _, ok := byKey[k]; !ok {
					keys = append(keys, k)
				}
				byKey[k] = append(byKey[k], op)
			}
			parts := make([][]porcupine.Operation, 0, len(keys))
			for _, k := range keys {
				parts = append(parts, byKey[k])
			}
			return parts
		},
		Init: func() []any { return []any{linState{}} },
		Step: linStep,
		DescribeOperation: func(input, output any) string {
			in, out := input.(linInput), output.(linOutput)
			return fmt.Sprintf("%s(%s, #%d) → %s %d %q ran=%v", in.op, in.key, in.id, linKindNames[out.kind], out.value, out.msg, out.ran)
		},
		DescribeState: func(state any) string {
			s := state.(linState)
			switch s.status {
			case "":
				return "absent"
			case pgidem.StatusCompleted:
				return fmt.Sprintf("completed %d", s.value)
			}
			return fmt.Sprintf("failed %q", s.msg)
		},
	}
	return m.ToModel()
}

func TestHistoriesAreLinearizable(t *testing.T) {
	t.Parallel()
	t.Run("Calm", func(t *testing.T) {
		t.Parallel()
		testLinearizable(t, false)
	})
	t.Run("BackendsTerminated", func(t *testing.T) {
		t.Parallel()
		testLinearizable(t, true)
	})
}

// linRun is one round of the workload: its keys, its history and its counts.
type linRun struct {
	*linSetup
	round int // the round's keys are "r<round>-k<n>"
	start time.Time

	mu  sync.Mutex
	ops []porcupine.Operation
	// ran counts Do's fn executions by key; reported counts the Do calls whose outcome
	// says fn ran, ambiguous the Do calls a fault made ambiguous. (DoInTx's fn may run and
	// be rolled back; its effect rows are counted instead.)
	ran, reported, ambiguous map[string]int
	// txExecuted and txMaybe are the values of the DoInTx calls that recorded fn's value,
	// or may have (a fault made them ambiguous), by key.
	txExecuted, txMaybe map[string]map[int]bool
}

// linSetup is what the rounds share: the database, the coordinators and the counts of
// the paths the rounds met.
type linSetup struct {
	t      *testing.T
	b      *testBundle
	coords []*pgidem.Coordinator
	faults bool
	lease  time.Duration
	nextID atomic.Int64

	// kinds counts the outcomes of all rounds; fenced the calls whose late write found
	// their reservation taken over; tookOver the calls that took a key over.
	kinds            map[linKind]int
	fenced, tookOver atomic.Int64
}

// The application names of the workload's pools: terminateBackends picks its victims
// among both, partition among the second.
const (
	linApp    = "pgidem-linearizable"
	linCutApp = "pgidem-linearizable-cut"
)

func testLinearizable(t *testing.T, faults bool) {
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE effect (key text NOT NULL, value int NOT NULL)`)
	require.NoError(t, err)

	lease := 30 * time.Second
	if faults {
		// A reservation a fault left in progress is taken over within the run.
		lease = 500 * time.Millisecond
	}
	pool := b.newPool(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 24
		cfg.ConnConfig.RuntimeParams["application_name"] = linApp
	})
	ls := &linSetup{t: t, b: b, faults: faults, lease: lease, kinds: map[linKind]int{}}
	ls.coords = append(ls.coords,
		b.newCoordOn(t, pool, &pgidem.Config{Lease: lease, PollIntervalMax: 20 * time.Millisecond}),
		b.newCoordOn(t, pool, &pgidem.Config{Lease: lease, PollIntervalMax: 20 * time.Millisecond, MaxBatch: 1}))
	// The third coordinator is cut off from the server now and then (faults only): its
	// holders then cannot renew their leases, others take their keys over, and the
	// holders' late writes must be fenced off by the owner token.
	var cut atomic.Bool
	cutPool := b.downablePool(t, &cut, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 12
		cfg.ConnConfig.RuntimeParams["application_name"] = linCutApp
	})
	ls.coords = append(ls.coords, b.newCoordOn(t, cutPool, &pgidem.Config{Lease: lease,
		PollIntervalMax: 50 * time.Millisecond, MaxBatch: 4, FinishTimeout: time.Second}))

	ctx, stop := context.WithCancel(b.ctx)
	var faulter sync.WaitGroup
	defer func() { stop(); faulter.Wait() }()
	if faults {
		faulter.Go(func() { ls.terminateBackends(ctx) })
		faulter.Go(func() { ls.partition(ctx, &cut) })
	}

	// Rounds of 960 calls, each checked on its own, until the rounds have met every path
	// the check is about (one round nearly always does; a fenced-off holder needs luck).
	paths := []linKind{linExecuted, linReleased, linStored, linReplayed, linReplayedFail, linInProgress, linForgot}
	if faults {
		paths = append(paths, linAmbiguous)
	}
	metAll := func() bool {
		for _, k := range paths {
			if ls.kinds[k] == 0 {
				return false
			}
		}
		return !faults || ls.fenced.Load() > 0
	}
	for round := 0; round < 5 && !metAll(); round++ {
		r := &linRun{linSetup: ls, round: round, start: time.Now(),
			ran: map[string]int{}, reported: map[string]int{}, ambiguous: map[string]int{},
			txExecuted: map[string]map[int]bool{}, txMaybe: map[string]map[int]bool{}}
		const clients, opsPerClient = 12, 80
		var wg sync.WaitGroup
		for c := range clients {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(c), uint64(time.Now().UnixNano())))
				for range opsPerClient {
					r.call(c, rng)
				}
			})
		}
		wg.Wait()
		r.check()
	}
	t.Logf("outcomes: %v; %d took a key over, %d were fenced off", ls.kinds, ls.tookOver.Load(), ls.fenced.Load())
	// The workload must have met each path, or the check proved little.
	for _, k := range paths {
		require.NotZero(t, ls.kinds[k], "no call ended %s", linKindNames[k])
	}
	if faults {
		require.NotZero(t, ls.fenced.Load(), "no holder outlived its lease and was fenced off")
	}
}

// terminateBackends ends a random connection of the workload's pool every few
// milliseconds until ctx ends, as a failover or an administrator would.
func (r *linSetup) terminateBackends(ctx context.Context) {
	for ctx.Err() == nil {
		_, _ = r.b.db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name IN ($1, $2)
			ORDER BY random() LIMIT 1`, linApp, linCutApp)
		_ = sleepFor(ctx, time.Duration(10+rand.IntN(30))*time.Millisecond)
	}
}

// partition cuts the third coordinator off from the server for longer than a lease, now
// and then, until ctx ends: its connections are terminated and new ones refused.
func (r *linSetup) partition(ctx context.Context, cut *atomic.Bool) {
	for sleepFor(ctx, time.Duration(300+rand.IntN(300))*time.Millisecond) == nil {
		cut.Store(true)
		_, _ = r.b.db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = $1`, linCutApp)
		_ = sleepFor(ctx, r.lease+300*time.Millisecond)
		cut.Store(false)
	}
}

func sleepFor(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

var errLinDeclined = errors.New("declined")

// call makes one random call as client c and records it.
func (r *linRun) call(c int, rng *rand.Rand) {
	key := fmt.Sprintf("r%d-k%d", r.round, rng.IntN(6))
	ci := rng.IntN(len(r.coords))
	coord := r.coords[ci]
	in := linInput{key: key, id: int(r.nextID.Add(1))}
	opts := &pgidem.DoOpts{ReserveFirst: rng.IntN(2) == 0, InFlight: pgidem.InFlightWait}
	if rng.IntN(2) == 0 {
		opts.InFlight = pgidem.InFlightRaise
	}
	// fn's outcome: mostly a value, sometimes an ordinary or a permanent error.
	outcome := rng.IntN(10)
	permMsg := "perm-" + strconv.Itoa(in.id)
	sleep := time.Duration(rng.IntN(15)) * time.Millisecond
	// On the coordinator that is cut off now and then (faults only), every effect is
	// slow: it outlives a lease, during which a partition may end its renewals, and like a
	// real one in flight it does not stop when its context is cancelled.
	slow := r.faults && ci == len(r.coords)-1
	// returned is what fn last returned: 0 when it did not run or did not return.
	var returned atomic.Int32
	fnResult := func(ctx context.Context) (int, error) {
		if in.op == "do" {
			r.mu.Lock()
			r.ran[key]++
			r.mu.Unlock()
		}
		if slow {
			time.Sleep(2 * r.lease)
		} else if err := sleepFor(ctx, sleep); err != nil {
			returned.Store(fnFaulted)
			return 0, err
		}
		switch {
		case outcome < 2:
			returned.Store(fnDeclined)
			return 0, errLinDeclined
		case outcome < 4:
			returned.Store(fnPermanent)
			return 0, pgidem.Permanent(errors.New(permMsg))
		}
		returned.Store(fnValue)
		return in.id, nil
	}

	var out linOutput
	p := rng.IntN(20)
	switch {
	case p < 9:
		in.op = "do"
	case p < 14:
		in.op = "dotx"
	case p < 16:
		in.op = "lookup"
	default:
		in.op = "forget"
	}
	call := time.Since(r.start).Nanoseconds()
	switch {
	case p < 9:
		res, err := pgidem.DoResult(r.b.ctx, coord, "lin", key, testTTL, opts, fnResult)
		out = r.classify(in, returned.Load(), res, err)
	case p < 14:
		res, err := pgidem.DoInTxResult(r.b.ctx, coord, "lin", key, testTTL, opts, func(ctx context.Context, tx pgx.Tx) (int, error) {
			v, err := fnResult(ctx)
			if err == nil {
				if _, err = tx.Exec(ctx, `INSERT INTO effect (key, value) VALUES ($1, $2)`, key, v); err != nil {
					returned.Store(fnFaulted)
				}
			}
			return v, err
		})
		out = r.classify(in, returned.Load(), res, err)
	case p < 16:
		rec, err := coord.Lookup(r.b.ctx, "lin", key)
		out = r.classifyRecord(in, rec, err, linFound)
	default:
		rec, err := coord.Forget(r.b.ctx, "lin", key, nil)
		if errors.Is(err, pgidem.ErrInProgress) {
			out = linOutput{kind: linInProgress}
			break
		}
		out = r.classifyRecord(in, rec, err, linForgot)
	}
	ret := time.Since(r.start).Nanoseconds()

	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: c, Input: in, Call: call, Output: out, Return: ret})
	if in.op == "do" && out.kind == linAmbiguous {
		r.ambiguous[key]++
	} else if in.op == "do" && out.ran {
		r.reported[key]++
	}
	if in.op == "dotx" && (out.kind == linExecuted || out.kind == linAmbiguous && out.ran && !out.permanent) {
		m := r.txExecuted
		if out.kind == linAmbiguous {
			m = r.txMaybe
		}
		if m[key] == nil {
			m[key] = map[int]bool{}
		}
		m[key][in.id] = true
	}
}

// What fn last returned.
const (
	fnValue = 1 + iota
	fnDeclined
	fnPermanent
	fnFaulted // fn's sleep or statement was cut short (its lease lost, its connection gone)
)

// classify turns a Do or DoInTx outcome into the history's output; returned is what fn
// last returned (0: it did not return). An outcome no specification state allows is an
// error of the test at once.
func (r *linRun) classify(in linInput, returned int32, res pgidem.Result[int], err error) linOutput {
	t := r.t
	permMsg := "perm-" + strconv.Itoa(in.id)
	if res.LeaseLost {
		r.fenced.Add(1)
	}
	if res.TookOver {
		r.tookOver.Add(1)
	}
	if in.op == "dotx" && res.Replayed {
		// DoTx's fn may have run and been rolled back to its savepoint because a Do
		// reserved the key meanwhile; DoTx then decided again.
		returned = 0
	}
	var stored *pgidem.StoredFailureError
	switch {
	case returned != 0 && res.Replayed:
		t.Errorf("%s %s #%d: fn ran and the result says replayed", in.op, in.key, in.id)
	case res.LeaseLost || errors.Is(err, pgidem.ErrLeaseLost) || errors.Is(err, pgidem.ErrStoreUnavailable) ||
		(r.faults && returned == fnFaulted):
		if !r.faults {
			t.Errorf("%s %s #%d: %v (lease lost %v) with no fault injected", in.op, in.key, in.id, err, res.LeaseLost)
		}
		// Only a value or a permanent failure can have been recorded.
		return linOutput{kind: linAmbiguous, ran: returned == fnValue || returned == fnPermanent,
			permanent: returned == fnPermanent, value: in.id, msg: permMsg}
	case err == nil && res.Replayed:
		return linOutput{kind: linReplayed, value: res.Value}
	case err == nil && returned == fnValue:
		if res.Value != in.id {
			t.Errorf("%s %s #%d: fn ran and returned %d", in.op, in.key, in.id, res.Value)
		}
		return linOutput{kind: linExecuted, ran: true, value: res.Value}
	case errors.As(err, &stored) && returned == 0:
		return linOutput{kind: linReplayedFail, msg: stored.Message}
	case errors.Is(err, errLinDeclined) && returned == fnDeclined:
		return linOutput{kind: linReleased, ran: true}
	case returned == fnPermanent && err != nil && err.Error() == permMsg:
		return linOutput{kind: linStored, ran: true, permanent: true, msg: permMsg}
	case errors.Is(err, pgidem.ErrInProgress) && (returned == 0 || in.op == "dotx"):
		// (DoTx may have run fn and rolled it back before it met the Do holder.)
		return linOutput{kind: linInProgress}
	}
	t.Errorf("%s %s #%d: unexpected outcome: fn returned %d, result %+v, error %v", in.op, in.key, in.id, returned, res, err)
	return linOutput{kind: linAmbiguous, ran: returned == fnValue || returned == fnPermanent,
		permanent: returned == fnPermanent, value: in.id, msg: permMsg}
}

// classifyRecord turns a Lookup or Forget outcome into the history's output; found is
// the kind for a finished record.
func (r *linRun) classifyRecord(in linInput, rec *pgidem.Record, err error, found linKind) linOutput {
	t := r.t
	switch {
	case errors.Is(err, pgidem.ErrNotFound):
		return linOutput{kind: linNotFound}
	case err != nil:
		if !r.faults || !errors.Is(err, pgidem.ErrStoreUnavailable) {
			t.Errorf("%s %s: %v", in.op, in.key, err)
		}
		return linOutput{kind: linAmbiguous}
	case rec.Expired:
		t.Errorf("%s %s: an expired record within the TTL: %+v", in.op, in.key, rec)
	case rec.Status == pgidem.StatusInProgress && found == linFound:
		return linOutput{kind: linFoundRunning}
	case rec.Status == pgidem.StatusInProgress && r.faults:
		// Forget deleted a reservation whose lease had run out: a fault stopped its
		// holder's renewals (whose completion then fails as lease lost).
		return linOutput{kind: linNotFound}
	case rec.Status == pgidem.StatusCompleted:
		var v int
		require.NoError(t, json.Unmarshal(rec.Result, &v))
		return linOutput{kind: found, value: v}
	case rec.Status == pgidem.StatusFailed:
		var f struct {
			Message string `json:"message"`
		}
		require.NoError(t, json.Unmarshal(rec.Error, &f))
		return linOutput{kind: found, permanent: true, msg: f.Message}
	}
	t.Errorf("%s %s: unexpected record %+v", in.op, in.key, rec)
	return linOutput{kind: linAmbiguous}
}

// check runs the linearizability check and counts executions and effect rows.
func (r *linRun) check() {
	t := r.t
	result, info := porcupine.CheckOperationsVerbose(linModel(), r.ops, time.Minute)
	if result != porcupine.Ok {
		path := filepath.Join(t.ArtifactDir(), "history.html")
		if err := porcupine.VisualizePath(linModel(), info, path); err != nil {
			t.Logf("visualizing: %v", err)
		}
		r.logIllegal()
		t.Fatalf("the history of %d calls is %s (visualized in %s; run with -artifacts to keep it)", len(r.ops), result, path)
	}

	for _, op := range r.ops {
		r.kinds[op.Output.(linOutput).kind]++
	}

	// fn ran exactly as often as the outcomes say, apart from calls a fault made
	// ambiguous.
	for key, n := range r.ran {
		require.GreaterOrEqual(t, n, r.reported[key], "key %s", key)
		require.LessOrEqual(t, n, r.reported[key]+r.ambiguous[key], "key %s: fn ran %d times, outcomes report %d, %d ambiguous", key, n, r.reported[key], r.ambiguous[key])
	}

	// DoInTx's effect rows commit exactly with its record: one per call that reported
	// its value recorded, none for any other call, except ambiguous ones.
	rows, err := r.b.db.Pool.Query(r.b.ctx, `SELECT key, value FROM effect WHERE key LIKE $1`, fmt.Sprintf("r%d-%%", r.round))
	require.NoError(t, err)
	committed, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		Key   string
		Value int
	}])
	require.NoError(t, err)
	seen := map[string]map[int]bool{}
	for _, e := range committed {
		require.True(t, r.txExecuted[e.Key][e.Value] || r.txMaybe[e.Key][e.Value], "effect row %s=%d from no call that recorded it", e.Key, e.Value)
		require.False(t, seen[e.Key][e.Value], "effect row %s=%d twice", e.Key, e.Value)
		if seen[e.Key] == nil {
			seen[e.Key] = map[int]bool{}
		}
		seen[e.Key][e.Value] = true
	}
	for key, values := range r.txExecuted {
		for v := range values {
			require.True(t, seen[key][v], "DoInTx %s #%d reported its effect recorded; no effect row", key, v)
		}
	}
}

// logIllegal logs, for each key whose history is not linearizable, its calls in order of
// their start, and the longest order of them the specification allowed.
func (r *linRun) logIllegal() {
	m := linModel()
	for _, part := range m.Partition(r.ops) {
		if porcupine.CheckOperations(m, part) {
			continue
		}
		slices.SortFunc(part, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
		for _, op := range part {
			r.t.Logf("%6.1f–%6.1f ms client %2d %s", float64(op.Call)/1e6, float64(op.Return)/1e6, op.ClientId, m.DescribeOperation(op.Input, op.Output))
		}
		_, info := porcupine.CheckOperationsVerbose(m, part, 0)
		var longest []porcupine.Operation
		for _, lins := range info.PartialLinearizationsOperations() {
			for _, lin := range lins {
				if len(lin) > len(longest) {
					longest = lin
				}
			}
		}
		for i, op := range longest {
			r.t.Logf("allowed %d: %s", i, m.DescribeOperation(op.Input, op.Output))
		}
		return
	}
}
