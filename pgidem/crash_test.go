package pgidem_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

const (
	crashEnvURL = "PGIDEM_CRASH_CHILD_URL"
	crashEnvTTL = "PGIDEM_CRASH_CHILD_TTL" // optional: the record TTL (and MinTTL), a duration
	// crashEnvEffect, when set, makes the child run the effect (a row in payment, created
	// by the parent, under the call's idempotency key) before it announces "started".
	crashEnvEffect = "PGIDEM_CRASH_CHILD_EFFECT"
	crashLease     = time.Second
)

// crashChild runs the child half of TestCrashTakeover when the test binary is re-executed
// for it, and reports whether it did: the child reserves the key, announces "started" and
// blocks inside fn until it is SIGKILLed.
func crashChild(_ *testing.M) bool {
	url := os.Getenv(crashEnvURL)
	if url == "" {
		return false
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(3)
	}
	ttl, minTTL := testTTL, time.Duration(0)
	if s := os.Getenv(crashEnvTTL); s != "" {
		if ttl, err = time.ParseDuration(s); err != nil {
			fmt.Println("error:", err)
			os.Exit(3)
		}
		minTTL = ttl
	}
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: crashLease, MinTTL: minTTL})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(3)
	}
	_, err = pgidem.Do(ctx, coord, "mail", "order-9.invoice", ttl, nil, func(ctx context.Context) (string, error) {
		if os.Getenv(crashEnvEffect) != "" {
			_, key, _ := pgidem.KeyFromContext(ctx)
			if _, err := pool.Exec(ctx, `INSERT INTO payment (idempotency_key, payment_id) VALUES ($1, 'pay_1')`, key); err != nil {
				fmt.Println("error:", err)
				os.Exit(3)
			}
		}
		fmt.Println("started")
		select {} // the effect is "running" when the parent kills us
	})
	fmt.Println("error:", err)
	os.Exit(3)
	return true
}

// startCrashChild re-executes the test binary as a holder of mail/order-9.invoice (with
// record TTL ttl when non-zero) and returns once its fn has started.
func startCrashChild(t *testing.T, url string, ttl time.Duration, env ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), crashEnvURL+"="+url), env...)
	if ttl > 0 {
		cmd.Env = append(cmd.Env, crashEnvTTL+"="+ttl.String())
	}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "started", strings.TrimSpace(line))
	return cmd
}

// killCrashChild SIGKILLs the holder process.
func killCrashChild(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	require.Equal(t, syscall.SIGKILL, cmd.ProcessState.Sys().(syscall.WaitStatus).Signal())
}

// A holder that ran longer than its record's TTL and then died is taken over (attempts 2,
// TookOver), not treated as an expired, absent record: the heartbeat keeps the record's
// expiry a whole TTL beyond the lease.
func TestCrashAfterTTLIsTakeover(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	b := setup(t, &pgidem.Config{Lease: crashLease, MinTTL: ttl})
	cmd := startCrashChild(t, b.db.URL, ttl)
	// Let the holder outlive its TTL (by the database clock), heartbeating.
	require.Eventually(t, func() bool {
		var past bool
		require.NoError(t, b.db.Pool.QueryRow(b.ctx,
			`SELECT now() > created_at + $1 * interval '1 microsecond' FROM pgidem_record`, (ttl+crashLease).Microseconds()).Scan(&past))
		return past
	}, time.Minute, 100*time.Millisecond)
	held := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusInProgress, held.Status)
	require.GreaterOrEqual(t, held.ExpiresAt.Sub(held.LeaseExpiresAt), ttl-crashLease/2,
		"the record's expiry stays a TTL beyond the live lease")
	killCrashChild(t, cmd)

	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", ttl, nil,
		func(context.Context) (string, error) { return "em_2", nil })
	require.NoError(t, err)
	require.True(t, res.TookOver, "a dead holder's reservation is a takeover, not an absent record")
	require.Equal(t, 2, res.Attempts)
}

func TestCrashTakeover(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Lease: crashLease})

	cmd := startCrashChild(t, b.db.URL, 0)
	held := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusInProgress, held.Status)
	killCrashChild(t, cmd)

	// A Raise caller right after the crash still sees the dead holder's lease.
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "order-9.invoice", testTTL,
		&pgidem.DoOpts{InFlight: pgidem.InFlightRaise}, func(context.Context) (string, error) {
			return "", fmt.Errorf("must not run")
		})
	var inProgress *pgidem.InProgressError
	if err != nil {
		require.ErrorAs(t, err, &inProgress)
		require.LessOrEqual(t, inProgress.RetryAfter, crashLease)
	}

	// A waiter takes over once the dead holder's lease has expired, and runs the effect.
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil,
		func(context.Context) (string, error) { return "em_2", nil })
	require.NoError(t, err)
	require.Equal(t, "em_2", res.Value)
	require.True(t, res.TookOver)
	require.Equal(t, 2, res.Attempts)

	rec := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.Equal(t, 2, rec.Attempts, "attempts > 1 tells the operator the effect may have run twice")
	// Never taken over early: the takeover happened after the dead holder's last lease, and
	// the dead holder blocked others for at most about one lease (plus the waiter's poll).
	require.False(t, rec.UpdatedAt.Before(held.LeaseExpiresAt), "takeover before the lease expired")
	require.Less(t, rec.CompletedAt.Sub(held.LeaseExpiresAt), 5*crashLease, "dead holder blocked far longer than a lease")
}
