package protocol

import (
	"cmp"
	"context"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"
)

// Call is one validated request.
type Call struct {
	namespace, key string
	ttl, lease     time.Duration
	waitTimeout    time.Duration
	policy         InFlightPolicy
	fingerprint    []byte
	reserveFirst   bool
	// maxAttempts is the attempts cap (0: none): a dead holder's record at it is parked
	// instead of taken over.
	maxAttempts int
	// attempt is the record's attempt count once the call holds its reservation.
	attempt int
	// reconcile, when set, runs before fn for a holder whose record shows an earlier
	// attempt; reconciled is set when it found the effect.
	reconcile  Reconciler
	reconciled bool
	// readInFull is set once a read found the record unfinished (in progress, expired):
	// the call's next reads, a waiter's polls, skip the replay's slim read.
	readInFull bool
	// lost is set when the finishing write found the reservation taken over.
	lost bool
	// notStored is set when fn's value or permanent failure could not be stored.
	notStored bool
	// held is the end of the lease this call holds while fn runs and its record is
	// finished, as the heartbeat knows it; zero before fn runs.
	held leaseClock
}

func (c *Engine) newCall(namespace, key string, ttl time.Duration, opts *Opts) (*Call, error) {
	if opts == nil {
		opts = &Opts{}
	}
	if err := c.validateKey(namespace, key); err != nil {
		return nil, err
	}
	cl := &Call{
		namespace:    namespace,
		key:          key,
		ttl:          ttl,
		lease:        cmp.Or(opts.Lease, c.config.Lease),
		waitTimeout:  cmp.Or(opts.WaitTimeout, c.config.WaitTimeout),
		policy:       cmp.Or(opts.InFlight, c.config.InFlight),
		fingerprint:  opts.Fingerprint,
		reserveFirst: opts.ReserveFirst || c.reserveFirst(namespace),
		reconcile:    opts.Reconcile,
		maxAttempts:  cmp.Or(opts.MaxAttempts, c.config.MaxAttempts),
	}
	if ttl < c.config.MinTTL || cl.lease < LeaseMin || cl.lease >= ttl {
		return nil, &InvalidTTLError{TTL: ttl, MinTTL: c.config.MinTTL, Lease: cl.lease}
	}
	if opts.WaitTimeout < 0 {
		return nil, InvalidArgument("DoOpts.WaitTimeout %s must not be negative", opts.WaitTimeout)
	}
	if opts.MaxAttempts < 0 {
		return nil, InvalidArgument("DoOpts.MaxAttempts %d must not be negative", opts.MaxAttempts)
	}
	if cl.policy != InFlightWait && cl.policy != InFlightRaise {
		return nil, InvalidArgument("DoOpts.InFlight %d is not a known policy", cl.policy)
	}
	return cl, nil
}

// reserveFirst reports whether a call of namespace starts with the reserving insert, as
// the engine's Order says.
func (c *Engine) reserveFirst(namespace string) bool {
	switch c.config.Order {
	case OrderReadFirst:
		return false
	case OrderReserveFirst:
		return true
	}
	return c.orders.reserveFirst(namespace)
}

// validateKey checks a namespace and key against the rules in [ErrInvalidKey].
func (c *Engine) validateKey(namespace, key string) error {
	if err := ValidatePart("namespace", namespace, c.config.MaxNamespaceBytes); err != nil {
		return err
	}
	return ValidatePart("key", key, c.config.MaxKeyBytes)
}

// ValidatePart checks one part of a key (field names it in the error) against the rules of
// ErrInvalidKey.
func ValidatePart(field, s string, maxBytes int) error {
	if s == "" {
		return &InvalidKeyError{Field: field, Reason: "is empty"}
	}
	if len(s) > maxBytes {
		return &InvalidKeyError{Field: field, Reason: fmt.Sprintf("is %d bytes, longer than the limit of %d", len(s), maxBytes)}
	}
	for i, r := range s {
		if r == utf8.RuneError {
			if _, size := utf8.DecodeRuneInString(s[i:]); size <= 1 {
				return &InvalidKeyError{Field: field, Reason: fmt.Sprintf("is not valid UTF-8 at byte %d", i)}
			}
		}
		if unicode.IsControl(r) {
			return &InvalidKeyError{Field: field, Reason: fmt.Sprintf("contains control character %U at byte %d", r, i)}
		}
	}
	return nil
}

type keyContextKey struct{}

// keyInfo is a key a call holds while its fn runs, linked to the key held by the call
// whose fn made that call (nil at the outermost). schema tells the record tables of
// coordinators apart; an inbox entry holds a message (namespace: the consumer, key: the
// message id) rather than a record.
type keyInfo struct {
	schema, namespace, key string
	inbox                  bool
	outer                  *keyInfo
}

func withKey(ctx context.Context, schema, namespace, key string, inbox bool) context.Context {
	outer, _ := ctx.Value(keyContextKey{}).(*keyInfo)
	return context.WithValue(ctx, keyContextKey{}, &keyInfo{schema, namespace, key, inbox, outer})
}

// KeyFromContext returns the namespace and idempotency key of the reservation fn runs
// under; ok is false outside the fn of Do or DoTx (an [Engine.InboxHandle] fn holds
// no record key, unless a Do's fn encloses it). Pass the key downstream as the external API's own
// idempotency key (a payment provider's Idempotency-Key header, say): the provider's dedupe
// is the only crash-safe boundary for a foreign effect, and reusing the same key there makes
// a takeover's second run harmless.
func KeyFromContext(ctx context.Context) (namespace, key string, ok bool) {
	info, _ := ctx.Value(keyContextKey{}).(*keyInfo)
	for ; info != nil; info = info.outer {
		if !info.inbox {
			return info.namespace, info.key, true
		}
	}
	return "", "", false
}

// checkNotHeld refuses a call for (namespace, key) of the schema's records (or, with
// inbox, for the consumer's message) made from within the fn of a call that holds that
// same key. That may be directly or through calls for other keys in between (A's fn calls
// B, whose fn calls A). The inner call would wait for the outer one, which waits for it.
// Or, as DoTx in the same transaction (whose lock is re-entrant), it would find no record
// yet and run fn again and again.
//
// Only coordinators known to use different schemas (both named, and different) are taken
// to hold different records. "" is the search_path's schema, which may be any named one.
// Coordinators on different databases are not told apart. So the guard refuses rather
// than risk a call waiting for itself.
func checkNotHeld(ctx context.Context, op, schema, namespace, key string, inbox bool) error {
	info, _ := ctx.Value(keyContextKey{}).(*keyInfo)
	for ; info != nil; info = info.outer {
		sameSchema := info.schema == schema || info.schema == "" || schema == ""
		if sameSchema && info.namespace == namespace && info.key == key && info.inbox == inbox {
			if inbox {
				return InvalidArgument("%s: consumer %q message %q is handled from within the fn handling it", op, namespace, key)
			}
			return InvalidArgument("%s: %s/%s is called from within the fn of a call holding that key", op, namespace, key)
		}
	}
	return nil
}
