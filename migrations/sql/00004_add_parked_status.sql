-- pgidem: records can be parked. A record whose holders kept dying until its attempts
-- reached the cap (pgidem.Config.MaxAttempts) gets status 'parked' instead of being taken
-- over again; calls for its key return an error until an operator forgets it. See the
-- package docs of github.com/pgidem/pgidem/pgidem and docs/inspect.md.
-- Plain SQL on purpose: it runs unchanged under the goose CLI and can be vendored into
-- other migration tools. Re-adding the constraint checks every row of pgidem_record while
-- it holds the table's lock.

-- +goose Up
ALTER TABLE pgidem_record DROP CONSTRAINT pgidem_record_status_check;
ALTER TABLE pgidem_record ADD CONSTRAINT pgidem_record_status_check
    CHECK (status IN ('in_progress', 'completed', 'failed', 'parked'));

-- +goose Down
-- A parked record becomes a stored failure: its error (why it was parked) is kept and
-- replayed, so its effect still does not run again until it is forgotten or expires.
UPDATE pgidem_record SET status = 'failed' WHERE status = 'parked';
ALTER TABLE pgidem_record DROP CONSTRAINT pgidem_record_status_check;
ALTER TABLE pgidem_record ADD CONSTRAINT pgidem_record_status_check
    CHECK (status IN ('in_progress', 'completed', 'failed'));
