package pgidemriver

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"reflect"
	"strconv"
	"time"

	"github.com/riverqueue/river/rivertype"
)

// KeyArgs is implemented by job args that name the effect their job performs, for example
// "order-9.invoice". Two jobs whose args return the same key (in the same namespace) run
// the effect once. The key is computed from the job's args as decoded from
// [rivertype.JobRow.EncodedArgs] (the middleware runs before River decodes them), so the
// args type must be known to the middleware: register its worker with [AddWorker], or call
// [Middleware.Register]. An empty or otherwise invalid key fails the job with an error
// matching [pgidem.ErrInvalidKey]; the worker is not run.
type KeyArgs interface {
	IdempotencyKey() string
}

// NamespaceArgs may be implemented by job args besides [KeyArgs] to choose the record's
// namespace. Default (or an empty result): the canonical kind of the registered args type
// (its Kind method). That holds also for a job inserted under one of its kind aliases
// (river.JobArgsWithKindAliases), so a kind rename does not split the keys of one effect
// across two namespaces. Jobs of different kinds that perform the same effect return the
// same namespace so their keys collide on purpose. The namespace is limited like any
// pgidem namespace ([pgidem.Config.MaxNamespaceBytes]); an invalid one fails the job with
// an error matching [pgidem.ErrInvalidKey] without running the worker. That includes the
// default. River allows kinds of up to 127 characters (more bytes when not ASCII), pgidem
// namespaces 64 bytes by default. So a longer kind needs this method with [KeyArgs] (it is
// not consulted without it), a [Config.KeyFunc] that names a namespace, or
// [Config.ExcludeKinds]. [Middleware.Register] logs an error for a registered kind that
// would fail.
type NamespaceArgs interface {
	IdempotencyNamespace() string
}

// TTLArgs may be implemented by job args (with a value or a pointer receiver) to override
// [Config.TTL] for their kind. It is called once, when the type is registered, on the
// value given to [Middleware.Register] ([AddWorker] gives the zero value), so it must not
// depend on field values. A result of 0 or less means [Config.TTL].
type TTLArgs interface {
	IdempotencyTTL() time.Duration
}

// KeySource says where the middleware found a job's idempotency key.
type KeySource string

const (
	// KeySourceArgs: the job args implement [KeyArgs].
	KeySourceArgs KeySource = "args"
	// KeySourceFunc: [Config.KeyFunc] returned a key.
	KeySourceFunc KeySource = "key_func"
	// KeySourceJobID: no key was found and the job id was used. It dedupes redeliveries of
	// the same job (a crash before River recorded completion, the stuck-job rescuer running
	// it again), not two jobs enqueued for the same effect. Logged once per kind at warn
	// and counted in [Stats.JobIDKeys]. A job id is unique only within one River job
	// table while its sequence runs on. Clients of different River schemas sharing one
	// pgidem table, or a job table recreated within the TTL, reuse ids. A new job would
	// then replay an old one's record. Give them different namespaces ([Config.KeyFunc])
	// or pgidem schemas.
	KeySourceJobID KeySource = "job_id"
)

// resolve fills out's namespace, key and key source and returns the record TTL.
func (m *Middleware) resolve(ctx context.Context, job *rivertype.JobRow, info *kindInfo, out *Outcome) (time.Duration, error) {
	// The default namespace is the canonical kind, so jobs inserted under a kind alias
	// share their effect keys with jobs of the current kind name.
	kind := job.Kind
	if info != nil {
		kind = info.kind
	}
	ttl := m.config.TTL
	if info != nil && info.ttl > 0 {
		ttl = info.ttl
	}
	if info != nil && info.keyed {
		ptr := reflect.New(info.typ)
		if err := json.Unmarshal(job.EncodedArgs, ptr.Interface()); err != nil {
			return 0, fmt.Errorf("pgidemriver: job %d (%s): decode args as %s to find the idempotency key: %w", job.ID, job.Kind, info.source, err)
		}
		var args any = ptr.Interface()
		if _, ok := args.(KeyArgs); !ok {
			args = ptr.Elem().Interface()
		}
		out.KeySource = KeySourceArgs
		out.Key = args.(KeyArgs).IdempotencyKey()
		out.Namespace = kind
		if ns, ok := args.(NamespaceArgs); ok {
			out.Namespace = cmp.Or(ns.IdempotencyNamespace(), kind)
		}
		return ttl, nil
	}
	if m.config.KeyFunc != nil {
		if ns, key, ok := m.config.KeyFunc(job); ok {
			out.KeySource, out.Namespace, out.Key = KeySourceFunc, cmp.Or(ns, kind), key
			return ttl, nil
		}
	}
	out.KeySource, out.Namespace, out.Key = KeySourceJobID, kind, JobIDKeyPrefix+strconv.FormatInt(job.ID, 10)
	if _, logged := m.fallbackLogged.LoadOrStore(job.Kind, struct{}{}); !logged {
		reason := "its args type is not registered (pgidemriver.AddWorker or Middleware.Register)"
		if info != nil {
			reason = "its args type " + info.source + " does not implement pgidemriver.KeyArgs"
		}
		m.config.Logger.WarnContext(ctx, "pgidemriver: no idempotency key for job kind, using the job id: "+
			"this dedupes redeliveries of one job, not two jobs for the same effect",
			slog.String("job_kind", job.Kind), slog.String("reason", reason))
	}
	return ttl, nil
}
