package pgidem

import (
	"context"
	"fmt"
	"unicode"
	"unicode/utf8"
)

// validateKey checks a namespace and key against the rules in [ErrInvalidKey].
func (c *Coordinator) validateKey(namespace, key string) error {
	if err := validatePart("namespace", namespace, c.config.MaxNamespaceBytes); err != nil {
		return err
	}
	return validatePart("key", key, c.config.MaxKeyBytes)
}

func validatePart(field, s string, maxBytes int) error {
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
// whose fn made that call (nil at the outermost).
type keyInfo struct {
	namespace, key string
	outer          *keyInfo
}

func withKey(ctx context.Context, namespace, key string) context.Context {
	outer, _ := ctx.Value(keyContextKey{}).(*keyInfo)
	return context.WithValue(ctx, keyContextKey{}, &keyInfo{namespace, key, outer})
}

// KeyFromContext returns the namespace and idempotency key of the reservation fn runs
// under; ok is false outside fn. Pass the key downstream as the external API's own
// idempotency key (a payment provider's Idempotency-Key header, say): the provider's dedupe
// is the only crash-safe boundary for a foreign effect, and reusing the same key there makes
// a takeover's second run harmless.
func KeyFromContext(ctx context.Context) (namespace, key string, ok bool) {
	info, ok := ctx.Value(keyContextKey{}).(*keyInfo)
	if !ok {
		return "", "", false
	}
	return info.namespace, info.key, true
}

// checkNotHeld refuses a call for (namespace, key) made from within the fn of a call that
// holds that same key, directly or through calls for other keys in between (A's fn calls
// B, whose fn calls A): the inner call would wait for the outer one, which waits for it,
// or (DoTx in the same transaction, whose lock is re-entrant) find no record yet and run
// fn again and again.
func checkNotHeld(ctx context.Context, op, namespace, key string) error {
	info, _ := ctx.Value(keyContextKey{}).(*keyInfo)
	for ; info != nil; info = info.outer {
		if info.namespace == namespace && info.key == key {
			return invalidArgument("%s: %s/%s is called from within the fn of a call holding that key", op, namespace, key)
		}
	}
	return nil
}
