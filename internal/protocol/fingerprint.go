package protocol

import (
	"bytes"
	"context"
	"log/slog"

	"github.com/pgidem/pgidem/internal/store"
)

// mismatch reports whether a stored fingerprint contradicts the caller's. An expired record
// counts as absent, so its fingerprint does not bind.
func mismatch(fingerprint []byte, r *store.Row) bool {
	return fingerprint != nil && r.Fingerprint != nil && !r.Expired && !bytes.Equal(fingerprint, r.Fingerprint)
}

// checkFingerprint returns a [*FingerprintMismatchError] (logged and reported) when r's
// stored fingerprint contradicts the call's.
func (c *Engine) checkFingerprint(ctx context.Context, cl *Call, r *store.Row) error {
	if !mismatch(cl.fingerprint, r) {
		return nil
	}
	c.config.Logger.WarnContext(ctx, "pgidem: fingerprint mismatch",
		slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("status", string(r.Status)))
	c.emit(ctx, EventFingerprintMismatch, cl.namespace, 1)
	return &FingerprintMismatchError{Namespace: cl.namespace, Key: cl.key, Status: r.Status}
}
