package pgidemriver

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/riverqueue/river"
)

type outputSlotKey struct{}

// outputSlot carries the output a worker records with RecordOutput up to the middleware.
type outputSlot struct {
	mu     sync.Mutex
	output json.RawMessage
}

func (s *outputSlot) set(b []byte) {
	s.mu.Lock()
	s.output = b
	s.mu.Unlock()
}

func (s *outputSlot) get() json.RawMessage {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.output
}

// RecordOutput records output as the job's output, like river.RecordOutput (it calls it),
// and also stores it in the job's pgidem record. A replayed job then records the same
// output without running: the same job redelivered, or another job with the same key.
// Use it for the effect's receipt (a message id, a charge id). output must be
// JSON-encodable; only the last call per execution counts. It must be called from within a
// worker's Work; outside the middleware it behaves exactly like river.RecordOutput. It
// returns an error (prefixed "pgidemriver: RecordOutput: ") when output cannot be encoded
// or River rejects it (outside a worker, or above River's size limit).
//
// Some output JSON can encode but the pgidem record cannot store: a string with a NUL
// character, or more than [pgidem.Config.MaxValueBytes] of JSON
// ([pgidem.ErrResultNotStorable]). That is not an error here, since the effect has already
// run. The middleware completes the record without the output, so the effect is never
// repeated for its key. It completes the job (River keeps the output it recorded in the
// job's metadata), logs a warning and reports [Outcome.OutputNotStored]. Later replays of the
// key complete without output. River's metadata is jsonb too, so it cannot hold a NUL
// character either: keep receipts to valid UTF-8 without NUL. A string with invalid
// UTF-8 is recorded by both as encoding/json writes it, with U+FFFD in place of each
// invalid byte, and replays that way.
func RecordOutput(ctx context.Context, output any) error {
	b, err := json.Marshal(output)
	if err != nil {
		return fmt.Errorf("pgidemriver: RecordOutput: %w", err)
	}
	if err := river.RecordOutput(ctx, json.RawMessage(b)); err != nil {
		return fmt.Errorf("pgidemriver: RecordOutput: %w", err)
	}
	if slot, ok := ctx.Value(outputSlotKey{}).(*outputSlot); ok {
		slot.set(b)
	}
	return nil
}
