package pgidemhttp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

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

// writeReplay sends a stored response. It reports false when it could not be read, and
// answered 500 instead.
func (m *Middleware) writeReplay(w http.ResponseWriter, raw json.RawMessage) bool {
	var s storedResponse
	if err := json.Unmarshal(raw, &s); err != nil || s.Status < 200 || s.Status > 999 {
		m.problem(w, http.StatusInternalServerError, "response_not_stored", "Response not stored",
			"A request with this Idempotency-Key was processed, but its stored response cannot be read.", nil)
		return false
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
	return true
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
