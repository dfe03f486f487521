package pgidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// The fingerprint is compared on every path, in progress and takeover included, also by
// DoTx: meeting a live Do holder or a dead one's expired lease with another fingerprint
// returns ErrFingerprintMismatch, without running fn (or waiting) and without touching the
// row.
func TestDoTxChecksFingerprintInProgressAndTakeover(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	fpA, fpB := []byte("payload-A"), []byte("payload-B")
	var runs atomic.Int32
	fn := func(context.Context, pgx.Tx) (int, error) { runs.Add(1); return 1, nil }

	live := b.hold(b.coord, "ns", "live", &pgidem.DoOpts{Fingerprint: fpA}, "holder")
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ns", "live", testTTL, &pgidem.DoOpts{Fingerprint: fpB, InFlight: pgidem.InFlightRaise}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, "in progress, Raise")
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "live", testTTL, &pgidem.DoOpts{Fingerprint: fpB, WaitTimeout: 200 * time.Millisecond}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, "in progress, Wait")
	live.unblock()
	require.NoError(t, <-live.done)

	b.insertDeadHolder(t, "ns", "dead", fpA)
	before := b.readRaw(t, "ns", "dead")
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "dead", testTTL, &pgidem.DoOpts{Fingerprint: fpB}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, "takeover of a dead holder")
	require.Equal(t, before, b.readRaw(t, "ns", "dead"), "the dead holder's row was changed")

	require.Zero(t, runs.Load(), "fn ran despite a fingerprint mismatch")
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	// Long enough that a loaded machine's stall never lets the InProgress case take the
	// holder's record over; no case waits for a lease to end.
	const lease = 2 * time.Second
	b := setup(t, &pgidem.Config{Lease: lease, InFlight: pgidem.InFlightRaise})
	fpA, fpB := &pgidem.DoOpts{Fingerprint: []byte("A")}, &pgidem.DoOpts{Fingerprint: []byte("B")}
	ok := func(context.Context) (string, error) { return "v", nil }
	mustNotRun := func(context.Context) (string, error) { t.Error("fn ran on a mismatch"); return "", nil }

	t.Run("Replay", func(t *testing.T) {
		_, err := pgidem.Do(b.ctx, b.coord, "fp", "done", testTTL, fpA, ok)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "done", testTTL, fpB, mustNotRun)
		var fme *pgidem.FingerprintMismatchError
		require.ErrorAs(t, err, &fme)
		require.Equal(t, pgidem.StatusCompleted, fme.Status)
		v, err := pgidem.Do(b.ctx, b.coord, "fp", "done", testTTL, fpA, mustNotRun)
		require.NoError(t, err)
		require.Equal(t, "v", v)
		require.Equal(t, []byte("A"), b.lookup(t, "fp", "done").Fingerprint, "survives completion")
	})

	t.Run("InProgress", func(t *testing.T) {
		h := b.hold(b.coord, "fp", "running", fpA, "v")
		_, err := pgidem.Do(b.ctx, b.coord, "fp", "running", testTTL, fpB, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "running", testTTL, fpA, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrInProgress)
		h.unblock()
		require.NoError(t, <-h.done)
	})

	t.Run("Takeover", func(t *testing.T) {
		_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
			(namespace, key, status, owner, fingerprint, lease_expires_at, expires_at)
			VALUES ('fp', 'dead', 'in_progress', gen_random_uuid(), 'A', now() - interval '1 second', now() + interval '1 hour')`)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "dead", testTTL, fpB, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		require.Equal(t, 1, b.lookup(t, "fp", "dead").Attempts, "a mismatching caller does not take over")
		res, err := pgidem.DoResult(b.ctx, b.coord, "fp", "dead", testTTL, &pgidem.DoOpts{}, ok)
		require.NoError(t, err, "no fingerprint given: no check")
		require.True(t, res.TookOver)
		require.Equal(t, []byte("A"), b.lookup(t, "fp", "dead").Fingerprint, "survives takeover")
	})

	// A record released after a takeover is kept, and so is its fingerprint: the dead
	// holder may have run the effect for payload A. A released first reservation is
	// deleted and binds nothing.
	t.Run("ReleasedAfterTakeover", func(t *testing.T) {
		fail := func(context.Context) (string, error) { return "", errors.New("fn failed") }
		b.insertDeadHolder(t, "fp", "kept", []byte("A"))
		res, err := pgidem.DoResult(b.ctx, b.coord, "fp", "kept", testTTL, fpA, fail)
		require.EqualError(t, err, "fn failed")
		require.True(t, res.TookOver)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "kept", testTTL, fpB, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)

		_, err = pgidem.Do(b.ctx, b.coord, "fp", "first", testTTL, fpA, fail)
		require.EqualError(t, err, "fn failed")
		v, err := pgidem.Do(b.ctx, b.coord, "fp", "first", testTTL, fpB, ok)
		require.NoError(t, err)
		require.Equal(t, "v", v)
	})
}

func TestDoTxFingerprint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) { return "v", nil }
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("a")}, fn)
	require.NoError(t, err)
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("b")}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	v, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("a")}, fn)
	require.NoError(t, err)
	require.Equal(t, "v", v)
}

// rawRecord is the raw state of a record, read with SQL (owner included).
type rawRecord struct {
	Owner, Status, Err string
	Attempts           int
	Fingerprint        []byte
}

func (b *testBundle) readRaw(t *testing.T, ns, key string) rawRecord {
	t.Helper()
	var r rawRecord
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT owner::text, status, coalesce(error::text, ''), attempts, fingerprint
		FROM pgidem_record WHERE namespace = $1 AND key = $2`, ns, key).Scan(&r.Owner, &r.Status, &r.Err, &r.Attempts, &r.Fingerprint))
	return r
}

// A stored fingerprint survives every later write of the row: heartbeat, completion,
// stored failure, non-storable result, a takeover and the kept release that follows it,
// DoTx's upsert over a released or lease-expired row. Every later call here passes no
// fingerprint, which must never clear the stored one.
func TestFingerprintSurvivesEveryWrite(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})
	fp := []byte("payload-A")
	withFP := &pgidem.DoOpts{Fingerprint: fp}
	requireFP := func(key, after string) {
		t.Helper()
		require.Equal(t, fp, b.readRaw(t, "ns", key).Fingerprint, "fingerprint lost after %s", after)
	}

	_, err := pgidem.Do(b.ctx, b.coord, "ns", "hb", testTTL, withFP, func(context.Context) (int, error) {
		time.Sleep(2 * lease) // several heartbeats
		return 1, nil
	})
	require.NoError(t, err)
	requireFP("hb", "heartbeats and completion")

	_, err = pgidem.Do(b.ctx, b.coord, "ns", "perm", testTTL, withFP, func(context.Context) (int, error) {
		return 0, pgidem.Permanent(errors.New("declined"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	requireFP("perm", "a stored failure")

	_, err = pgidem.Do(b.ctx, b.coord, "ns", "nul", testTTL, withFP, func(context.Context) (string, error) { return "a\x00b", nil })
	require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
	requireFP("nul", "a non-storable result")

	// A dead holder; a takeover by a caller without fingerprint whose fn fails (a kept
	// release); then DoTx without fingerprint completes the released row.
	b.insertDeadHolder(t, "ns", "chain", fp)
	_, err = pgidem.Do(b.ctx, b.coord, "ns", "chain", testTTL, nil, func(context.Context) (int, error) {
		return 0, errors.New("transient")
	})
	require.Error(t, err)
	require.Equal(t, 2, b.readRaw(t, "ns", "chain").Attempts)
	requireFP("chain", "a takeover and its kept release")
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "chain", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 3, nil })
	require.NoError(t, err)
	requireFP("chain", "DoTx over a released row")

	b.insertDeadHolder(t, "ns", "dotx-lease", fp)
	res, err := pgidem.DoInTx(b.ctx, b.coord, "ns", "dotx-lease", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 4, nil })
	require.NoError(t, err)
	require.Equal(t, 4, res)
	requireFP("dotx-lease", "DoTx taking over a dead holder")

	b.insertDeadHolder(t, "ns", "dotx-perm", fp)
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "dotx-perm", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		return 0, pgidem.Permanent(errors.New("declined"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	requireFP("dotx-perm", "a DoTx stored failure over a dead holder's row")

	for _, key := range []string{"hb", "perm", "nul", "chain", "dotx-lease", "dotx-perm"} {
		_, err := pgidem.Do(b.ctx, b.coord, "ns", key, testTTL, &pgidem.DoOpts{Fingerprint: []byte("B")},
			func(context.Context) (int, error) { panic("must not run") })
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, key)
	}
}

// An empty (non-nil) fingerprint is a fingerprint: Go's mismatch check and the takeover
// statement's WHERE clause agree, so a lease-expired row does not make acquire spin.
func TestEmptyFingerprint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	insertRecord(t, b, "expired-lease", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", []byte{})
	insertRecord(t, b, "done", "completed", "NULL", "now() + interval '1 hour'", []byte{})
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	for _, key := range []string{"expired-lease", "done"} {
		_, err := pgidem.Do(ctx, b.coord, "mail", key, testTTL, &pgidem.DoOpts{Fingerprint: []byte{1}},
			func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, key)
		rec := b.lookup(t, "mail", key)
		require.NotNil(t, rec.Fingerprint)
		require.Empty(t, rec.Fingerprint)
	}
}
