-- pgidem: one row per (namespace, idempotency key). See the package docs of
-- github.com/pgidem/pgidem/pgidem and docs/inspect.md.
-- Plain SQL on purpose: it runs unchanged under the goose CLI and can be vendored into
-- other migration tools. Objects are created in the first schema of the search_path.

-- +goose Up
CREATE TABLE pgidem_record (
    namespace        text        NOT NULL,
    key              text        NOT NULL,
    status           text        NOT NULL,
    owner            uuid        NOT NULL,
    attempts         integer     NOT NULL DEFAULT 1,
    fingerprint      bytea,
    result           jsonb,
    error            jsonb,
    lease_expires_at timestamptz,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    CONSTRAINT pgidem_record_pkey PRIMARY KEY (namespace, key),
    CONSTRAINT pgidem_record_status_check
        CHECK (status IN ('in_progress', 'completed', 'failed')),
    CONSTRAINT pgidem_record_lease_check
        CHECK ((status = 'in_progress') = (lease_expires_at IS NOT NULL)),
    CONSTRAINT pgidem_record_attempts_check CHECK (attempts >= 1),
    CONSTRAINT pgidem_record_key_check CHECK (namespace <> '' AND key <> '')
);

-- Lets the sweep find expired records by range scan instead of reading the table.
CREATE INDEX pgidem_record_expires_at_idx ON pgidem_record (expires_at);

COMMENT ON TABLE pgidem_record IS
    'pgidem: one row per (namespace, idempotency key); attempts > 1 means a takeover happened and the effect may have run more than once';

-- +goose Down
DROP TABLE pgidem_record;
