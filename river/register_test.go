package pgidemriver_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// PtrTTLArgs implement TTLArgs (and KeyArgs) with pointer receivers.
type PtrTTLArgs struct {
	OrderID int64 `json:"order_id"`
}

func (PtrTTLArgs) Kind() string { return "mail.ptr_ttl" }

func (a *PtrTTLArgs) IdempotencyKey() string { return fmt.Sprintf("order-%d.ptr", a.OrderID) }

func (*PtrTTLArgs) IdempotencyTTL() time.Duration { return 60 * 24 * time.Hour }

// A TTLArgs method with a pointer receiver sets the record's TTL, as one with a value
// receiver does (the key method works either way, so the TTL method must too).
func TestTTLArgsPointerReceiver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, _ := b.newMiddleware(t, nil)
	mw.Register(PtrTTLArgs{})
	require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.ptr_ttl", `{"order_id":5}`), func(context.Context) error { return nil }))
	var ttl time.Duration
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT expires_at - completed_at FROM pgidem_record
		WHERE namespace = 'mail.ptr_ttl' AND key = 'order-5.ptr'`).Scan(&ttl))
	require.Equal(t, 60*24*time.Hour, ttl)
}

// RenamedAgainArgs replace AliasedInvoiceArgs' type for kind mail.invoice_v2 with one that
// no longer answers to the old alias and names its effect differently.
type RenamedAgainArgs struct {
	OrderID int64 `json:"order_id"`
}

func (RenamedAgainArgs) Kind() string { return "mail.invoice_v2" }

func (a RenamedAgainArgs) IdempotencyKey() string {
	return fmt.Sprintf("order-%d.invoice-again", a.OrderID)
}

// Registering a kind again replaces the earlier type with its aliases: a job of the old
// alias is no longer decoded as the old type, and CheckTTL reports the kind once.
func TestRegisterAgainDropsOldAliases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, &pgidemriver.Config{TTL: time.Hour})
	mw.Register(AliasedInvoiceArgs{})
	mw.Register(RenamedAgainArgs{})
	require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice_v1", `{"order_id":9}`), func(context.Context) error { return nil }))
	out := outs.list()[0]
	require.Equal(t, pgidemriver.KeySourceJobID, out.KeySource, "the old alias is no longer a registered kind")
	require.Equal(t, "mail.invoice_v1", out.Namespace)

	warnings := mw.CheckTTL(b.ctx, nil)
	var kinds []string
	for _, w := range warnings {
		kinds = append(kinds, w.Kind)
	}
	require.Equal(t, []string{"mail.invoice_v2"}, kinds)
}

// Register says at once when a kind's TTLArgs TTL is one the coordinator refuses, rather
// than leaving every job of the kind to fail; it panics with a clear message on nil args.
func TestRegisterRefusedTTL(t *testing.T) {
	t.Parallel()
	mw, logs, _ := offlineMiddleware(t)
	mw.Register(WeeklyArgs{})
	require.Empty(t, logs.String())
	mw.Register(ShortTTLArgs{})
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "job_kind=report.short")
	require.PanicsWithValue(t, "pgidemriver: Register: nil job args", func() { mw.Register(nil) })
}

// longKind is a kind River accepts but longer than a pgidem namespace (64 bytes).
const longKind = "billing.invoices.monthly_statement_for_enterprise_customers_with_addenda"

type LongKindArgs struct{}

func (LongKindArgs) Kind() string { return longKind }

func (LongKindArgs) IdempotencyKey() string { return "k" }

type LongKindNamedArgs struct{ LongKindArgs }

func (LongKindNamedArgs) Kind() string { return longKind + ".named" }

func (LongKindNamedArgs) IdempotencyNamespace() string { return "billing.statements" }

// A registered kind too long to be its own namespace is logged at error when registered:
// every job of it would fail before its worker runs. Not when the args name their
// namespace.
func TestRegisterKindTooLongForNamespace(t *testing.T) {
	t.Parallel()
	require.Greater(t, len(longKind), pgidem.MaxNamespaceBytesDefault)
	mw, logs, _ := offlineMiddleware(t)
	mw.Register(LongKindNamedArgs{})
	require.Empty(t, logs.String())
	mw.Register(LongKindArgs{})
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "job_kind="+longKind)
}

type LongKindUnkeyedArgs struct{}

func (LongKindUnkeyedArgs) Kind() string { return longKind + ".unkeyed" }

// Args without a key method take their namespace from Config.KeyFunc when it is set, so a
// long kind is no error there.
func TestRegisterLongKindWithKeyFunc(t *testing.T) {
	t.Parallel()
	mw, logs, _ := offlineMiddleware(t, func(cfg *pgidemriver.Config) {
		cfg.KeyFunc = func(job *rivertype.JobRow) (string, string, bool) { return "statements", fmt.Sprint(job.ID), true }
	})
	mw.Register(LongKindUnkeyedArgs{})
	require.Empty(t, logs.String())
	mw.Register(LongKindArgs{}) // keyed: the kind is its namespace whatever KeyFunc says
	require.Contains(t, logs.String(), "level=ERROR")
}
