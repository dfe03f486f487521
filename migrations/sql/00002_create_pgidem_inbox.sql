-- pgidem: one row per (consumer, message id) a consumer has handled. See the package docs
-- of github.com/pgidem/pgidem/pgidem, "Database effects: DoTx and the inbox". The
-- handler's transaction inserts the row with ON CONFLICT DO NOTHING and commits it
-- together with the handler's own rows, so a redelivered message finds the row and is
-- skipped. Plain SQL on purpose: it runs unchanged under the goose CLI. Objects are
-- created in the first schema of the search_path.

-- +goose Up
CREATE TABLE pgidem_inbox (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    payload     jsonb,
    received_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT pgidem_inbox_pkey PRIMARY KEY (consumer, message_id),
    CONSTRAINT pgidem_inbox_key_check CHECK (consumer <> '' AND message_id <> '')
);

-- Lets the sweep find rows past their retention by range scan instead of reading the table.
CREATE INDEX pgidem_inbox_expires_at_idx ON pgidem_inbox (expires_at);

COMMENT ON TABLE pgidem_inbox IS
    'pgidem: one row per (consumer, message id) handled; a row past expires_at counts as absent and is swept';

-- +goose Down
DROP TABLE pgidem_inbox;
