package pgidemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// ProblemContentType is the media type of the middleware's error responses (RFC 9457).
const ProblemContentType = "application/problem+json"

// Problem is the body of the middleware's error responses: problem details (RFC 9457)
// with one extension member, Code, a stable token clients can switch on. Clients may
// decode a response into it.
type Problem struct {
	// Type is [Config.ProblemType] ("about:blank" by default).
	Type string `json:"type"`
	// Title is a short summary: the status text when Type is "about:blank", else a title
	// of the problem ("Idempotency-Key is already used").
	Title string `json:"title"`
	// Status is the HTTP status code of the response.
	Status int `json:"status"`
	// Detail explains this occurrence in a sentence.
	Detail string `json:"detail,omitempty"`
	// Code identifies the problem:
	//   - "idempotency_key_missing" (400): [Config.Required] and no key was sent.
	//   - "idempotency_key_invalid" (400): the key is not a valid value, the field was sent
	//     twice, or the key is longer than the coordinator's MaxKeyBytes less 23.
	//   - "request_body_unreadable" (400) and "request_too_large" (413).
	//   - "idempotency_key_reused" (422): the key was first used for a different request.
	//   - "idempotency_key_in_progress" (409): the first request with the key is still
	//     running, or took this one's key over while it ran. Retry-After says when a retry
	//     is worth it.
	//   - "idempotency_key_parked" (409, without Retry-After): earlier requests with the
	//     key were taken over until the coordinator's MaxAttempts, so the key is parked.
	//     Every request with it is refused, unprocessed, until an operator forgets its
	//     record (pgidem records forget) or it expires.
	//   - "store_unavailable" (503): the key could not be reserved, and the request was not
	//     processed. Retry-After: 1.
	//   - "outcome_unknown" (503): the request was processed (its handler ran and wrote
	//     nothing) but its outcome could not be recorded, so a retry may process it again.
	//   - "response_not_stored" (500): the request with this key was processed but its
	//     response cannot be replayed.
	//   - "principal_unknown" (500): [Config.Principal] named no caller (a server fault,
	//     logged).
	//   - "internal_error" (500): anything else, logged.
	//
	// A request whose client went away before the handler ran is answered a bare 503,
	// without a problem: nobody reads it.
	Code string `json:"code"`
}

// problem writes a problem details response. extra headers (Retry-After) are added.
func (m *Middleware) problem(w http.ResponseWriter, status int, code, title, detail string, extra http.Header) {
	p := Problem{Type: m.config.ProblemType, Title: title, Status: status, Detail: detail, Code: code}
	if p.Type == ProblemTypeDefault {
		p.Title = http.StatusText(status) // RFC 9457, section 4.2.1
	}
	body, err := json.Marshal(p)
	if err != nil { // cannot happen: every field is a string or an int
		http.Error(w, http.StatusText(status), status)
		return
	}
	h := w.Header()
	for name, values := range extra {
		h[name] = values
	}
	h.Set("Content-Type", ProblemContentType)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
