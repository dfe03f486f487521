package pgidemriver

import (
	"log/slog"
	"reflect"
	"time"

	"github.com/riverqueue/river"
)

// kindInfo is what registration learned about a job kind's args type.
type kindInfo struct {
	args   river.JobArgs // zero value, for InsertOpts in CheckTTL
	kind   string        // the canonical kind, args.Kind(): the default namespace
	typ    reflect.Type  // the args type T (decoded into a new *T)
	keyed  bool          // T or *T implements KeyArgs
	ttl    time.Duration // from TTLArgs, 0 when none
	source string        // the Go type name, for messages
}

// AddWorker registers worker on workers like river.AddWorker (and panics in the same
// cases), and registers its args type with m ([Middleware.Register]) so that m can find
// the [KeyArgs] key of its jobs and check its TTL.
func AddWorker[T river.JobArgs](workers *river.Workers, m *Middleware, worker river.Worker[T]) {
	river.AddWorker(workers, worker)
	var zero T
	m.Register(zero)
}

// Register tells m the args types of workers registered with River directly, by example
// values (the zero value is fine): m then decodes jobs of their kinds (and kind aliases)
// to find the [KeyArgs] key and includes them in [Middleware.CheckTTL]. Jobs of a kind
// alias take the canonical kind as their default namespace ([NamespaceArgs]) and are
// excluded when the canonical kind is in [Config.ExcludeKinds]. Registering a kind again
// replaces the earlier type. A [TTLArgs] TTL the coordinator refuses (below
// [pgidem.Config.MinTTL], or not longer than its lease) is logged at error: every job of
// the kind would fail with [pgidem.ErrInvalidTTL] before its worker runs. So is a kind
// longer than [pgidem.Config.MaxNamespaceBytes] that would be its jobs' namespace (keyed
// args without [NamespaceArgs]; args without a key and no [Config.KeyFunc]): the jobs would
// fail with [pgidem.ErrInvalidKey]. Call it before
// the client starts; safe for concurrent use. It panics on a nil args value, as
// river.AddWorker does on a nil worker.
func (m *Middleware) Register(args ...river.JobArgs) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, a := range args {
		if a == nil {
			panic("pgidemriver: Register: nil job args")
		}
		typ := reflect.TypeOf(a)
		info := &kindInfo{args: a, kind: a.Kind(), typ: typ, source: typ.String()}
		_, info.keyed = implementation[KeyArgs](a)
		if t, ok := implementation[TTLArgs](a); ok {
			info.ttl = max(t.IdempotencyTTL(), 0)
			if cc := m.coord.Config(); info.ttl > 0 && (info.ttl < cc.MinTTL || info.ttl <= cc.Lease) {
				m.config.Logger.Error("pgidemriver: IdempotencyTTL is refused by the coordinator; every job of the kind will fail before its worker runs",
					slog.String("job_kind", info.kind), slog.Duration("ttl", info.ttl),
					slog.Duration("min_ttl", cc.MinTTL), slog.Duration("lease", cc.Lease))
			}
		}
		// The kind is the namespace unless keyed args name one (NamespaceArgs is consulted
		// only with KeyArgs), or, for args without a key method, Config.KeyFunc may.
		_, named := implementation[NamespaceArgs](a)
		kindIsNamespace := (info.keyed && !named) || (!info.keyed && m.config.KeyFunc == nil)
		if kindIsNamespace && !m.exclude[info.kind] {
			if limit := m.coord.Config().MaxNamespaceBytes; len(info.kind) > limit {
				m.config.Logger.Error("pgidemriver: job kind is longer than a pgidem namespace may be; every job of the kind will fail before its worker runs "+
					"(implement KeyArgs and NamespaceArgs, set Config.KeyFunc, or exclude the kind)",
					slog.String("job_kind", info.kind), slog.Int("kind_bytes", len(info.kind)), slog.Int("max_namespace_bytes", limit))
			}
		}
		kinds := []string{a.Kind()}
		if aliased, ok := a.(river.JobArgsWithKindAliases); ok { // by value, as River's AddWorker
			kinds = append(kinds, aliased.KindAliases()...)
		}
		for kind, old := range m.kinds { // the earlier type's aliases go with it
			if old.kind == info.kind {
				delete(m.kinds, kind)
			}
		}
		for _, kind := range kinds {
			m.kinds[kind] = info
		}
	}
}

// implementation returns args as an I, one of this package's interfaces (KeyArgs,
// TTLArgs). That is the value itself or, for methods with pointer receivers, a pointer to a
// copy of it. The middleware decodes args into a pointer, so both kinds of receiver work.
func implementation[I any](args river.JobArgs) (I, bool) {
	if v, ok := args.(I); ok {
		return v, true
	}
	ptr := reflect.New(reflect.TypeOf(args))
	ptr.Elem().Set(reflect.ValueOf(args))
	v, ok := ptr.Interface().(I)
	return v, ok
}

func (m *Middleware) kind(kind string) *kindInfo {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.kinds[kind]
}
