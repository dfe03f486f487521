package pgidemhttp

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/pgidem/pgidem/pgidem"
)

// action answers a request once its call reported its outcome.
type action func(c *call)

// outcomeActions maps the outcome of a request's call ([pgidem.Result.Outcome]) to the
// middleware's answer. An outcome not in it is answered as [pgidem.OutcomeNone] is.
var outcomeActions = map[pgidem.Outcome]action{
	// next ran: the client has next's answer, unless next wrote none and its response
	// could not be stored (then 503, or 409 when another request took the key over).
	pgidem.OutcomeExecuted:  afterNext(outcomeUnknown),
	pgidem.OutcomeTakenOver: afterNext(outcomeUnknown),
	pgidem.OutcomeFailOpen:  afterNext(outcomeUnknown),
	pgidem.OutcomeNotStored: afterNext(outcomeUnknown),
	pgidem.OutcomeLeaseLost: afterNext(takenOver),

	// next did not run: the stored response, or a problem.
	pgidem.OutcomeReplayed:            replay,
	pgidem.OutcomeWaitedReplayed:      replay,
	pgidem.OutcomeReconciled:          replay, // the value found stands for next's response
	pgidem.OutcomeInProgress:          inProgress,
	pgidem.OutcomeFingerprintMismatch: always(keyReused),
	pgidem.OutcomeStoreError:          beforeNext(storeUnavailable),
	pgidem.OutcomeStoredFailure:       storedFailure,
	pgidem.OutcomeParked:              always(keyParked),
	pgidem.OutcomeInvalid:             beforeNext(internalError),
	pgidem.OutcomeNone:                beforeNext(internalError),
}

// actionFor returns the action for outcome o.
func actionFor(o pgidem.Outcome) action {
	if a, ok := outcomeActions[o]; ok {
		return a
	}
	return beforeNext(internalError)
}

// answer is a problem details response the middleware gives for an outcome.
type answer struct {
	status              int
	code, title, detail string
	retryAfter          bool // with Retry-After: 1
	logged              bool // unexpected: the call's error is logged
}

// The answers of outcomes; [Problem] documents their codes.
var (
	keyReused = answer{status: http.StatusUnprocessableEntity, code: "idempotency_key_reused",
		title:  "Idempotency-Key is already used",
		detail: "This Idempotency-Key was used for a different request (another method, path, query or body)."}
	// A parked key is no conflict a retry resolves (no Retry-After) and no fault of the
	// request (not 422): the key's state refuses it until an operator forgets the record.
	keyParked = answer{status: http.StatusConflict, code: "idempotency_key_parked",
		title:  "Idempotency-Key parked",
		detail: "Earlier requests with this Idempotency-Key stopped before finishing too many times; it is refused until an operator releases it."}
	storeUnavailable = answer{status: http.StatusServiceUnavailable, code: "store_unavailable",
		title:      "Idempotency store unavailable",
		detail:     "The request was not processed because its Idempotency-Key could not be reserved; retry later.",
		retryAfter: true}
	responseNotStored = answer{status: http.StatusInternalServerError, code: "response_not_stored",
		title:  "Response not stored",
		detail: "A request with this Idempotency-Key was processed, but its response could not be stored for replay."}
	takenOver = answer{status: http.StatusConflict, code: "idempotency_key_in_progress",
		title:      "Idempotency-Key taken over",
		detail:     "Another request with this Idempotency-Key took it over while this one ran; retry to get its outcome.",
		retryAfter: true}
	outcomeUnknown = answer{status: http.StatusServiceUnavailable, code: "outcome_unknown",
		title:      "Outcome not recorded",
		detail:     "The request was processed, but its outcome could not be recorded; a retry may process it again.",
		retryAfter: true}
	internalError = answer{status: http.StatusInternalServerError, code: "internal_error",
		title: "Internal error", detail: "The request's Idempotency-Key could not be handled.", logged: true}
)

// always answers a.
func always(a answer) action {
	return func(c *call) { c.answer(a) }
}

// beforeNext answers a, unless the client went away: nobody reads an answer then, and it
// gets a bare 503.
func beforeNext(a answer) action {
	return func(c *call) {
		if c.r.Context().Err() != nil {
			c.w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		c.answer(a)
	}
}

// afterNext handles a call whose fn ran. When next wrote its response, or the response
// was stored or released as [Config.Store] decided, nothing is left to do. Otherwise the
// response could not be stored: that is logged, and when next wrote nothing the
// middleware answers a in its place.
func afterNext(a answer) action {
	return func(c *call) {
		switch {
		case c.rec == nil: // the client went away as next was about to start
			beforeNext(internalError)(c)
			return
		case c.err == nil, errors.Is(c.err, errNotStored):
			return
		}
		m := c.m
		m.config.Logger.ErrorContext(c.ctx, "pgidemhttp: the handler ran but its response was not stored; a retry with its key may run the handler again",
			slog.String("namespace", m.config.Namespace), slog.String("key", c.recordKey), slog.String("error", c.err.Error()))
		if c.rec.wrote || c.rec.hijacked || c.rec.switched || c.r.Context().Err() != nil {
			return
		}
		// What next set describes no answer; the problem replaces it. Outer handlers'
		// headers (CORS, a request id) stay.
		h := c.w.Header()
		clear(h)
		maps.Copy(h, c.outer)
		c.answer(a)
	}
}

// replay sends the stored response.
func replay(c *call) {
	if c.err != nil { // a stored response that does not decode
		beforeNext(internalError)(c)
		return
	}
	c.replayed = c.m.writeReplay(c.w, c.res.Value)
}

// inProgress answers 409 with a Retry-After of the holder's remaining lease, within 1 s
// and [Config.RetryAfterMax].
func inProgress(c *call) {
	retry := min(max(c.res.RetryAfter, time.Second), c.m.config.RetryAfterMax.Truncate(time.Second))
	c.m.problem(c.w, http.StatusConflict, "idempotency_key_in_progress", "A request with this Idempotency-Key is in progress",
		"A request with this Idempotency-Key is still being processed; retry later.",
		http.Header{"Retry-After": {strconv.FormatInt(int64(math.Ceil(retry.Seconds())), 10)}})
}

// storedFailure answers a record that holds a failure instead of a response: one whose
// response the store refused (500 response_not_stored), or a record the middleware did
// not write (500 internal_error).
func storedFailure(c *call) {
	a := internalError
	if errors.Is(c.err, pgidem.ErrResultNotStorable) {
		a = responseNotStored
	}
	beforeNext(a)(c)
}

// answer writes a, logging the call's error first when a is unexpected.
func (c *call) answer(a answer) {
	if a.logged {
		c.m.config.Logger.ErrorContext(c.ctx, "pgidemhttp: unexpected error", slog.String("error", fmt.Sprint(c.err)))
	}
	var extra http.Header
	if a.retryAfter {
		extra = http.Header{"Retry-After": {"1"}}
	}
	c.m.problem(c.w, a.status, a.code, a.title, a.detail, extra)
}
