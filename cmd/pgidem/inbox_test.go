package main_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// inbox list, show and forget read and delete pgidem_inbox rows written by the coordinator;
// a forgotten message is handled again on its next delivery.
func TestInbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	require.NoError(t, err)
	handled := 0
	handle := func(consumer, id string) bool {
		ok, err := coord.InboxHandle(ctx, consumer, id, &pgidem.InboxOpts{Payload: []byte(`{"order": 42}`)},
			func(context.Context, pgx.Tx) error { handled++; return nil })
		require.NoError(t, err)
		return ok
	}
	require.True(t, handle("billing", "msg-1"))
	require.True(t, handle("billing", "-msg-2"))
	require.True(t, handle("shipping", "msg-1"))
	_, err = db.Pool.Exec(ctx, `UPDATE pgidem_inbox SET expires_at = now() - interval '1 minute' WHERE consumer = 'shipping'`)
	require.NoError(t, err)

	out := requireOK(t, cli(t, db.URL, "inbox", "list", "--consumer", "billing"))
	require.Contains(t, out, "CONSUMER")
	require.Contains(t, out, "msg-1")
	require.Contains(t, out, "-msg-2")
	require.NotContains(t, out, "shipping")
	var rows []struct {
		Consumer  string          `json:"consumer"`
		MessageID string          `json:"message_id"`
		Payload   json.RawMessage `json:"payload"`
		Expired   bool            `json:"expired"`
	}
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "inbox", "list", "--expired", "--json"))), &rows))
	require.Len(t, rows, 1)
	require.Equal(t, "shipping", rows[0].Consumer)
	require.True(t, rows[0].Expired)
	require.JSONEq(t, `{"order": 42}`, string(rows[0].Payload))
	require.Contains(t, requireOK(t, cli(t, db.URL, "inbox", "list", "--limit", "1")), "(first 1 row; raise --limit for more)")
	out = requireOK(t, cli(t, db.URL, "inbox", "list", "--message-id", "msg-1"))
	require.Contains(t, out, "billing")
	require.Contains(t, out, "shipping")
	require.NotContains(t, out, "-msg-2")

	out = requireOK(t, cli(t, db.URL, "inbox", "show", "billing", "--", "-msg-2"))
	require.Contains(t, out, "message id  -msg-2\n")
	require.Contains(t, out, `payload     {"order": 42}`)
	line := requireFail(t, cli(t, db.URL, "inbox", "show", "billing", "msg-404"), 1)
	require.Equal(t, `pgidem: no inbox row for consumer "billing" message id "msg-404"`, line)

	require.False(t, handle("billing", "msg-1"), "recorded: skipped")
	out = requireOK(t, cli(t, db.URL, "inbox", "forget", "billing", "msg-1"))
	require.True(t, strings.HasPrefix(out, "deleted:\n"), out)
	before := handled
	require.True(t, handle("billing", "msg-1"), "forgotten: handled again")
	require.Equal(t, before+1, handled)
	requireFail(t, cli(t, db.URL, "inbox", "forget", "billing", "msg-404"), 1)

	line = requireFail(t, cli(t, db.URL, "inbox", "list", "--consumer", ""), 2)
	require.Contains(t, line, "--consumer must not be empty")
	requireFail(t, cli(t, db.URL, "inbox", "show", "billing"), 2)
}
