package pgidemhttp

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"mime"
	"net"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/pgidem/pgidem/pgidem"
)

// Header names.
const (
	// HeaderKey is the request header that carries the idempotency key
	// (draft-ietf-httpapi-idempotency-key-header).
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is set to "true" on a response replayed from a record, so a client can
	// tell a replay from a fresh execution. It is not in the draft; Stripe's API uses the
	// same name.
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderBodyOmitted is set to "true" on a replay whose stored response has no body
	// although the first response had one (too long for the record, or cut off on its way
	// to the client), or may have had one (its handler panicked after sending the status,
	// which aborts the response), so a client can tell it from a response that was empty.
	// pgidem's own.
	HeaderBodyOmitted = "Idempotent-Body-Omitted"
)

// Defaults and limits for [Config]. A zero Config field takes the Default.
const (
	// NamespaceDefault is the default [Config.Namespace].
	NamespaceDefault = "http"
	// TTLDefault is the default [Config.TTL]: 24 hours, a common choice of payment APIs
	// (the draft leaves the expiry to the server, section 2.3).
	TTLDefault = 24 * time.Hour
	// MaxRequestBytesDefault is the default [Config.MaxRequestBytes]: 1 MiB.
	MaxRequestBytesDefault = 1 << 20
	// MaxResponseBytesDefault is the default [Config.MaxResponseBytes]: 1 MiB.
	MaxResponseBytesDefault = 1 << 20
	// RetryAfterMaxDefault is the default [Config.RetryAfterMax]: 5 seconds.
	RetryAfterMaxDefault = 5 * time.Second
	// ProblemTypeDefault is the default [Config.ProblemType] (RFC 9457, section 4.2.1).
	ProblemTypeDefault = "about:blank"
)

// PrincipalFunc returns the identity of the caller a request comes from: the
// authenticated user or API client its idempotency keys belong to. A replay re-checks
// nothing the handler checks (roles, ownership, quotas): any request with the principal,
// key and fingerprint of a stored one receives its response. So return the finest
// identity whose authorization can differ — a user, not the tenant or a shared account —
// that stays the same across a client's retries (not a session or token id), with a type
// prefix when ids of several kinds of caller may collide ("user:42", "client:42"). It is
// not authentication: run the middleware behind it, so every request that reaches the
// middleware has a caller. An error, or an empty principal, is therefore a server fault:
// the middleware answers 500 (code "principal_unknown"), logs the error and does not run
// the handler. Any string is a valid principal; records hold a digest of it ([RecordKey]).
// Called from the goroutine of each request, so concurrently.
type PrincipalFunc func(r *http.Request) (string, error)

// FingerprintFunc returns the fingerprint of a request: bytes that are equal for two
// requests exactly when they ask for the same thing. body is the whole request body,
// already read (the handler still reads it from r.Body). r.Body must not be read. When a
// handler outside the middleware parsed the form (Request.ParseForm of a URL-encoded
// body, ParseMultipartForm) and so consumed the body (the middleware read none), body is
// the parsed form instead:
// its values sorted by name, and each file's field name, file name, size and SHA-256. An
// outer handler that reads the body any other way must put it back, or every request
// would have the empty body's fingerprint. Called from the goroutine of each request, so
// concurrently.
type FingerprintFunc func(r *http.Request, body []byte) []byte

// StorePolicyFunc reports whether a response with the given status code is stored in the
// record and replayed to retries. A response that is not stored releases the key, so a
// retry with it runs the handler again. Called from the goroutine of each request, so
// concurrently.
type StorePolicyFunc func(status int) bool

// StoreDefault is the default [Config.Store]: every status is stored except 5xx (a server
// error says nothing final about the request); 408 Request Timeout, 425 Too Early and 429
// Too Many Requests (the request was not processed); and 401, 403 and 407 (the caller's
// credentials were refused: a client that authenticates again, or steps up, resends the
// request under the same key and must be judged anew). A retry of those runs the handler
// again. This is pgidem's policy, not the draft's: its section 2.6 has a retry return the
// first result, "success or an error"; give Store a function that returns true to do so.
func StoreDefault(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusProxyAuthRequired,
		http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

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

// Config configures a [Middleware]. Only Principal is required.
type Config struct {
	// Principal returns the caller a request's key belongs to; keys are scoped to it, so
	// one caller can never receive another's replayed response by sending the same key.
	// Put the middleware behind authentication and return the authenticated identity
	// ([PrincipalFunc]: the finest one whose authorization can differ). Required; a
	// service with a single trusted client may return a constant.
	Principal PrincipalFunc

	// Namespace is the record namespace of every request (see [RecordKey] for the key).
	// Give two APIs on one database different namespaces if their callers' keys must not
	// meet. Default [NamespaceDefault] ("http"). [New] refuses one that is not UTF-8, holds
	// a control character or is longer than the coordinator's
	// [pgidem.Config.MaxNamespaceBytes].
	Namespace string

	// TTL is how long a response is replayed after it was stored; a retry after that runs
	// the handler again. At least the coordinator's [pgidem.Config.MinTTL]. Default
	// [TTLDefault] (24 h).
	TTL time.Duration

	// Required makes the key mandatory for the methods in Methods: a request without an
	// Idempotency-Key field is answered 400 (the draft, section 2.7) and the handler is
	// not run. Default false: such a request passes to the handler unprotected.
	Required bool

	// Methods are the request methods the middleware applies to, in upper case, and it
	// applies to them in any case a client sends ("post" too: methods are case-sensitive,
	// RFC 9110, section 9.1, but a handler that does not check the method would run it
	// as a POST); the fingerprint keeps the method as sent. Other requests pass to the
	// handler untouched, with or without a key. Default POST and PATCH, the
	// non-idempotent methods the draft is for (GET, PUT and DELETE are idempotent by
	// definition, RFC 9110 section 9.2.2), when nil; [New] refuses an empty non-nil list and
	// a method not in upper case.
	Methods []string

	// MaxRequestBytes bounds the request body, in bytes, which the middleware reads whole
	// to fingerprint it before the handler runs. A longer body is answered 413 and the
	// handler is not run; so is a form a handler outside the middleware parsed (consuming
	// the body) whose values and files add up to more. Default [MaxRequestBytesDefault] (1 MiB); [New] refuses a
	// negative one.
	MaxRequestBytes int64

	// MaxResponseBytes bounds the response body stored for replay, in bytes. A longer
	// response is sent to the client as usual and stored without its body: a replay then
	// sends the status with an empty body and only the Location and Link headers. The same
	// happens when the record's JSON would be longer than the coordinator's
	// [pgidem.Config.MaxValueBytes] (16 MiB by default): a body is stored as JSON text when
	// it is UTF-8 (where a control or HTML character takes a six-byte escape), else as
	// base64 (4/3 of its size). Default [MaxResponseBytesDefault] (1 MiB); [New] refuses a
	// negative one.
	MaxResponseBytes int

	// ReplayHeaders are the response headers stored and replayed (an allowlist: the draft
	// says nothing of response headers, and most must not outlive their response); other
	// headers (Set-Cookie, Date, tracing headers) are neither stored
	// nor replayed, nor are trailers. A value that is not UTF-8 or holds a NUL cannot be
	// stored in the record's JSON and is left out. Default: Cache-Control,
	// Content-Encoding, Content-Language, Content-Location, Content-Type, ETag, Expires,
	// Last-Modified, Link, Location, Retry-After, Vary, Allow, when nil; an empty non-nil
	// list stores no header.
	ReplayHeaders []string

	// Store decides which responses are stored and replayed. Default [StoreDefault]
	// (everything but 5xx, 401, 403, 407, 408, 425 and 429). Stored bodies sit in the
	// record as plain JSON for the TTL, readable with SQL and the pgidem CLI: a route whose
	// responses hold a secret shown once can keep them out with a Store of its own. A
	// handler that panics (with [http.ErrAbortHandler] too) before it sent a status is
	// never stored; one that panics after it did is stored by that status, without its
	// body (the status may have reached the client, and the effect may have happened: a
	// [httputil.ReverseProxy] panics so when copying the upstream's body fails), and
	// logged at error with its stack unless the panic is [http.ErrAbortHandler]. One
	// that returns without writing has answered 200, which is stored.
	Store StorePolicyFunc

	// Fingerprint computes a request's fingerprint, stored with the record and compared
	// on every retry: a different fingerprint is answered 422 and the handler is not
	// run. A nil fingerprint turns the check off for that request. Default
	// [FingerprintDefault] (method, path, query and body).
	Fingerprint FingerprintFunc

	// InFlight is what a retry does while the first request with its key is still being
	// handled:
	//   - [pgidem.InFlightRaise] (the default, also for [pgidem.InFlightDefault]): answer
	//     409 Conflict at once with Retry-After (the draft's section 2.6 asks for a
	//     resource conflict error for a concurrent request, section 2.7 for a 409);
	//   - [pgidem.InFlightWait]: hold the retry up to WaitTimeout (mind the server's
	//     WriteTimeout) until the first request finishes, and replay its response; when
	//     the first request's response is not stored (a 5xx, a panic), one waiter takes
	//     the key and runs the handler itself, and the others replay that. After the wait,
	//     409. This departs from the draft for clients that prefer an answer to a conflict.
	InFlight pgidem.InFlightPolicy

	// WaitTimeout bounds the wait under [pgidem.InFlightWait]. Default: the
	// coordinator's [pgidem.Config.WaitTimeout] (1 minute unless set there); not negative.
	WaitTimeout time.Duration

	// RetryAfterMax bounds the Retry-After of a 409 answered while the first request is
	// in progress. The hint is the time until the first request's lease ends (when a retry
	// could take over if its server died), at least 1 s, at most this: a live server
	// renews the lease, so the lease says nothing about when the request will finish, and
	// a client that waits 30 s for a request that takes 200 ms waits for nothing (the River
	// middleware bounds its snooze for the same reason). Retry-After counts whole seconds
	// (RFC 9110, 10.2.3): a fraction of a second here is dropped. At least 1 s. Default
	// [RetryAfterMaxDefault] (5 s).
	RetryAfterMax time.Duration

	// ProblemType is the "type" member of the problem details (RFC 9457) the middleware
	// answers errors with: a URI that documents them for your API's clients. Default
	// [ProblemTypeDefault] ("about:blank", with each response's title its status text).
	ProblemType string

	// CancelWithClient cancels next's context when the request's context is cancelled (the
	// client goes away), as net/http does. Default false: once next starts it runs to the
	// end whatever the client does, because under an Idempotency-Key the client's retry is
	// what reads the outcome (a replay, or a wait for the run in progress), and a handler
	// cut off half-way would answer an error status that releases the key, so the retry
	// ran the effect again. The request's cancellation still ends the reservation, a wait,
	// and a call whose next has not started (which then does not start). Only the request
	// context's deadline (an outer handler's) still ends next's; any other cancellation
	// does not, a server BaseContext cancelled at shutdown included (http.Server.Shutdown
	// waits for handlers without cancelling them). next's context is cancelled with cause
	// [pgidem.ErrLeaseLost] either way.
	CancelWithClient bool

	// Logger receives the middleware's warnings and errors (a record the handler's
	// response could not be stored in, an unexpected error). Default: the coordinator's
	// [pgidem.Config.Logger].
	Logger *slog.Logger
}

// defaultReplayHeaders is the default Config.ReplayHeaders.
func defaultReplayHeaders() []string {
	return []string{"Cache-Control", "Content-Encoding", "Content-Language", "Content-Location",
		"Content-Type", "ETag", "Expires", "Last-Modified", "Link", "Location", "Retry-After", "Vary", "Allow"}
}

// Middleware makes POST and PATCH handlers idempotent under the Idempotency-Key request
// header (draft-ietf-httpapi-idempotency-key-header), with records in Postgres kept by a
// [pgidem.Coordinator]. Create it with [New] and wrap handlers with [Middleware.Handler].
// It is safe for concurrent use.
type Middleware struct {
	coord   *pgidem.Coordinator
	config  Config
	methods map[string]bool
	replay  []string // canonical header names
	maxKey  int      // the longest Idempotency-Key, in bytes: what RecordKey leaves of the coordinator's MaxKeyBytes
}

// New returns a middleware that keeps its records through coord. config must set
// Principal; other zero fields take their defaults. It returns an error matching
// [pgidem.ErrInvalidArgument] that names the field when a setting is invalid. It does not
// touch the database.
func New(coord *pgidem.Coordinator, config *Config) (*Middleware, error) {
	if coord == nil {
		return nil, invalid("New: coord is nil")
	}
	var cfg Config
	if config != nil {
		cfg = *config
	}
	cfg.Namespace = cmp.Or(cfg.Namespace, NamespaceDefault)
	cfg.TTL = cmp.Or(cfg.TTL, TTLDefault)
	cfg.MaxRequestBytes = cmp.Or(cfg.MaxRequestBytes, MaxRequestBytesDefault)
	cfg.MaxResponseBytes = cmp.Or(cfg.MaxResponseBytes, MaxResponseBytesDefault)
	cfg.InFlight = cmp.Or(cfg.InFlight, pgidem.InFlightRaise)
	cfg.WaitTimeout = cmp.Or(cfg.WaitTimeout, coord.Config().WaitTimeout)
	cfg.ProblemType = cmp.Or(cfg.ProblemType, ProblemTypeDefault)
	cfg.RetryAfterMax = cmp.Or(cfg.RetryAfterMax, RetryAfterMaxDefault)
	if cfg.Methods == nil {
		cfg.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if cfg.ReplayHeaders == nil {
		cfg.ReplayHeaders = defaultReplayHeaders()
	}
	if cfg.Store == nil {
		cfg.Store = StoreDefault
	}
	if cfg.Fingerprint == nil {
		cfg.Fingerprint = FingerprintDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = coord.Config().Logger
	}
	ccfg := coord.Config()
	switch {
	case cfg.Principal == nil:
		return nil, invalid("Config.Principal is required: keys are scoped to the caller")
	case cfg.TTL < ccfg.MinTTL:
		return nil, invalid("Config.TTL %s is below the coordinator's MinTTL %s", cfg.TTL, ccfg.MinTTL)
	case cfg.InFlight != pgidem.InFlightRaise && cfg.InFlight != pgidem.InFlightWait:
		return nil, invalid("Config.InFlight %d is not a known policy", cfg.InFlight)
	case cfg.WaitTimeout < 0:
		return nil, invalid("Config.WaitTimeout %s must not be negative", cfg.WaitTimeout)
	case cfg.RetryAfterMax < time.Second:
		return nil, invalid("Config.RetryAfterMax %s is below one second, the unit of Retry-After", cfg.RetryAfterMax)
	case cfg.MaxRequestBytes < 0:
		return nil, invalid("Config.MaxRequestBytes %d must not be negative", cfg.MaxRequestBytes)
	case cfg.MaxResponseBytes < 0:
		return nil, invalid("Config.MaxResponseBytes %d must not be negative", cfg.MaxResponseBytes)
	case len(cfg.Methods) == 0:
		return nil, invalid("Config.Methods is empty: the middleware would apply to no request")
	}
	for _, method := range cfg.Methods {
		// Methods are case-sensitive (RFC 9110, 9.1): "post" would never match a POST.
		if !isToken(method) || strings.ToUpper(method) != method {
			return nil, invalid("Config.Methods holds %q; give methods as clients send them, in upper case (POST, PATCH)", method)
		}
	}
	if ccfg.MaxKeyBytes <= recordKeyPrefixLen {
		return nil, invalid("the coordinator's MaxKeyBytes %d leaves no room for a key after the principal's %d bytes", ccfg.MaxKeyBytes, recordKeyPrefixLen)
	}
	if len(cfg.Namespace) > ccfg.MaxNamespaceBytes || !utf8.ValidString(cfg.Namespace) || strings.IndexFunc(cfg.Namespace, unicode.IsControl) >= 0 {
		return nil, invalid("Config.Namespace %q must be valid UTF-8 without control characters, at most the coordinator's MaxNamespaceBytes (%d)", cfg.Namespace, ccfg.MaxNamespaceBytes)
	}
	cfg.Methods, cfg.ReplayHeaders = slices.Clone(cfg.Methods), slices.Clone(cfg.ReplayHeaders)
	m := &Middleware{coord: coord, config: cfg, methods: make(map[string]bool, len(cfg.Methods)), maxKey: ccfg.MaxKeyBytes - recordKeyPrefixLen}
	for _, method := range cfg.Methods {
		m.methods[method] = true
	}
	for _, h := range cfg.ReplayHeaders {
		m.replay = append(m.replay, http.CanonicalHeaderKey(h))
	}
	slices.Sort(m.replay)
	m.replay = slices.Compact(m.replay)
	return m, nil
}

// invalid returns a configuration error matching pgidem.ErrInvalidArgument.
func invalid(format string, args ...any) error {
	return fmt.Errorf("pgidemhttp: %s: %w", fmt.Sprintf(format, args...), pgidem.ErrInvalidArgument)
}

// Config returns a copy of the middleware's configuration with defaults filled in.
func (m *Middleware) Config() Config {
	cfg := m.config
	cfg.Methods, cfg.ReplayHeaders = slices.Clone(cfg.Methods), slices.Clone(cfg.ReplayHeaders)
	return cfg
}

// isToken reports whether s is an HTTP token (RFC 9110, 5.6.2), as a method is.
func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return s != ""
}

// storedResponse is the record's result: what a replay sends.
type storedResponse struct {
	Status int         `json:"status"`
	Header http.Header `json:"header,omitempty"`
	// Text is the body when it is UTF-8 text without NUL (readable in the record), Body otherwise
	// (base64 in the record's JSON).
	Text string `json:"text,omitempty"`
	Body []byte `json:"body,omitempty"`
	// BodyOmitted is true when the body was not stored: longer than
	// Config.MaxResponseBytes, the record's JSON with it longer than the coordinator's
	// MaxValueBytes, or cut off on its way to the client.
	BodyOmitted bool `json:"body_omitted,omitempty"`
	// HeaderOmitted is true when even the headers made the record too long: the status
	// alone is replayed.
	HeaderOmitted bool `json:"header_omitted,omitempty"`
}

// errNotStored releases the key: the handler's response is not to be replayed.
var errNotStored = errors.New("pgidemhttp: response not stored")

// requestKeyContextKey carries the request's principal and Idempotency-Key to the handler.
type requestKeyContextKey struct{}

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
// to another service, each in a namespace of its own (not [Config.Namespace]: the
// middleware holds its record's key while the handler runs, and pgidem refuses a call for
// that key from within), so a retry that runs the handler again after its server died
// replays the effects whose records completed instead of doing them twice:
//   - scoped to the caller, it never gives one caller's effect to another, as the client's
//     bare key could (two callers may send the same one);
//   - scoped to the request, a different request under the key (once the middleware's
//     first record was released after a 5xx, or expired) gets other keys and runs its effects
//     afresh, instead of being handed the first request's charge or row.
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

// Handler wraps next. For a request whose method is in [Config.Methods] and that carries
// an Idempotency-Key field:
//   - the first request with a key runs next; its response streams to the client as usual
//     and, when [Config.Store] accepts its status, is stored (status, body, the headers in
//     [Config.ReplayHeaders]) for [Config.TTL]. A handler that returns without writing
//     answers 200 (net/http's rule), and that is stored too: a handler that gives up
//     without an answer to replay should write an error status, or panic with
//     [http.ErrAbortHandler] before it writes anything;
//   - a retry with the key and the same fingerprint gets the stored response, marked
//     Idempotent-Replayed: true, and next does not run;
//   - a retry with a different fingerprint (another body, path, query or method): 422;
//   - a retry while the first is still running: 409 with Retry-After in seconds (or a
//     wait, [Config.InFlight]);
//   - a response not stored (by default 5xx, 401, 403, 407, 408, 425 and 429; a panic
//     before any status, a hijacked connection, 101 Switching Protocols) releases the
//     key: a retry runs next again. A panic after a status is stored by that status,
//     without its body ([Config.Store]), and goes on.
//
// A response is stored as next wrote it: the status, the body (within
// [Config.MaxResponseBytes]) and the headers in [Config.ReplayHeaders] as they were when
// the status was sent; not trailers. The body is what next wrote, whether or not it
// reached the client; but when a write of it failed (the client went away, a write
// timeout), it is left out unless next declared a Content-Length that it matches, and
// when next wrote less than it declared it is left out too: a replay never passes part of
// a body off as all of it (next may have stopped at the failed write). Bytes beyond a
// declared Content-Length, which net/http refuses, are not part of it. It is also left out, and then the headers, when the record's JSON would be too long
// for the coordinator ([pgidem.Config.MaxValueBytes]). A replay without the body it had
// carries Idempotent-Body-Omitted: true ([HeaderBodyOmitted]).
//
// Do not use [http.TimeoutHandler] with the middleware. Outside it, it may discard a
// response the record keeps. Inside it, around next, it answers 503 while next is still
// running; the 503 is not stored, the key is released, and a retry runs next beside the
// first run. Bound a request with the server's timeouts (a write that fails then leaves the
// body out unless next declared a Content-Length it matches, and next runs once) or with a
// deadline next observes before it answers. A
// handler whose effects are keyed with [ScopedKey] stays safe either way: a second run
// waits for the first run's effects and replays them.
//
// Requests the middleware refuses never reach next and are answered with problem details
// (RFC 9457, Content-Type application/problem+json; [Problem]): a missing key when
// [Config.Required] (400), an invalid key or one longer than the coordinator's
// [pgidem.Config.MaxKeyBytes] less 23 bytes (400, and counted as the coordinator's own
// refusals are: [pgidem.EventInvalidKey] under [Config.Namespace]), a body over [Config.MaxRequestBytes]
// (413), a caller [Config.Principal] cannot name (500), or a store that cannot be reached
// (503: the request is not run unprotected, unless the coordinator opted into
// [pgidem.Config.FailOpen]). The body is read before Principal is called; Principal and
// next may both read it, from memory. next runs with a context that carries the key
// ([RequestKey], [ScopedKey]; [pgidem.KeyFromContext] gives the record's), that the
// client going away does not cancel (unless [Config.CancelWithClient]: the client's retry
// reads the outcome, so next finishes its work; a deadline an outer handler set on the
// request still applies, and a reservation or a wait before next runs still ends with
// the client), and that is cancelled with cause [pgidem.ErrLeaseLost] when the record's
// lease cannot be kept (the store is unreachable, or another request took
// the key over). When next returns without writing and its response could not be stored,
// the middleware answers for it: 409 with Retry-After when the key was taken over, else
// 503 (code "outcome_unknown"). Under another Middleware (one wrapping another), a
// request whose record the outer one already holds (same namespace and record key) passes
// to next; otherwise the inner one keeps a record of its own, by its own settings. An
// outer middleware with a coarser principal replays by that principal before the inner one
// is reached, so give the outermost the finest.
//
// The response writer given to next supports [http.ResponseController] and the
// interfaces it unwraps to (Flush, Hijack, deadlines) as far as the server's writer does;
// it always has a Hijack method, which returns an error matching [http.ErrNotSupported]
// when the server's writer cannot hijack (HTTP/2). Safe for concurrent use.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Without regard to case: methods are case-sensitive (RFC 9110, section 9.1), so
		// "post" is not POST, but a handler that does not check the method would run it as
		// one, unprotected and past Required.
		if !m.methods[r.Method] && !m.methods[strings.ToUpper(r.Method)] {
			next.ServeHTTP(w, r)
			return
		}
		m.serve(w, r, next)
	})
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	fields := r.Header.Values(HeaderKey)
	switch {
	case len(fields) == 0 && m.config.Required:
		m.problem(w, http.StatusBadRequest, "idempotency_key_missing", "Idempotency-Key is missing",
			"This request must carry an Idempotency-Key header.", nil)
		return
	case len(fields) == 0:
		next.ServeHTTP(w, r)
		return
	case len(fields) > 1:
		m.coord.ReportInvalidKey(r.Context(), m.config.Namespace)
		m.problem(w, http.StatusBadRequest, "idempotency_key_invalid", "Idempotency-Key is invalid",
			"The request carries more than one Idempotency-Key header.", nil)
		return
	}
	key, err := parseKey(fields[0])
	if err == nil && len(key) > m.maxKey {
		err = fmt.Errorf("the Idempotency-Key is %d bytes, longer than the limit of %d", len(key), m.maxKey)
	}
	if err != nil {
		m.coord.ReportInvalidKey(r.Context(), m.config.Namespace)
		m.problem(w, http.StatusBadRequest, "idempotency_key_invalid", "Idempotency-Key is invalid", capitalize(err.Error())+".", nil)
		return
	}
	body, ok := m.readBody(w, r)
	if !ok {
		return
	}
	fingerprinted := body
	if form, size, parsed, err := parsedForm(r, body); parsed {
		switch {
		case err != nil:
			m.problem(w, http.StatusBadRequest, "request_body_unreadable", "Request body unreadable",
				"The request body could not be read.", nil)
			return
		case size > m.config.MaxRequestBytes:
			m.problem(w, http.StatusRequestEntityTooLarge, "request_too_large", "Request body too large",
				fmt.Sprintf("A request with an Idempotency-Key may carry at most %d bytes.", m.config.MaxRequestBytes), nil)
			return
		}
		fingerprinted = form
	}
	principal, err := m.config.Principal(r)
	r.Body = io.NopCloser(bytes.NewReader(body)) // again, whether Principal read it or not
	if err != nil || principal == "" {
		if err == nil {
			err = errors.New("empty principal")
		}
		m.config.Logger.ErrorContext(r.Context(), "pgidemhttp: Config.Principal named no caller; is the middleware behind authentication?",
			slog.String("error", err.Error()))
		m.problem(w, http.StatusInternalServerError, "principal_unknown", "Caller not identified",
			"The caller of this request could not be identified, so its Idempotency-Key has no scope.", nil)
		return
	}
	opts := &pgidem.DoOpts{
		Fingerprint: m.config.Fingerprint(r, fingerprinted),
		InFlight:    m.config.InFlight,
		WaitTimeout: m.config.WaitTimeout,
		// Most requests name a new key (a retry is the exception): the reserving insert
		// saves the read a call would start with (docs/performance.md).
		ReserveFirst: true,
	}
	recordKey := RecordKey(principal, key)
	if rk, nested := r.Context().Value(requestKeyContextKey{}).(requestKey); nested && rk.namespace == m.config.Namespace && RecordKey(rk.principal, rk.key) == recordKey {
		next.ServeHTTP(w, r) // an outer middleware holds this very record
		return
	}
	outer := w.Header().Clone() // what outer handlers set: kept if the middleware answers after next
	ctx := context.WithValue(r.Context(), requestKeyContextKey{}, requestKey{namespace: m.config.Namespace, principal: principal, key: key, fingerprint: opts.Fingerprint})

	ctx, start, stop := m.callContext(ctx)
	defer stop()
	var rec *recorder
	var panicked any // next's panic after it sent a status, raised again once it is stored
	res, err := pgidem.DoResult(ctx, m.coord, m.config.Namespace, recordKey, m.config.TTL, opts,
		func(ctx context.Context) (v json.RawMessage, err error) {
			if !start() {
				return nil, errNotStored // the client went away as next was about to start
			}
			rec = &recorder{ResponseWriter: w, max: m.config.MaxResponseBytes, replay: m.replay}
			returned := false
			defer func() {
				if returned || !rec.wrote || rec.hijacked || rec.switched {
					return // a panic before any status: it goes on, and the key is released
				}
				panicked = recover()
				if panicked != http.ErrAbortHandler {
					// It is raised again from here, so net/http's log would show this
					// stack, not next's.
					m.config.Logger.ErrorContext(ctx, "pgidemhttp: the handler panicked after it sent its status; the response is stored without its body",
						slog.String("namespace", m.config.Namespace), slog.String("key", recordKey),
						slog.Any("panic", panicked), slog.String("stack", string(debug.Stack())))
				}
				rec.omitBody()
				v, err = m.storedAfterPanic(ctx, rec, recordKey)
			}()
			next.ServeHTTP(rec, r.WithContext(ctx))
			returned = true
			if rec.hijacked || rec.switched {
				return nil, errNotStored
			}
			return m.stored(ctx, rec, recordKey)
		})
	if panicked != nil {
		panic(panicked) // as net/http expects: it aborts the response
	}
	if rec != nil {
		// next ran: the client has its response, unless next wrote nothing.
		if err == nil || errors.Is(err, errNotStored) {
			return
		}
		m.config.Logger.ErrorContext(ctx, "pgidemhttp: the handler ran but its response was not stored; a retry with its key may run the handler again",
			slog.String("namespace", m.config.Namespace), slog.String("key", recordKey), slog.String("error", err.Error()))
		if rec.wrote || rec.hijacked || rec.switched || r.Context().Err() != nil {
			return
		}
		// What next set describes no answer; the problem replaces it. Outer handlers'
		// headers (CORS, a request id) stay.
		h := w.Header()
		clear(h)
		maps.Copy(h, outer)
		if errors.Is(err, pgidem.ErrLeaseLost) {
			m.problem(w, http.StatusConflict, "idempotency_key_in_progress", "Idempotency-Key taken over",
				"Another request with this Idempotency-Key took it over while this one ran; retry to get its outcome.",
				http.Header{"Retry-After": {"1"}})
			return
		}
		m.problem(w, http.StatusServiceUnavailable, "outcome_unknown", "Outcome not recorded",
			"The request was processed, but its outcome could not be recorded; a retry may process it again.", http.Header{"Retry-After": {"1"}})
		return
	}
	switch {
	case err == nil:
		m.writeReplay(w, res.Value)
	case errors.Is(err, pgidem.ErrFingerprintMismatch):
		m.problem(w, http.StatusUnprocessableEntity, "idempotency_key_reused", "Idempotency-Key is already used",
			"This Idempotency-Key was used for a different request (another method, path, query or body).", nil)
	case errors.Is(err, pgidem.ErrInProgress):
		retry := time.Second
		if ipe := (*pgidem.InProgressError)(nil); errors.As(err, &ipe) {
			retry = min(max(ipe.RetryAfter, time.Second), m.config.RetryAfterMax.Truncate(time.Second))
		}
		m.problem(w, http.StatusConflict, "idempotency_key_in_progress", "A request with this Idempotency-Key is in progress",
			"A request with this Idempotency-Key is still being processed; retry later.",
			http.Header{"Retry-After": {strconv.FormatInt(int64(math.Ceil(retry.Seconds())), 10)}})
	case r.Context().Err() != nil:
		// The client went away before anything ran; nobody reads an answer.
		w.WriteHeader(http.StatusServiceUnavailable)
	case errors.Is(err, pgidem.ErrStoreUnavailable):
		m.problem(w, http.StatusServiceUnavailable, "store_unavailable", "Idempotency store unavailable",
			"The request was not processed because its Idempotency-Key could not be reserved; retry later.",
			http.Header{"Retry-After": {"1"}})
	case errors.Is(err, pgidem.ErrResultNotStorable):
		m.problem(w, http.StatusInternalServerError, "response_not_stored", "Response not stored",
			"A request with this Idempotency-Key was processed, but its response could not be stored for replay.", nil)
	default:
		m.config.Logger.ErrorContext(ctx, "pgidemhttp: unexpected error", slog.String("error", err.Error()))
		m.problem(w, http.StatusInternalServerError, "internal_error", "Internal error",
			"The request's Idempotency-Key could not be handled.", nil)
	}
}

// storedAfterPanic is stored for a handler that panicked; a panic of its own (in
// Config.Store) is logged, and the response is not stored: the handler's panic goes on.
func (m *Middleware) storedAfterPanic(ctx context.Context, rec *recorder, recordKey string) (v json.RawMessage, err error) {
	defer func() {
		if p := recover(); p != nil {
			m.config.Logger.ErrorContext(ctx, "pgidemhttp: storing the response of a handler that panicked panicked too",
				slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
			v, err = nil, errNotStored
		}
	}()
	return m.stored(ctx, rec, recordKey)
}

// stored returns the record's value for rec's response once next is done, or errNotStored
// when [Config.Store] refuses its status.
func (m *Middleware) stored(ctx context.Context, rec *recorder, recordKey string) (json.RawMessage, error) {
	rec.finish()
	if !m.config.Store(rec.stored.Status) {
		return nil, errNotStored
	}
	return m.encode(ctx, rec, recordKey), nil
}

// callContext returns the context the call runs with, from the request's (ctx): unless
// [Config.CancelWithClient], the request's cancellation cancels it only until start is
// called (when next is about to start), so a reservation or a wait still ends with the
// client but next runs to the end. start reports false when the cancellation came first:
// next must not start. The request's deadline (an outer handler's) still applies, and the
// values stay. stop releases it.
func (m *Middleware) callContext(ctx context.Context) (call context.Context, start func() bool, stop func()) {
	if m.config.CancelWithClient {
		return ctx, func() bool { return true }, func() {}
	}
	call, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	stopDeadline := context.CancelFunc(func() {})
	if deadline, ok := ctx.Deadline(); ok {
		call, stopDeadline = context.WithDeadline(call, deadline)
	}
	var mu sync.Mutex
	running := false
	stopAfter := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if !running {
			cancel(context.Cause(ctx))
		}
	})
	start = func() bool {
		mu.Lock()
		defer mu.Unlock()
		running = true
		return call.Err() == nil
	}
	return call, start, func() { stopAfter(); stopDeadline(); cancel(nil) }
}

// readBody reads the request body whole, within Config.MaxRequestBytes, and puts it back
// for the handler. It answers the request and returns false when it cannot.
func (m *Middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	limit := m.config.MaxRequestBytes
	tooLarge := func() ([]byte, bool) {
		m.problem(w, http.StatusRequestEntityTooLarge, "request_too_large", "Request body too large",
			fmt.Sprintf("A request with an Idempotency-Key may carry at most %d bytes.", limit), nil)
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
// which consumed the body: the fingerprint is then computed over the form, or every such
// request would have the empty body's and a different request would be replayed another's
// response. The encoding has the form's values, sorted by name, and each file's field
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
// the coordinator's MaxValueBytes (encoding/json writes some characters as six-byte
// escapes), the body is left out, and then the headers: next has run, so its status is
// always stored (an error here would release the key and run next again).
func (m *Middleware) encode(ctx context.Context, rec *recorder, recordKey string) json.RawMessage {
	limit := m.coord.Config().MaxValueBytes
	b, err := json.Marshal(rec.stored)
	if err == nil && len(b) <= limit {
		return b
	}
	m.config.Logger.WarnContext(ctx, "pgidemhttp: response too long for its record; stored without its body or headers",
		slog.String("namespace", m.config.Namespace), slog.String("key", recordKey), slog.Int("json_bytes", len(b)))
	if !rec.stored.BodyOmitted {
		rec.omitBody()
		if b, err = json.Marshal(rec.stored); err == nil && len(b) <= limit {
			return b
		}
	}
	b, _ = json.Marshal(storedResponse{Status: rec.stored.Status, BodyOmitted: true, HeaderOmitted: true})
	return b
}

// writeReplay sends a stored response.
func (m *Middleware) writeReplay(w http.ResponseWriter, raw json.RawMessage) {
	var s storedResponse
	if err := json.Unmarshal(raw, &s); err != nil || s.Status < 200 || s.Status > 999 {
		m.problem(w, http.StatusInternalServerError, "response_not_stored", "Response not stored",
			"A request with this Idempotency-Key was processed, but its stored response cannot be read.", nil)
		return
	}
	h := w.Header()
	for name, values := range s.Header {
		h[name] = values
	}
	h.Set(HeaderReplayed, "true")
	if s.BodyOmitted {
		h.Set(HeaderBodyOmitted, "true")
	}
	body := s.Body
	if s.Text != "" {
		body = []byte(s.Text)
	}
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(s.Status)
	_, _ = w.Write(body)
}

// recorder passes a handler's response through to the client and keeps what a replay
// needs.
type recorder struct {
	http.ResponseWriter
	max    int
	replay []string

	wrote    bool // a final status was sent
	hijacked bool // the handler took the connection over
	switched bool // 101 Switching Protocols: the connection is another protocol's now
	failed   bool // a write or flush to the client failed
	// declared is the Content-Length the handler set when it sent the status, or -1.
	declared int64
	stored   storedResponse
	body     bytes.Buffer
}

func (rec *recorder) WriteHeader(code int) {
	if !rec.wrote && !rec.hijacked {
		switch {
		case code == http.StatusSwitchingProtocols:
			rec.switched = true
		case code >= 200:
			rec.wrote = true
			rec.capture(code)
		}
	}
	rec.ResponseWriter.WriteHeader(code)
}

// capture records the status and the replayable headers as they are when the status is
// sent. A header value that is not UTF-8 (obs-text) or holds a NUL cannot be stored in
// the record's JSON and is left out.
func (rec *recorder) capture(code int) {
	rec.stored.Status = code
	h := rec.ResponseWriter.Header()
	rec.declared = -1
	if n, err := strconv.ParseInt(h.Get("Content-Length"), 10, 64); err == nil && n >= 0 {
		rec.declared = n
	}
	for _, name := range rec.replay {
		if values, ok := h[name]; ok && len(values) == 0 {
			// Present without a value: the handler suppressed a header net/http would add
			// (Content-Type: nil turns off sniffing). The replay does the same.
			if rec.stored.Header == nil {
				rec.stored.Header = http.Header{}
			}
			rec.stored.Header[name] = []string{}
			continue
		}
		for _, v := range h[name] {
			if !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0 {
				continue
			}
			if rec.stored.Header == nil {
				rec.stored.Header = http.Header{}
			}
			rec.stored.Header[name] = append(rec.stored.Header[name], v)
		}
	}
}

// implicitOK sends the 200 net/http sends for a handler that writes or flushes before
// any status, unless a status or a protocol switch went out already.
func (rec *recorder) implicitOK() {
	if !rec.wrote && !rec.switched && !rec.hijacked {
		rec.WriteHeader(http.StatusOK)
	}
}

func (rec *recorder) Write(p []byte) (int, error) {
	rec.implicitOK()
	n, err := rec.ResponseWriter.Write(p)
	switch {
	case errors.Is(err, http.ErrBodyNotAllowed), errors.Is(err, http.ErrContentLength):
		// A status that has no body (204, 304), or bytes beyond the declared
		// Content-Length: net/http sends none of them, and neither does a replay.
	case rec.stored.BodyOmitted:
	case rec.body.Len()+len(p) > rec.max:
		rec.omitBody()
	default:
		// What the handler wrote, whether or not it reached the client (it went away, a
		// write timeout): the retry is what reads it. finish decides whether it is whole.
		rec.failed = rec.failed || err != nil
		rec.body.Write(p)
	}
	return n, err
}

// FlushError sends buffered data to the client ([http.ResponseController]).
func (rec *recorder) FlushError() error {
	rec.implicitOK()
	err := http.NewResponseController(rec.ResponseWriter).Flush()
	if err != nil && !errors.Is(err, http.ErrNotSupported) {
		rec.failed = true // as for a failed Write
	}
	return err
}

// Flush implements [http.Flusher] for handlers that assert it.
func (rec *recorder) Flush() { _ = rec.FlushError() }

// Hijack hands the connection to the handler ([http.Hijacker]); the response is then not
// recorded and the key is released when the handler returns.
func (rec *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(rec.ResponseWriter).Hijack()
	if err == nil {
		rec.hijacked = true
	}
	return conn, rw, err
}

// Unwrap returns the server's writer, for [http.ResponseController].
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.ResponseWriter }

// omitBody drops the body, and the headers that describe it, from the stored response.
func (rec *recorder) omitBody() {
	rec.stored.BodyOmitted = true
	rec.stored.Text, rec.stored.Body = "", nil
	rec.body = bytes.Buffer{}
	for name := range rec.stored.Header {
		if name != "Location" && name != "Link" {
			delete(rec.stored.Header, name)
		}
	}
}

// finish completes the stored response once the handler returned. A handler that wrote
// nothing answers 200; net/http sends it after the handler returns.
func (rec *recorder) finish() {
	if !rec.wrote {
		rec.capture(http.StatusOK) // not sent yet: the middleware may still answer instead
	}
	bodiless := rec.stored.Status == http.StatusNoContent || rec.stored.Status == http.StatusNotModified
	switch {
	case bodiless:
	case rec.declared >= 0 && rec.declared != int64(rec.body.Len()):
		// Less than the declared Content-Length (net/http then cuts the connection): a
		// replay must not pass part of a body off as all of it.
		rec.omitBody()
	case rec.failed && rec.declared < 0:
		// The response did not reach the client whole, and nothing says the handler wrote
		// all of it (it may have stopped at the failed write, as io.Copy does).
		rec.omitBody()
	}
	if rec.stored.BodyOmitted {
		return
	}
	b := rec.body.Bytes()
	if utf8.Valid(b) && !bytes.ContainsRune(b, 0) {
		rec.stored.Text = string(b)
	} else {
		rec.stored.Body = slices.Clone(b)
	}
}

// capitalize upper-cases the first letter of an ASCII sentence.
func capitalize(s string) string {
	if s != "" && s[0] >= 'a' && s[0] <= 'z' {
		return string(s[0]-'a'+'A') + s[1:]
	}
	return s
}
