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
	crashLease  = time.Second
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
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: crashLease})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(3)
	}
	_, err = pgidem.Do(ctx, coord, "mail", "order-9.invoice", testTTL, nil, func(ctx context.Context) (string, error) {
		fmt.Println("started")
		select {} // the effect is "running" when the parent kills us
	})
	fmt.Println("error:", err)
	os.Exit(3)
	return true
}

func TestCrashTakeover(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Lease: crashLease})

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashEnvURL+"="+b.db.URL)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "started", strings.TrimSpace(line))

	held := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusInProgress, held.Status)
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	require.Equal(t, syscall.SIGKILL, cmd.ProcessState.Sys().(syscall.WaitStatus).Signal())

	// A Raise caller right after the crash still sees the dead holder's lease.
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "order-9.invoice", testTTL,
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
