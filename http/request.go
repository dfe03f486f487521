package pgidemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strconv"
)

// FingerprintDefault is the default [Config.Fingerprint]: the SHA-256 of the method, the
// escaped path, the raw query and the body. The path and query are those the client sent
// (the request target, r.RequestURI), not r.URL, which a router may have rewritten: two
// endpoints mounted with http.StripPrefix both see "/new" in r.URL.Path. A request with
// no RequestURI (built by a client, not received by a server) uses r.URL. A key reused on
// another endpoint, or with another body, is answered with 422 (the draft, section 2.7). Request headers (Host,
// Content-Type) are not part of it: an API that serves several hosts or representations
// under one principal should include them in its own FingerprintFunc.
func FingerprintDefault(r *http.Request, body []byte) []byte {
	path, query := r.URL.EscapedPath(), r.URL.RawQuery
	if target, err := url.ParseRequestURI(r.RequestURI); err == nil && target.Opaque == "" {
		path, query = target.EscapedPath(), target.RawQuery
	}
	h := sha256.New()
	for _, part := range []string{r.Method, path, query} {
		h.Write([]byte(strconv.Itoa(len(part)) + ":" + part + "\n"))
	}
	h.Write(body)
	return h.Sum(nil)
}

// requestKeyContextKey carries the request's principal and Idempotency-Key to the handler.
type requestKeyContextKey struct{}

// requestKey is what the middleware admitted of a request ([Middleware.admit]): its
// namespace, caller, Idempotency-Key and fingerprint.
type requestKey struct {
	namespace, principal, key string
	fingerprint               []byte
}

// RequestKey returns the principal and the Idempotency-Key of the request whose handler
// runs with ctx under a [Middleware]; ok is false outside one. The key is the client's
// own, as parsed from the field; [pgidem.KeyFromContext] returns the record's key instead
// ([RecordKey], which holds the principal). To pass an idempotency key on to another
// service, derive it from these (say, a hash of both) rather than sending the principal.
func RequestKey(ctx context.Context) (principal, key string, ok bool) {
	rk, ok := ctx.Value(requestKeyContextKey{}).(requestKey)
	return rk.principal, rk.key, ok
}

// ScopedKey returns the key to run the handler's own effects under: like [RecordKey], 22
// characters of digest, a colon and the request's Idempotency-Key, but the digest is of
// the principal and the request's fingerprint ([Config.Fingerprint]) together. Use it
// with [pgidem.DoTx] or [pgidem.DoInTx] for the handler's rows and [pgidem.Do] for a call
// to another service. Give each a namespace of its own, not [Config.Namespace]: the
// middleware holds its record's key while the handler runs, and pgidem refuses a call for
// that key from within. A retry that runs the handler again after its server died then
// replays the effects whose records completed instead of doing them twice.
//   - scoped to the caller, it never gives one caller's effect to another, as the client's
//     bare key could (two callers may send the same one).
//   - scoped to the request, a different request under the key gets other keys and runs
//     its effects afresh, instead of being handed the first request's charge or row. That
//     happens once the middleware's first record was released after a 5xx, or expired.
//
// ok is false when ctx is not a handler's under a Middleware, or the request carries no
// key ([Config.Required] false): then there is nothing to dedupe on.
func ScopedKey(ctx context.Context) (key string, ok bool) {
	rk, ok := ctx.Value(requestKeyContextKey{}).(requestKey)
	if !ok {
		return "", false
	}
	h := sha256.New()
	h.Write([]byte(strconv.Itoa(len(rk.principal)) + ":" + rk.principal))
	h.Write(rk.fingerprint)
	return digestKey(h.Sum(nil), rk.key), true
}

// admit reads what a request's call needs: its Idempotency-Key, its body (put back for
// next), its principal and its fingerprint. ok is false when admit answered the request
// instead. Without a key it passes to next (or is refused when [Config.Required]). An
// invalid key, a body that cannot be read or is too large, or a caller
// [Config.Principal] cannot name is refused with a problem. rk.key is set once the key is
// valid, also when admit refuses the request after that.
func (m *Middleware) admit(w http.ResponseWriter, r *http.Request, next http.Handler) (rk requestKey, ok bool) {
	if rk.key, ok = m.keyOf(w, r, next); !ok {
		return rk, false
	}
	body, ok := m.readBody(w, r)
	if !ok {
		return rk, false
	}
	fingerprinted, ok := m.fingerprinted(w, r, body)
	if !ok {
		return rk, false
	}
	principal, ok := m.principalOf(w, r, body)
	if !ok {
		return rk, false
	}
	rk.namespace, rk.principal, rk.fingerprint = m.config.Namespace, principal, m.config.Fingerprint(r, fingerprinted)
	return rk, true
}

// keyOf returns the request's Idempotency-Key. ok is false when the request has none or
// an invalid one, and keyOf answered it: a request without one passes to next unless
// [Config.Required]; a refused key is counted as the coordinator's refusals are.
func (m *Middleware) keyOf(w http.ResponseWriter, r *http.Request, next http.Handler) (key string, ok bool) {
	fields := r.Header.Values(HeaderKey)
	var err error
	switch {
	case len(fields) == 0 && m.config.Required:
		m.problem(w, http.StatusBadRequest, "idempotency_key_missing", "Idempotency-Key is missing",
			"This request must carry an Idempotency-Key header.", nil)
		return "", false
	case len(fields) == 0:
		next.ServeHTTP(w, r)
		return "", false
	case len(fields) > 1:
		err = errors.New("the request carries more than one Idempotency-Key header")
	default:
		key, err = parseKey(fields[0])
	}
	if err == nil && len(key) > m.maxKey {
		err = fmt.Errorf("the Idempotency-Key is %d bytes, longer than the limit of %d", len(key), m.maxKey)
	}
	if err != nil {
		m.coord.ReportInvalidKey(r.Context(), m.config.Namespace)
		m.problem(w, http.StatusBadRequest, "idempotency_key_invalid", "Idempotency-Key is invalid", capitalize(err.Error())+".", nil)
		return "", false
	}
	return key, true
}

// fingerprinted returns what the request's fingerprint is computed over: its body, or the
// form a handler outside the middleware parsed from it ([parsedForm]). ok is false when
// it answered the request instead: a form file that cannot be read (400), a form over
// [Config.MaxRequestBytes] (413).
func (m *Middleware) fingerprinted(w http.ResponseWriter, r *http.Request, body []byte) ([]byte, bool) {
	form, size, parsed, err := parsedForm(r, body)
	switch {
	case !parsed:
		return body, true
	case err != nil:
		m.problem(w, http.StatusBadRequest, "request_body_unreadable", "Request body unreadable",
			"The request body could not be read.", nil)
		return nil, false
	case size > m.config.MaxRequestBytes:
		m.tooLarge(w, m.config.MaxRequestBytes)
		return nil, false
	}
	return form, true
}

// principalOf returns the caller [Config.Principal] names, and puts body back for next
// whether Principal read it or not. ok is false when Principal failed or named no one: a
// server fault, logged and answered 500.
func (m *Middleware) principalOf(w http.ResponseWriter, r *http.Request, body []byte) (principal string, ok bool) {
	principal, err := m.config.Principal(r)
	r.Body = io.NopCloser(bytes.NewReader(body))
	if err == nil && principal == "" {
		err = errors.New("empty principal")
	}
	if err != nil {
		m.config.Logger.ErrorContext(r.Context(), "pgidemhttp: Config.Principal named no caller; is the middleware behind authentication?",
			slog.String("error", err.Error()))
		m.problem(w, http.StatusInternalServerError, "principal_unknown", "Caller not identified",
			"The caller of this request could not be identified, so its Idempotency-Key has no scope.", nil)
		return "", false
	}
	return principal, true
}

// tooLarge answers 413 for a request over limit bytes.
func (m *Middleware) tooLarge(w http.ResponseWriter, limit int64) {
	m.problem(w, http.StatusRequestEntityTooLarge, "request_too_large", "Request body too large",
		fmt.Sprintf("A request with an Idempotency-Key may carry at most %d bytes.", limit), nil)
}

// readBody reads the request body whole, within Config.MaxRequestBytes, and puts it back
// for the handler. It answers the request and returns false when it cannot.
func (m *Middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	limit := m.config.MaxRequestBytes
	tooLarge := func() ([]byte, bool) {
		m.tooLarge(w, limit)
		return nil, false
	}
	if r.ContentLength > limit {
		return tooLarge()
	}
	if r.Body == nil { // a server request always has one; a direct caller's may not
		r.Body = http.NoBody
	}
	read := limit
	if read < math.MaxInt64 {
		read++ // one byte more tells a body at the limit from a longer one
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, read))
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		limit = min(limit, mbe.Limit)
		return tooLarge()
	}
	if err != nil {
		m.problem(w, http.StatusBadRequest, "request_body_unreadable", "Request body unreadable",
			"The request body could not be read.", nil)
		return nil, false
	}
	if int64(len(body)) > limit {
		return tooLarge()
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	return body, true
}

// parsedForm returns a canonical encoding of the request's form when a handler outside the
// middleware parsed it (Request.ParseForm for a URL-encoded body, ParseMultipartForm),
// which consumed the body. The fingerprint is then computed over the form. Otherwise every
// such request would have the empty body's, and a different request would be replayed
// another's response. The encoding has the form's values, sorted by name, and each file's field
// name, file name, size and SHA-256. size is the form's size in bytes (its values encoded,
// and its files), for [Config.MaxRequestBytes]. parsed is false when the body was not
// consumed (it is not empty, or no form was parsed): the body is then what counts. err is
// a file that could not be read.
func parsedForm(r *http.Request, body []byte) (form []byte, size int64, parsed bool, err error) {
	if len(body) > 0 {
		return nil, 0, false, nil
	}
	var b bytes.Buffer
	switch {
	case r.MultipartForm != nil:
		b.WriteString("multipart\n" + url.Values(r.MultipartForm.Value).Encode())
		size = int64(b.Len())
		for _, name := range slices.Sorted(maps.Keys(r.MultipartForm.File)) {
			for _, fh := range r.MultipartForm.File[name] {
				size += fh.Size
				h := sha256.New()
				f, err := fh.Open()
				if err == nil {
					_, err = io.Copy(h, f)
					f.Close()
				}
				if err != nil {
					return nil, 0, true, err
				}
				fmt.Fprintf(&b, "\n%d:%s %d:%s %d %x", len(name), name, len(fh.Filename), fh.Filename, fh.Size, h.Sum(nil))
			}
		}
	case r.PostForm != nil:
		// ParseForm sets PostForm for every request but reads the body only for a
		// URL-encoded one.
		mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if mediaType != "application/x-www-form-urlencoded" || len(r.PostForm) == 0 {
			return nil, 0, false, nil
		}
		b.WriteString("form\n" + r.PostForm.Encode())
		size = int64(b.Len())
	default:
		return nil, 0, false, nil
	}
	return b.Bytes(), size, true, nil
}

// encode returns the record's JSON for a recorded response. When it would be longer than
// capitalize upper-cases the first letter of an ASCII sentence.
func capitalize(s string) string {
	if s != "" && s[0] >= 'a' && s[0] <= 'z' {
		return string(s[0]-'a'+'A') + s[1:]
	}
	return s
}
