package pgidemhttp

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
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
)

// Defaults and limits for [Config]. A zero Config field takes the Default.
const (
	// NamespaceDefault is the default [Config.Namespace].
	NamespaceDefault = "http"
	// TTLDefault is the default [Config.TTL]: 24 hours, the expiry the draft's examples
	// use and a common choice of payment APIs.
	TTLDefault = 24 * time.Hour
	// MaxRequestBytesDefault is the default [Config.MaxRequestBytes]: 1 MiB.
	MaxRequestBytesDefault = 1 << 20
	// MaxResponseBytesDefault is the default [Config.MaxResponseBytes]: 1 MiB.
	MaxResponseBytesDefault = 1 << 20
	// ProblemTypeDefault is the default [Config.ProblemType] (RFC 9457, section 4.2.1).
	ProblemTypeDefault = "about:blank"
)

// PrincipalFunc returns the identity of the caller a request comes from: the
// authenticated user, API client or tenant its idempotency keys belong to. An error, or an
// empty principal, means the caller is not known; the middleware then answers 401.
type PrincipalFunc func(r *http.Request) (string, error)

// FingerprintFunc returns the fingerprint of a request: bytes that are equal for two
// requests exactly when they ask for the same thing. body is the whole request body,
// already read (the handler still reads it from r.Body). r.Body must not be read.
type FingerprintFunc func(r *http.Request, body []byte) []byte

// StorePolicyFunc reports whether a response with the given status code is stored in the
// record and replayed to retries. A response that is not stored releases the key, so a
// retry with it runs the handler again.
type StorePolicyFunc func(status int) bool

// StoreDefault is the default [Config.Store]: every status is stored except 5xx (a server
// error says nothing final about the request) and 429 Too Many Requests (the request was
// not processed), as the draft's advice on retries implies.
func StoreDefault(status int) bool {
	return status < 500 && status != http.StatusTooManyRequests
}

// FingerprintDefault is the default [Config.Fingerprint]: the SHA-256 of the method, the
// escaped path, the raw query and the body. A key reused on another endpoint, or with
// another body, is answered with 422 (the draft, section 2.7).
func FingerprintDefault(r *http.Request, body []byte) []byte {
	h := sha256.New()
	for _, part := range []string{r.Method, r.URL.EscapedPath(), r.URL.RawQuery} {
		h.Write([]byte(strconv.Itoa(len(part)) + ":" + part + "\n"))
	}
	h.Write(body)
	return h.Sum(nil)
}

// Config configures a [Middleware]. Only Principal is required.
type Config struct {
	// Principal returns the caller a request's key belongs to; keys are scoped to it, so
	// one caller can never receive another's replayed response by sending the same key.
	// Put the middleware behind authentication and return the authenticated identity.
	// Required; a service with a single trusted client may return a constant.
	Principal PrincipalFunc

	// Namespace is the record namespace of every request (see [RecordKey] for the key).
	// Give two APIs on one database different namespaces if their callers' keys must not
	// meet. Default [NamespaceDefault] ("http").
	Namespace string

	// TTL is how long a response is replayed after it was stored; a retry after that runs
	// the handler again. At least the coordinator's [pgidem.Config.MinTTL]. Default
	// [TTLDefault] (24 h).
	TTL time.Duration

	// Required makes the key mandatory for the methods in Methods: a request without an
	// Idempotency-Key field is answered 400 (the draft, section 2.7) and the handler is
	// not run. Default false: such a request passes to the handler unprotected.
	Required bool

	// Methods are the request methods the middleware applies to; other requests pass to
	// the handler untouched, with or without a key. Default POST and PATCH, the
	// non-idempotent methods the draft is for (GET, PUT and DELETE are idempotent by
	// definition, RFC 9110 section 9.2.2).
	Methods []string

	// MaxRequestBytes bounds the request body, in bytes, which the middleware reads whole
	// to fingerprint it before the handler runs. A longer body is answered 413 and the
	// handler is not run. Default [MaxRequestBytesDefault] (1 MiB).
	MaxRequestBytes int64

	// MaxResponseBytes bounds the response body stored for replay, in bytes. A longer
	// response is sent to the client as usual and stored without its body: a replay then
	// sends the status and headers with an empty body. Stored bodies are base64 in the
	// record's JSON unless they are UTF-8 text, so keep 4/3 of it under the coordinator's
	// [pgidem.Config.MaxValueBytes]. Default [MaxResponseBytesDefault] (1 MiB).
	MaxResponseBytes int

	// ReplayHeaders are the response headers stored and replayed, as the draft asks for
	// an allowlist; other headers (Set-Cookie, Date, tracing headers) are neither stored
	// nor replayed. Default: Cache-Control, Content-Encoding, Content-Language,
	// Content-Location, Content-Type, ETag, Expires, Last-Modified, Link, Location.
	ReplayHeaders []string

	// Store decides which responses are stored and replayed. Default [StoreDefault]
	// (everything but 5xx and 429). A handler that panics is never stored, nor one that
	// wrote nothing while its request's context was cancelled (the client went away).
	Store StorePolicyFunc

	// Fingerprint computes a request's fingerprint, stored with the record and compared
	// on every retry: a different fingerprint is answered 422 and the handler is not
	// run. Default [FingerprintDefault] (method, path, query and body).
	Fingerprint FingerprintFunc

	// InFlight is what a retry does while the first request with its key is still being
	// handled:
	//   - [pgidem.InFlightRaise] (the default, also for [pgidem.InFlightDefault]): answer
	//     409 Conflict at once with Retry-After (the draft, section 2.7);
	//   - [pgidem.InFlightWait]: wait up to WaitTimeout for the first request to finish
	//     and replay its response, then answer 409.
	InFlight pgidem.InFlightPolicy

	// WaitTimeout bounds the wait under [pgidem.InFlightWait]. Default 0: the
	// coordinator's [pgidem.Config.WaitTimeout].
	WaitTimeout time.Duration

	// ProblemType is the "type" member of the problem details (RFC 9457) the middleware
	// answers errors with: a URI that documents them for your API's clients. Default
	// [ProblemTypeDefault] ("about:blank", with each response's title its status text).
	ProblemType string

	// Logger receives the middleware's warnings and errors (a record the handler's
	// response could not be stored in, an unexpected error). Default: the coordinator's
	// [pgidem.Config.Logger].
	Logger *slog.Logger
}

// defaultReplayHeaders is the default Config.ReplayHeaders.
func defaultReplayHeaders() []string {
	return []string{"Cache-Control", "Content-Encoding", "Content-Language", "Content-Location",
		"Content-Type", "ETag", "Expires", "Last-Modified", "Link", "Location"}
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
	cfg.ProblemType = cmp.Or(cfg.ProblemType, ProblemTypeDefault)
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
	case cfg.MaxRequestBytes < 0:
		return nil, invalid("Config.MaxRequestBytes %d must not be negative", cfg.MaxRequestBytes)
	case cfg.MaxResponseBytes < 0:
		return nil, invalid("Config.MaxResponseBytes %d must not be negative", cfg.MaxResponseBytes)
	case len(cfg.Methods) == 0:
		return nil, invalid("Config.Methods is empty: the middleware would apply to no request")
	}
	if len(cfg.Namespace) > ccfg.MaxNamespaceBytes || !utf8.ValidString(cfg.Namespace) || strings.IndexFunc(cfg.Namespace, unicode.IsControl) >= 0 {
		return nil, invalid("Config.Namespace %q must be valid UTF-8 without control characters, at most the coordinator's MaxNamespaceBytes (%d)", cfg.Namespace, ccfg.MaxNamespaceBytes)
	}
	m := &Middleware{coord: coord, config: cfg, methods: make(map[string]bool, len(cfg.Methods))}
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
func (m *Middleware) Config() Config { return m.config }

// storedResponse is the record's result: what a replay sends.
type storedResponse struct {
	Status int         `json:"status"`
	Header http.Header `json:"header,omitempty"`
	// Text is the body when it is UTF-8 text (readable in the record), Body otherwise
	// (base64 in the record's JSON).
	Text string `json:"text,omitempty"`
	Body []byte `json:"body,omitempty"`
	// BodyOmitted is true when the body was longer than Config.MaxResponseBytes.
	BodyOmitted bool `json:"body_omitted,omitempty"`
}

// errNotStored releases the key: the handler's response is not to be replayed.
var errNotStored = errors.New("pgidemhttp: response not stored")

// Handler wraps next. For a request whose method is in [Config.Methods] and that carries
// an Idempotency-Key field:
//   - the first request with a key runs next; its response streams to the client as usual
//     and, when [Config.Store] accepts its status, is stored (status, body, the headers in
//     [Config.ReplayHeaders]) for [Config.TTL];
//   - a retry with the key and the same fingerprint gets the stored response, marked
//     Idempotent-Replayed: true, and next does not run;
//   - a retry with a different fingerprint (another body, path or method): 422;
//   - a retry while the first is still running: 409 with Retry-After in seconds (or a
//     wait, [Config.InFlight]);
//   - a response not stored (5xx, 429, a panic) releases the key: a retry runs next again.
//
// Requests the middleware refuses never reach next and are answered with problem details
// (RFC 9457, Content-Type application/problem+json; [Problem]): a missing key when
// [Config.Required] (400), an invalid key (400), a caller [Config.Principal] cannot
// identify (401), a body over [Config.MaxRequestBytes] (413), or a store that cannot be
// reached (503: the request is not run unprotected, unless the coordinator opted into
// [pgidem.Config.FailOpen]). next runs with the request's body already read into memory and
// a context that carries the key ([pgidem.KeyFromContext]) and is cancelled with cause
// [pgidem.ErrLeaseLost] if another request took the key over.
//
// The response writer given to next supports [http.ResponseController] (Flush and what
// the server's writer supports); a connection next hijacks is not recorded.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !m.methods[r.Method] {
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
		m.problem(w, http.StatusBadRequest, "idempotency_key_invalid", "Idempotency-Key is invalid",
			"The request carries more than one Idempotency-Key header.", nil)
		return
	}
	key, err := parseKey(fields[0])
	if err != nil {
		m.problem(w, http.StatusBadRequest, "idempotency_key_invalid", "Idempotency-Key is invalid", capitalize(err.Error())+".", nil)
		return
	}
	principal, err := m.config.Principal(r)
	if err != nil || principal == "" {
		m.problem(w, http.StatusUnauthorized, "principal_unknown", "Caller not identified",
			"The caller of this request could not be identified, so its Idempotency-Key has no scope.", nil)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, m.config.MaxRequestBytes+1))
	if err != nil {
		m.problem(w, http.StatusBadRequest, "request_body_unreadable", "Request body unreadable",
			"The request body could not be read.", nil)
		return
	}
	if int64(len(body)) > m.config.MaxRequestBytes {
		m.problem(w, http.StatusRequestEntityTooLarge, "request_too_large", "Request body too large",
			fmt.Sprintf("A request with an Idempotency-Key may carry at most %d bytes.", m.config.MaxRequestBytes), nil)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	opts := &pgidem.DoOpts{
		Fingerprint: m.config.Fingerprint(r, body),
		InFlight:    m.config.InFlight,
		WaitTimeout: m.config.WaitTimeout,
	}

	ran := false
	res, err := pgidem.DoResult(r.Context(), m.coord, m.config.Namespace, RecordKey(principal, key), m.config.TTL, opts,
		func(ctx context.Context) (storedResponse, error) {
			ran = true
			rec := &recorder{ResponseWriter: w, max: m.config.MaxResponseBytes, replay: m.replay}
			next.ServeHTTP(rec, r.WithContext(ctx))
			if !rec.wrote && ctx.Err() != nil {
				return storedResponse{}, errNotStored // the handler gave up on a cancelled request
			}
			rec.finish()
			if !m.config.Store(rec.stored.Status) {
				return storedResponse{}, errNotStored
			}
			return rec.stored, nil
		})
	if ran {
		// The client has its response; what is left is whether the record holds it.
		if err != nil && !errors.Is(err, errNotStored) {
			m.config.Logger.ErrorContext(r.Context(), "pgidemhttp: the response was sent but not stored; a retry with its key may run the handler again or find no response",
				slog.String("namespace", m.config.Namespace), slog.String("key", RecordKey(principal, key)), slog.String("error", err.Error()))
		}
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
			retry = max(ipe.RetryAfter, time.Second)
		}
		m.problem(w, http.StatusConflict, "idempotency_key_in_progress", "A request with this Idempotency-Key is in progress",
			"A request with this Idempotency-Key is still being processed; retry later.",
			http.Header{"Retry-After": {strconv.FormatInt(int64(math.Ceil(retry.Seconds())), 10)}})
	case errors.Is(err, pgidem.ErrInvalidKey):
		m.problem(w, http.StatusBadRequest, "idempotency_key_invalid", "Idempotency-Key is invalid",
			"The Idempotency-Key, scoped to its caller, is too long to store.", nil)
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
		m.config.Logger.ErrorContext(r.Context(), "pgidemhttp: unexpected error", slog.String("error", err.Error()))
		m.problem(w, http.StatusInternalServerError, "internal_error", "Internal error",
			"The request's Idempotency-Key could not be handled.", nil)
	}
}

// writeReplay sends a stored response.
func (m *Middleware) writeReplay(w http.ResponseWriter, s storedResponse) {
	h := w.Header()
	for name, values := range s.Header {
		h[name] = values
	}
	h.Set(HeaderReplayed, "true")
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

	wrote  bool
	stored storedResponse
	body   bytes.Buffer
}

func (rec *recorder) WriteHeader(code int) {
	if !rec.wrote && code >= 200 {
		rec.wrote = true
		rec.stored.Status = code
		h := rec.ResponseWriter.Header()
		for _, name := range rec.replay {
			if values, ok := h[name]; ok {
				if rec.stored.Header == nil {
					rec.stored.Header = http.Header{}
				}
				rec.stored.Header[name] = slices.Clone(values)
			}
		}
	}
	rec.ResponseWriter.WriteHeader(code)
}

func (rec *recorder) Write(p []byte) (int, error) {
	if !rec.wrote {
		rec.WriteHeader(http.StatusOK)
	}
	if !rec.stored.BodyOmitted {
		if rec.body.Len()+len(p) > rec.max {
			rec.stored.BodyOmitted = true
			rec.body = bytes.Buffer{}
		} else {
			rec.body.Write(p)
		}
	}
	return rec.ResponseWriter.Write(p)
}

// FlushError sends buffered data to the client ([http.ResponseController]).
func (rec *recorder) FlushError() error {
	if !rec.wrote {
		rec.WriteHeader(http.StatusOK)
	}
	return http.NewResponseController(rec.ResponseWriter).Flush()
}

// Flush implements [http.Flusher] for handlers that assert it.
func (rec *recorder) Flush() { _ = rec.FlushError() }

// Unwrap returns the server's writer, for [http.ResponseController].
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.ResponseWriter }

// finish completes the stored response once the handler returned.
func (rec *recorder) finish() {
	if !rec.wrote {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.stored.BodyOmitted {
		delete(rec.stored.Header, "Content-Type")
		delete(rec.stored.Header, "Content-Encoding")
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
