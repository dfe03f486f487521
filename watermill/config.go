package pgidemwatermill

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgidem/pgidem/pgidem"
)

// Defaults for [Config]. A zero Config field takes the Default.
const (
	// NamespaceDefault is the namespace of a message handled outside a Watermill router
	// (no handler name in its context) when [Config.Namespace] is empty.
	NamespaceDefault = "watermill"
	// KeyMetadataDefault is the default [Config.KeyMetadata]: the metadata field that
	// names a message's effect.
	KeyMetadataDefault = "idempotency_key"
	// TTLDefault is the default [Config.TTL]: 7 days, pgidem's inbox retention
	// ([pgidem.InboxRetentionDefault]), beyond most brokers' retention and redelivery
	// horizons.
	TTLDefault = pgidem.InboxRetentionDefault
)

// KeyFunc returns the idempotency key of a message: the identity of the effect it asks
// for ("order-9.invoice"). An error, or an empty key, means the handler does not run and
// the message is nacked. Called from the router's handler goroutines, so concurrently.
type KeyFunc func(msg *message.Message) (string, error)

// FingerprintFunc returns the fingerprint of a message: bytes equal for two messages
// exactly when they ask for the same thing (a hash of the payload, say). A message whose
// key was first used with another fingerprint is refused ([pgidem.ErrFingerprintMismatch])
// and the handler does not run. Called concurrently.
type FingerprintFunc func(msg *message.Message) []byte

// StoredFailurePolicy says how [Middleware.Handler] answers a message whose effect failed
// permanently: the handler returned a [pgidem.Permanent] error, now or for an earlier
// message with the key.
type StoredFailurePolicy int

const (
	// StoredFailureAck acks the message (the default): the failure is final, a redelivery
	// would only replay it. It is logged at warn.
	StoredFailureAck StoredFailurePolicy = iota
	// StoredFailureError returns the failure as an error matching [pgidem.ErrPermanent],
	// for Watermill's PoisonQueueWithFilter middleware to move the message to a poison
	// topic. Without a poison queue the message is nacked and redelivered forever.
	StoredFailureError
)

// Config configures a [Middleware]. A nil *Config means all defaults.
type Config struct {
	// Namespace scopes the keys (and, for [Middleware.InboxHandler], names the inbox
	// consumer). Default "": the name of the router handler that consumed the message
	// ([message.HandlerNameFromCtx]), so two handlers of one topic keep separate records,
	// as two consumer groups would; [NamespaceDefault] outside a router. Renaming a
	// handler starts a new namespace: set Namespace to keep the old one. At most
	// [pgidem.Config.MaxNamespaceBytes]; a longer one nacks every message.
	Namespace string

	// Key derives the idempotency key from a message. Default nil: the metadata field
	// [Config.KeyMetadata], or the message's UUID when the field is absent or empty. A
	// UUID key dedupes redeliveries of one message and a publisher's retries of it (they
	// keep the UUID), not two messages for the same effect: name the effect in the
	// metadata where you can.
	Key KeyFunc

	// KeyMetadata is the metadata field the default key reads. Default
	// [KeyMetadataDefault] ("idempotency_key"). Ignored when Key is set.
	KeyMetadata string

	// TTL is how long a record (or inbox row) counts: a redelivery within it replays or
	// is skipped, after it the message is handled again. Make it outlive the broker's
	// retention and redelivery horizon. At least the coordinator's MinTTL, or
	// [NewMiddleware] returns an error. Default [TTLDefault] (7 days).
	TTL time.Duration

	// InFlight is the policy for a message whose key another handler holds right now
	// (a concurrent duplicate). [pgidem.InFlightWait] waits for the holder's outcome and
	// replays it, up to WaitTimeout; [pgidem.InFlightRaise] nacks at once. Either way a
	// duplicate still in progress is nacked with an error matching
	// [pgidem.ErrInProgress], and the broker redelivers it later. Default
	// [pgidem.InFlightDefault]: the coordinator's. Not used by [Middleware.InboxHandler]:
	// a duplicate there waits for the first transaction's end.
	InFlight pgidem.InFlightPolicy

	// WaitTimeout bounds the wait of [pgidem.InFlightWait]. Default 0: the coordinator's.
	WaitTimeout time.Duration

	// Fingerprint, when set, binds each key to its message's fingerprint. Default nil:
	// no check.
	Fingerprint FingerprintFunc

	// StoredFailure is how a permanent failure is answered. Default [StoredFailureAck].
	StoredFailure StoredFailurePolicy

	// Logger receives the middleware's warnings and errors. Default nil: the
	// coordinator's logger (quiet unless configured).
	Logger *slog.Logger
}

// Middleware makes Watermill handlers' effects happen once per message key, with the
// records in Postgres. Create it with [NewMiddleware]; install [Middleware.Handler] with
// the router's AddMiddleware (or a handler's), or wrap a transactional handler with
// [Middleware.InboxHandler]. Safe for concurrent use.
type Middleware struct {
	coord  *pgidem.Coordinator
	config Config
}

// NewMiddleware returns a middleware that keeps its records through coord. config may be
// nil (all defaults); it is copied. A nil coord, a TTL below the coordinator's MinTTL, a
// negative WaitTimeout, or a policy that is not one of the constants returns an error.
func NewMiddleware(coord *pgidem.Coordinator, config *Config) (*Middleware, error) {
	if coord == nil {
		return nil, errors.New("pgidemwatermill: coordinator must not be nil")
	}
	var c Config
	if config != nil {
		c = *config
	}
	c.KeyMetadata = cmp.Or(c.KeyMetadata, KeyMetadataDefault)
	c.TTL = cmp.Or(c.TTL, TTLDefault)
	c.Logger = cmp.Or(c.Logger, coord.Config().Logger, slog.New(slog.DiscardHandler))
	switch {
	case c.TTL < coord.Config().MinTTL:
		return nil, fmt.Errorf("pgidemwatermill: Config.TTL %s is below the coordinator's MinTTL %s", c.TTL, coord.Config().MinTTL)
	case c.WaitTimeout < 0:
		return nil, fmt.Errorf("pgidemwatermill: Config.WaitTimeout %s is negative", c.WaitTimeout)
	case c.InFlight != pgidem.InFlightDefault && c.InFlight != pgidem.InFlightWait && c.InFlight != pgidem.InFlightRaise:
		return nil, fmt.Errorf("pgidemwatermill: Config.InFlight %d is not a policy", c.InFlight)
	case c.StoredFailure != StoredFailureAck && c.StoredFailure != StoredFailureError:
		return nil, fmt.Errorf("pgidemwatermill: Config.StoredFailure %d is not a policy", c.StoredFailure)
	}
	return &Middleware{coord: coord, config: c}, nil
}

// Config returns the middleware's configuration with defaults filled in.
func (m *Middleware) Config() Config { return m.config }
