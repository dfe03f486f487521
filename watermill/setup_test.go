package pgidemwatermill_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	pgidemwatermill "github.com/pgidem/pgidem/watermill"
)

// Test timing. None of it is asserted: waits poll for a state and give up after waitCap.
const (
	pollInterval = 20 * time.Millisecond
	waitCap      = 90 * time.Second // failure, not a timing assertion
	mailTTL      = 7 * 24 * time.Hour
)

// effectsSchema holds the lab's effects: the business row (a ledger entry per order) and
// the mail outside the database, counted as a row written outside any handler transaction.
const effectsSchema = `
CREATE TABLE ledger (id bigserial PRIMARY KEY, order_id text NOT NULL, message_uuid text NOT NULL);
CREATE TABLE mails (id bigserial PRIMARY KEY, key text NOT NULL);
CREATE TABLE runs (id bigserial PRIMARY KEY, key text NOT NULL)`

// bundle is one test's database and coordinator.
type bundle struct {
	pool  *pgxpool.Pool
	coord *pgidem.Coordinator
}

// setup gives the test its own migrated database with the effects tables.
func setup(t *testing.T, config *pgidem.Config) *bundle {
	t.Helper()
	db := testdb.New(t)
	_, err := db.Pool.Exec(context.Background(), effectsSchema)
	require.NoError(t, err)
	coord, err := pgidem.NewCoordinator(db.Pool, config)
	require.NoError(t, err)
	return &bundle{pool: db.Pool, coord: coord}
}

// newMiddleware returns a middleware on b's coordinator.
func (b *bundle) newMiddleware(t *testing.T, config *pgidemwatermill.Config) *pgidemwatermill.Middleware {
	t.Helper()
	mw, err := pgidemwatermill.NewMiddleware(b.coord, config)
	require.NoError(t, err)
	return mw
}

// count returns the number of rows of table (one of the effects tables) matching where.
func (b *bundle) count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(),
		"SELECT count(*) FROM "+pgx.Identifier{table}.Sanitize()+" WHERE "+where, args...).Scan(&n))
	return n
}

// orderMessage is an order.created event for order, keyed by its event id.
func orderMessage(uuid, order, eventID string) *message.Message {
	msg := message.NewMessage(uuid, []byte(`{"order":"`+order+`"}`))
	msg.Metadata.Set("order", order)
	msg.Metadata.Set(pgidemwatermill.KeyMetadataDefault, eventID)
	return msg
}

// sendInvoice sends order's invoice mail at most once, through pgidem.Do keyed by the
// effect: the mail is a row in mails, written outside the handler's transaction.
func (b *bundle) sendInvoice(ctx context.Context, order string) error {
	key := order + ".invoice"
	_, err := pgidem.Do(ctx, b.coord, "mail", key, mailTTL, nil, func(ctx context.Context) (int64, error) {
		var id int64
		err := b.pool.QueryRow(ctx, `INSERT INTO mails (key) VALUES ($1) RETURNING id`, key).Scan(&id)
		return id, err
	})
	return err
}
