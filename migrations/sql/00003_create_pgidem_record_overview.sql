-- pgidem: a read-only view over pgidem_record for operators in psql. See docs/inspect.md.
-- Plain SQL on purpose: it runs unchanged under the goose CLI and can be vendored into
-- other migration tools. The view is created in the first schema of the search_path, next
-- to pgidem_record. Every derived column is computed from the database clock (now()) at
-- query time, the same clock that governs leases and expiry.

-- +goose Up
CREATE VIEW pgidem_record_overview AS
SELECT
    namespace,
    key,
    status,
    attempts,
    attempts > 1                                          AS took_over,
    date_trunc('second', now() - created_at)              AS age,
    CASE WHEN status = 'in_progress'
         THEN date_trunc('second', lease_expires_at - now())
    END                                                   AS lease_remaining,
    status = 'in_progress' AND lease_expires_at <= now()  AS lease_expired,
    date_trunc('second', expires_at - now())              AS ttl_remaining,
    expires_at <= now()                                   AS expired,
    CASE WHEN length(coalesce(result, error)::text) > 60
         THEN left(coalesce(result, error)::text, 59) || '…'
         ELSE coalesce(result, error)::text
    END                                                   AS result_preview,
    owner,
    created_at,
    updated_at,
    completed_at,
    lease_expires_at,
    expires_at
FROM pgidem_record;

COMMENT ON VIEW pgidem_record_overview IS
    'pgidem: pgidem_record with derived columns for operators; intervals are computed from now() when queried';
COMMENT ON COLUMN pgidem_record_overview.took_over IS
    'attempts > 1: the lease was taken over, so the effect may have run more than once';
COMMENT ON COLUMN pgidem_record_overview.age IS
    'time since the key was first reserved (now() - created_at), whole seconds';
COMMENT ON COLUMN pgidem_record_overview.lease_remaining IS
    'in progress only: time until another caller may take the key over; negative when the holder stopped renewing';
COMMENT ON COLUMN pgidem_record_overview.lease_expired IS
    'in progress and the lease has run out: the holder is presumed dead and the next caller takes over';
COMMENT ON COLUMN pgidem_record_overview.ttl_remaining IS
    'time until the record expires (expires_at - now()); negative when expired but not yet swept';
COMMENT ON COLUMN pgidem_record_overview.expired IS
    'the record TTL has passed: it behaves like no record and the sweep will delete it';
COMMENT ON COLUMN pgidem_record_overview.result_preview IS
    'the first 60 characters of the stored result (or stored error, for failed records) as JSON text';

-- +goose Down
DROP VIEW pgidem_record_overview;
