package pgidemwatermill

import (
	"cmp"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// identify returns the namespace and key of msg. The key is not validated here: pgidem
// refuses an invalid one ([pgidem.ErrInvalidKey]) before anything runs.
func (m *Middleware) identify(msg *message.Message) (namespace, key string, err error) {
	namespace = cmp.Or(m.config.Namespace, message.HandlerNameFromCtx(msg.Context()), NamespaceDefault)
	if m.config.Key != nil {
		key, err = m.config.Key(msg)
		if err != nil {
			return namespace, "", fmt.Errorf("pgidemwatermill: message %s: key: %w", msg.UUID, err)
		}
		return namespace, key, nil
	}
	return namespace, cmp.Or(msg.Metadata.Get(m.config.KeyMetadata), msg.UUID), nil
}
