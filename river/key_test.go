package pgidemriver_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// SharedNSArgs name their effect under a namespace shared with another kind.
type SharedNSArgs struct {
	OrderID int64 `json:"order_id"`
}

func (SharedNSArgs) Kind() string { return "mail.invoice_v2" }

func (SharedNSArgs) IdempotencyKey() string { return "order-9.invoice" }

func (SharedNSArgs) IdempotencyNamespace() string { return "mail.invoice" }

// The valid paths of the namespace method and of Config.KeyFunc (other tests cover the
// invalid ones): a job of another kind that names the same (namespace, key) replays
// instead of running; a KeyFunc key dedupes two different jobs; the KeyFunc's empty
// namespace defaults to the kind.
func TestKeyFromNamespaceMethodAndKeyFunc(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("NamespaceMethod", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, nil)
		mw.Register(InvoiceArgs{}, SharedNSArgs{})
		var runs atomic.Int32
		work := func(context.Context) error { runs.Add(1); return nil }
		require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":9}`), work))
		require.NoError(t, mw.Work(b.ctx, jobRow(2, "mail.invoice_v2", `{"order_id":9}`), work))
		require.EqualValues(t, 1, runs.Load(), "same namespace and key: the effect runs once")
		all := outs.list()
		require.Len(t, all, 2)
		require.Equal(t, pgidemriver.ActionExecuted, all[0].Action)
		require.Equal(t, pgidemriver.ActionReplayed, all[1].Action)
		require.Equal(t, "mail.invoice", all[1].Namespace)
		require.Equal(t, pgidemriver.KeySourceArgs, all[1].KeySource)
	})

	t.Run("KeyFunc", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, &pgidemriver.Config{
			KeyFunc: func(job *rivertype.JobRow) (string, string, bool) {
				if job.Kind != "mail.plain" {
					return "", "", false
				}
				return "", "order-7.receipt", true
			},
		})
		mw.Register(PlainArgs{})
		var runs atomic.Int32
		work := func(context.Context) error { runs.Add(1); return nil }
		require.NoError(t, mw.Work(b.ctx, jobRow(11, "mail.plain", `{"order_id":7}`), work))
		require.NoError(t, mw.Work(b.ctx, jobRow(12, "mail.plain", `{"order_id":7}`), work))
		require.EqualValues(t, 1, runs.Load(), "two jobs, one KeyFunc key: the effect runs once")
		all := outs.list()
		require.Len(t, all, 2)
		for _, o := range all {
			require.Equal(t, pgidemriver.KeySourceFunc, o.KeySource)
			require.Equal(t, "mail.plain", o.Namespace, "an empty KeyFunc namespace defaults to the kind")
			require.Equal(t, "order-7.receipt", o.Key)
		}
		require.Zero(t, mw.Stats().JobIDKeys, "not counted as a job-id fallback")
		rec, err := b.coord.Lookup(b.ctx, "mail.plain", "order-7.receipt")
		require.NoError(t, err)
		require.Equal(t, 1, rec.Attempts)
	})
}

// AliasedInvoiceArgs is InvoiceArgs after a kind rename: jobs inserted under the old kind
// are still worked by the same worker.
type AliasedInvoiceArgs struct {
	OrderID int64 `json:"order_id"`
}

func (AliasedInvoiceArgs) Kind() string { return "mail.invoice_v2" }

func (AliasedInvoiceArgs) KindAliases() []string { return []string{"mail.invoice_v1"} }

func (a AliasedInvoiceArgs) IdempotencyKey() string {
	return fmt.Sprintf("order-%d.invoice", a.OrderID)
}

// AliasedPlainArgs name no effect and were renamed.
type AliasedPlainArgs struct{}

func (AliasedPlainArgs) Kind() string { return "mail.plain_v2" }

func (AliasedPlainArgs) KindAliases() []string { return []string{"mail.plain_v1"} }

// Jobs inserted under a kind alias share the canonical kind's namespace, so one effect
// runs once whatever kind name its jobs were inserted under; ExcludeKinds with the
// canonical kind covers the aliases too.
func TestKindAliasSharesNamespace(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("OneEffect", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, nil)
		mw.Register(AliasedInvoiceArgs{})
		var runs atomic.Int32
		doInner := func(context.Context) error { runs.Add(1); return nil }
		require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice_v1", `{"order_id":9}`), doInner))
		require.NoError(t, mw.Work(b.ctx, jobRow(2, "mail.invoice_v2", `{"order_id":9}`), doInner))
		require.EqualValues(t, 1, runs.Load(), "one effect key, one effect, whatever kind name the job was inserted under")
		out := outs.list()
		require.Len(t, out, 2)
		require.Equal(t, "mail.invoice_v2", out[0].Namespace)
		require.Equal(t, pgidemriver.ActionReplayed, out[1].Action)
		_, err := b.coord.Lookup(b.ctx, "mail.invoice_v2", "order-9.invoice")
		require.NoError(t, err)
	})

	t.Run("JobIDFallback", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, nil)
		mw.Register(AliasedPlainArgs{})
		require.NoError(t, mw.Work(b.ctx, jobRow(3, "mail.plain_v1", `{}`), func(context.Context) error { return nil }))
		require.Equal(t, "mail.plain_v2", outs.list()[0].Namespace)
	})

	t.Run("ExcludeKinds", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, &pgidemriver.Config{ExcludeKinds: []string{"mail.invoice_v2"}})
		mw.Register(AliasedInvoiceArgs{})
		require.NoError(t, mw.Work(b.ctx, jobRow(4, "mail.invoice_v1", `{"order_id":10}`), func(context.Context) error { return nil }))
		require.Equal(t, pgidemriver.ActionSkipped, outs.list()[0].Action)
	})
}

// Every way of failing to find a valid key returns an error and never runs the worker
// unprotected.
func TestNoValidKeyNeverRunsWorker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keyed, _ := b.newMiddleware(t, nil)
	keyed.Register(InvoiceArgs{}, LongNamespaceArgs{})
	badFunc, _ := b.newMiddleware(t, &pgidemriver.Config{
		KeyFunc: func(job *rivertype.JobRow) (string, string, bool) { return "", "bad\x01key", true },
	})
	for _, tc := range []struct {
		name string
		mw   *pgidemriver.Middleware
		job  *rivertype.JobRow
		want error // nil: any error
	}{
		{"ArgsNotJSON", keyed, jobRow(1, "mail.invoice", `not json`), nil},
		{"ArgsWrongType", keyed, jobRow(2, "mail.invoice", `{"order_id":"seven"}`), nil},
		{"ArgsArray", keyed, jobRow(3, "mail.invoice", `[1,2]`), nil},
		{"NulKey", keyed, jobRow(4, "mail.invoice", `{"order_id":1,"nul_key":true}`), pgidem.ErrInvalidKey},
		{"LongNamespace", keyed, jobRow(5, "edge.longns", `{}`), pgidem.ErrInvalidKey},
		{"KeyFuncInvalid", badFunc, jobRow(6, "mail.plain", `{}`), pgidem.ErrInvalidKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ran atomic.Bool
			err := tc.mw.Work(b.ctx, tc.job, func(context.Context) error { ran.Store(true); return nil })
			require.Error(t, err)
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
			}
			require.False(t, ran.Load(), "never run the worker unprotected")
		})
	}
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_record`).Scan(&n))
	require.Zero(t, n)
}

// LongNamespaceArgs choose a namespace above the 64-byte limit.
type LongNamespaceArgs struct{}

func (LongNamespaceArgs) Kind() string { return "edge.longns" }

func (LongNamespaceArgs) IdempotencyKey() string { return "k" }

func (LongNamespaceArgs) IdempotencyNamespace() string { return strings.Repeat("n", 65) }

// TestInvalidKey: an unstorable key fails the job loudly and never runs the worker.
func TestInvalidKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, nil)
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &effectWorker[InvoiceArgs]{pool: b.db.Pool})
	b.startClient(t, riverConfig(t, workers, mw))

	id := b.insert(t, InvoiceArgs{OrderID: 9, NULKey: true}, &river.InsertOpts{MaxAttempts: 1})
	job := b.waitJob(t, id, rivertype.JobStateDiscarded)
	require.Len(t, job.Errors, 1)
	require.Contains(t, job.Errors[0].Error, "invalid idempotency key")
	out := outs.waitFor(t, pgidemriver.ActionError)
	require.ErrorIs(t, out.Err, pgidem.ErrInvalidKey)
	require.Equal(t, pgidem.OutcomeInvalid, out.Outcome)
	require.Equal(t, 0, b.effects(t))
}

// The job-id fallback is counted per execution and logged once per kind, under concurrent
// executions and concurrent Register calls (run with -race).
func TestJobIDFallbackConcurrent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &fallbackLogCounter{}
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{Logger: slog.New(logs)})
	require.NoError(t, err)

	const kinds, perKind = 4, 8
	var wg sync.WaitGroup
	var runs atomic.Int32
	for i := range kinds * perKind {
		wg.Go(func() {
			job := jobRow(int64(i+1), fmt.Sprintf("edge.kind%d", i%kinds), `{}`)
			if err := mw.Work(b.ctx, job, func(context.Context) error { runs.Add(1); return nil }); err != nil {
				t.Error(err)
			}
		})
		wg.Go(func() { mw.Register(PlainArgs{}) })
	}
	wg.Wait()
	require.EqualValues(t, kinds*perKind, runs.Load())
	require.EqualValues(t, kinds*perKind, mw.Stats().JobIDKeys)
	require.EqualValues(t, kinds, logs.warnings.Load(), "logged once per kind")
}

type fallbackLogCounter struct{ warnings atomic.Int64 }

func (h *fallbackLogCounter) Enabled(context.Context, slog.Level) bool { return true }

func (h *fallbackLogCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelWarn && strings.Contains(r.Message, "using the job id") {
		h.warnings.Add(1)
	}
	return nil
}

func (h *fallbackLogCounter) WithAttrs([]slog.Attr) slog.Handler { return h }

func (h *fallbackLogCounter) WithGroup(string) slog.Handler { return h }
