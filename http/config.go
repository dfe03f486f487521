package pgidemhttp

import (
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/pgidem/pgidem/pgidem"
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
// identity whose authorization can differ: a user, not the tenant or a shared account. It
// must stay the same across a client's retries (not a session or token id). Add a type
// prefix when ids of several kinds of caller may collide ("user:42", "client:42"). It is
// not authentication: run the middleware behind it, so every request that reaches the
// middleware has a caller. An error, or an empty principal, is therefore a server fault:
// the middleware answers 500 (code "principal_unknown"), logs the error and does not run
// the handler. Any string is a valid principal; records hold a digest of it ([RecordKey]).
// Called from the goroutine of each request, so concurrently.
type PrincipalFunc func(r *http.Request) (string, error)

// FingerprintFunc returns the fingerprint of a request: bytes that are equal for two
// requests exactly when they ask for the same thing. body is the whole request body,
// already read (the handler still reads it from r.Body). r.Body must not be read. A
// handler outside the middleware may have parsed the form (Request.ParseForm of a
// URL-encoded body, ParseMultipartForm) and so consumed the body, leaving the middleware
// none. body is then the parsed form instead: its values sorted by name, and each file's
// field name, file name, size and SHA-256. An
// outer handler that reads the body any other way must put it back, or every request
// would have the empty body's fingerprint. Called from the goroutine of each request, so
// concurrently.
type FingerprintFunc func(r *http.Request, body []byte) []byte

// StorePolicyFunc reports whether a response with the given status code is stored in the
// record and replayed to retries. A response that is not stored releases the key, so a
// retry with it runs the handler again. Called from the goroutine of each request, so
// concurrently.
type StorePolicyFunc func(status int) bool

// StoreDefault is the default [Config.Store]. Every status is stored except these:
//   - 5xx: a server error says nothing final about the request.
//   - 408 Request Timeout, 425 Too Early and 429 Too Many Requests: the request was not
//     processed.
//   - 401, 403 and 407: the caller's credentials were refused. A client that
//     authenticates again, or steps up, resends the request under the same key and must
//     be judged anew.
//
// A retry of those runs the handler again. This is pgidem's policy, not the draft's: its
// section 2.6 has a retry return the first result, "success or an error". Give Store a
// function that returns true to do so.
func StoreDefault(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusProxyAuthRequired,
		http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
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

	// Methods are the request methods the middleware applies to, in upper case. It applies
	// to them in any case a client sends: methods are case-sensitive (RFC 9110, section
	// 9.1), but a handler that does not check the method would run "post" as a POST. The
	// fingerprint keeps the method as sent. Other requests pass to the
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
	// [pgidem.Config.MaxValueBytes] (16 MiB by default). A body is stored as JSON text when
	// it is UTF-8, where a control or HTML character takes a six-byte escape. Else it is
	// stored as base64 (4/3 of its size). Default [MaxResponseBytesDefault] (1 MiB); [New] refuses a
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
	// never stored. One that panics after it did is stored by that status, without its
	// body, since the status may have reached the client and the effect may have happened.
	// A [httputil.ReverseProxy] panics so when copying the upstream's body fails. The panic
	// is logged at error with its stack unless it is [http.ErrAbortHandler]. One
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
	//     409 Conflict at once with Retry-After. The draft's section 2.6 asks for a
	//     resource conflict error for a concurrent request, section 2.7 for a 409.
	//   - [pgidem.InFlightWait]: hold the retry up to WaitTimeout (mind the server's
	//     WriteTimeout) until the first request finishes, and replay its response. When
	//     the first request's response is not stored (a 5xx, a panic), one waiter takes
	//     the key and runs the handler itself, and the others replay that. After the wait,
	//     409. This departs from the draft for clients that prefer an answer to a conflict.
	InFlight pgidem.InFlightPolicy

	// WaitTimeout bounds the wait under [pgidem.InFlightWait]. Default: the
	// coordinator's [pgidem.Config.WaitTimeout] (1 minute unless set there); not negative.
	WaitTimeout time.Duration

	// RetryAfterMax bounds the Retry-After of a 409 answered while the first request is
	// in progress. The hint is the time until the first request's lease ends (when a retry
	// could take over if its server died), at least 1 s, at most this. A live server
	// renews the lease, so the lease says nothing about when the request will finish. A
	// client that waits 30 s for a request that takes 200 ms waits for nothing; the River
	// middleware bounds its snooze for the same reason. Retry-After counts whole seconds
	// (RFC 9110, 10.2.3): a fraction of a second here is dropped. At least 1 s. Default
	// [RetryAfterMaxDefault] (5 s).
	RetryAfterMax time.Duration

	// ProblemType is the "type" member of the problem details (RFC 9457) the middleware
	// answers errors with: a URI that documents them for your API's clients. Default
	// [ProblemTypeDefault] ("about:blank", with each response's title its status text).
	ProblemType string

	// CancelWithClient cancels next's context when the request's context is cancelled (the
	// client goes away), as net/http does. Default false: once next starts it runs to the
	// end whatever the client does. Under an Idempotency-Key the client's retry is what
	// reads the outcome (a replay, or a wait for the run in progress). A handler cut off
	// half-way would answer an error status that releases the key, so the retry would run
	// the effect again. The request's cancellation still ends the reservation, a wait,
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

	// Hook observes every request the middleware applies to, refused ones included: it
	// gives the request its context and receives a [Response] (outcome, status) for it.
	// Default: none.
	Hook Hook
}

// defaultReplayHeaders is the default Config.ReplayHeaders.
func defaultReplayHeaders() []string {
	return []string{"Cache-Control", "Content-Encoding", "Content-Language", "Content-Location",
		"Content-Type", "ETag", "Expires", "Last-Modified", "Link", "Location", "Retry-After", "Vary", "Allow"}
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
	ccfg := coord.Config()
	cfg.withDefaults(&ccfg)
	if err := cfg.validate(&ccfg); err != nil {
		return nil, err
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

// withDefaults fills cfg's zero fields with their defaults; those that follow the
// coordinator come from ccfg.
func (cfg *Config) withDefaults(ccfg *pgidem.Config) {
	cfg.Namespace = cmp.Or(cfg.Namespace, NamespaceDefault)
	cfg.TTL = cmp.Or(cfg.TTL, TTLDefault)
	cfg.MaxRequestBytes = cmp.Or(cfg.MaxRequestBytes, MaxRequestBytesDefault)
	cfg.MaxResponseBytes = cmp.Or(cfg.MaxResponseBytes, MaxResponseBytesDefault)
	cfg.InFlight = cmp.Or(cfg.InFlight, pgidem.InFlightRaise)
	cfg.WaitTimeout = cmp.Or(cfg.WaitTimeout, ccfg.WaitTimeout)
	cfg.ProblemType = cmp.Or(cfg.ProblemType, ProblemTypeDefault)
	cfg.RetryAfterMax = cmp.Or(cfg.RetryAfterMax, RetryAfterMaxDefault)
	cfg.Logger = cmp.Or(cfg.Logger, ccfg.Logger)
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
}

// validate returns an error matching pgidem.ErrInvalidArgument that names the first
// setting of cfg (defaults filled in) that is out of range for a coordinator of ccfg.
func (cfg *Config) validate(ccfg *pgidem.Config) error {
	switch {
	case cfg.Principal == nil:
		return invalid("Config.Principal is required: keys are scoped to the caller")
	case cfg.TTL < ccfg.MinTTL:
		return invalid("Config.TTL %s is below the coordinator's MinTTL %s", cfg.TTL, ccfg.MinTTL)
	case cfg.InFlight != pgidem.InFlightRaise && cfg.InFlight != pgidem.InFlightWait:
		return invalid("Config.InFlight %d is not a known policy", cfg.InFlight)
	case cfg.WaitTimeout < 0:
		return invalid("Config.WaitTimeout %s must not be negative", cfg.WaitTimeout)
	case cfg.RetryAfterMax < time.Second:
		return invalid("Config.RetryAfterMax %s is below one second, the unit of Retry-After", cfg.RetryAfterMax)
	case cfg.MaxRequestBytes < 0:
		return invalid("Config.MaxRequestBytes %d must not be negative", cfg.MaxRequestBytes)
	case cfg.MaxResponseBytes < 0:
		return invalid("Config.MaxResponseBytes %d must not be negative", cfg.MaxResponseBytes)
	case len(cfg.Methods) == 0:
		return invalid("Config.Methods is empty: the middleware would apply to no request")
	}
	for _, method := range cfg.Methods {
		// Methods are case-sensitive (RFC 9110, 9.1): "post" would never match a POST.
		if !isToken(method) || strings.ToUpper(method) != method {
			return invalid("Config.Methods holds %q; give methods as clients send them, in upper case (POST, PATCH)", method)
		}
	}
	if ccfg.MaxKeyBytes <= recordKeyPrefixLen {
		return invalid("the coordinator's MaxKeyBytes %d leaves no room for a key after the principal's %d bytes", ccfg.MaxKeyBytes, recordKeyPrefixLen)
	}
	if len(cfg.Namespace) > ccfg.MaxNamespaceBytes || !utf8.ValidString(cfg.Namespace) || strings.IndexFunc(cfg.Namespace, unicode.IsControl) >= 0 {
		return invalid("Config.Namespace %q must be valid UTF-8 without control characters, at most the coordinator's MaxNamespaceBytes (%d)", cfg.Namespace, ccfg.MaxNamespaceBytes)
	}
	return nil
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
