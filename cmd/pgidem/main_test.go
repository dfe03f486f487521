package main_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

// binaryPath is the pgidem binary built once by TestMain and only read by tests.
var binaryPath string

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	dir, err := os.MkdirTemp("", "pgidem-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "pgidem cli test: temp dir:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	binaryPath = filepath.Join(dir, "pgidem")
	build := exec.Command("go", "build", "-o", binaryPath, ".")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "pgidem cli test: go build:", err)
		return 1
	}
	return m.Run()
}

// result is what one run of the binary produced.
type result struct {
	code   int
	stdout string
	stderr string
}

// cliEnv is the environment a test runs the binary with: the test process's own minus
// every variable that could pick a database, plus extra.
func cliEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if name == "DATABASE_URL" || strings.HasPrefix(name, "PG") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// pgidemEnv runs the binary with args and the given extra environment.
func pgidemEnv(t *testing.T, env []string, args ...string) result {
	t.Helper()
	var stdout bytes.Buffer
	r := pgidemOut(t, &stdout, env, args...)
	r.stdout = stdout.String()
	return r
}

// pgidemOut runs the binary with args, the given extra environment and stdout as its
// standard output (result.stdout is then empty).
func pgidemOut(t *testing.T, stdout io.Writer, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binaryPath, args...)
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = stdout, &stderr
	err := cmd.Run()
	code := 0
	if err != nil {
		exitErr, ok := err.(*exec.ExitError)
		require.True(t, ok, "run pgidem %v: %v", args, err)
		code = exitErr.ExitCode()
	}
	return result{code: code, stderr: stderr.String()}
}

// process is a run of the binary in the background, for tests that act while it runs
// (send it a signal, release a lock): its standard error is read line by line as it
// comes.
type process struct {
	cmd    *exec.Cmd
	stdout bytes.Buffer
	// lines receives each line of standard error; it is closed at its end.
	lines chan string
	// stderr holds every line of standard error once lines is closed.
	stderr strings.Builder
}

// startCLI starts the binary against url with args.
func startCLI(t *testing.T, url string, args ...string) *process {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel) // kills the process if a test gave up on it
	p := &process{lines: make(chan string, 100)}
	p.cmd = exec.CommandContext(ctx, binaryPath, append([]string{"--database-url", url}, args...)...)
	p.cmd.Env = cliEnv()
	p.cmd.Stdout = &p.stdout
	pipe, err := p.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	go func() {
		defer close(p.lines)
		scanner := bufio.NewScanner(pipe)
		for scanner.Scan() {
			p.stderr.WriteString(scanner.Text() + "\n")
			select {
			case p.lines <- scanner.Text():
			default: // nobody waits for lines: the test reads stderr at the end
			}
		}
	}()
	return p
}

// waitLine waits for a line of standard error containing substr and returns it.
func (p *process) waitLine(t *testing.T, substr string) string {
	t.Helper()
	timeout := time.After(time.Minute)
	for {
		select {
		case line, ok := <-p.lines:
			require.True(t, ok, "standard error ended without a line containing %q", substr)
			if strings.Contains(line, substr) {
				return line
			}
		case <-timeout:
			require.FailNow(t, "no line containing "+substr+" on standard error")
		}
	}
}

// interrupt sends the process SIGINT, as Ctrl-C does.
func (p *process) interrupt(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(os.Interrupt))
}

// signalUntilExit sends the process sig every 50 ms until it exits, for at most d, and
// returns the signal that ended it, or nil when it exited by itself (or is still running).
// The first signals may come before the process stops catching them: they are not lost
// on the test.
func (p *process) signalUntilExit(t *testing.T, sig os.Signal, d time.Duration) os.Signal {
	t.Helper()
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		for range p.lines { // standard error must be read to its end before Wait
		}
		_ = p.cmd.Wait()
	}()
	deadline := time.After(d)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-exited:
			if ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				return ws.Signal()
			}
			return nil
		case <-deadline:
			<-exited
			return nil
		case <-tick.C:
			_ = p.cmd.Process.Signal(sig) // fails once the process has exited
		}
	}
}

// wait waits for the process to exit and returns what it produced.
func (p *process) wait(t *testing.T) result {
	t.Helper()
	for range p.lines { // standard error must be read to its end before Wait
	}
	err := p.cmd.Wait()
	code := 0
	if err != nil {
		exitErr, ok := err.(*exec.ExitError)
		require.True(t, ok, "run pgidem: %v", err)
		code = exitErr.ExitCode()
	}
	return result{code: code, stdout: p.stdout.String(), stderr: p.stderr.String()}
}

// proxy forwards TCP connections to a Postgres server until frozen; then, like a server
// that stopped answering (or a network that dropped it), it forwards nothing more either
// way and leaves new connections (cancel requests) unanswered, keeping every connection
// open until the test ends.
type proxy struct {
	ln     net.Listener
	target string
	frozen chan struct{}
	freeze func()
	closed chan struct{}
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns []net.Conn
}

// startProxy returns a proxy to the server of url (a postgres:// URL) and url rewritten to
// go through it.
func startProxy(t *testing.T, rawURL string) (*proxy, string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	target := u.Host
	if u.Port() == "" {
		target = net.JoinHostPort(u.Hostname(), "5432")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, target: target, frozen: make(chan struct{}), closed: make(chan struct{})}
	p.freeze = sync.OnceFunc(func() { close(p.frozen) })
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		close(p.closed)
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	u.Host = ln.Addr().String()
	return p, u.String()
}

// track remembers c, to be closed when the test ends.
func (p *proxy) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns = append(p.conns, c)
	select {
	case <-p.closed:
		c.Close() // the test has ended
	default:
	}
}

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.track(client)
		select {
		case <-p.frozen:
			continue // held, unanswered
		default:
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			client.Close()
			continue
		}
		p.track(server)
		p.wg.Add(2)
		go p.pipe(server, client)
		go p.pipe(client, server)
	}
}

// pipe copies from src to dst until src ends (then closes dst) or the proxy is frozen
// (then drops what it reads, and closes nothing).
func (p *proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-p.frozen:
			if err != nil {
				return
			}
			continue
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			dst.Close()
			return
		}
	}
}

// cli runs the binary against url with args.
func cli(t *testing.T, url string, args ...string) result {
	t.Helper()
	return pgidemEnv(t, cliEnv(), append([]string{"--database-url", url}, args...)...)
}

// requireOK asserts a successful run and returns its standard output.
func requireOK(t *testing.T, r result) string {
	t.Helper()
	require.Equal(t, 0, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.Empty(t, r.stderr)
	return r.stdout
}

// requireFail asserts an exit code and one line on stderr starting with "pgidem: ", and
// returns that line.
func requireFail(t *testing.T, r result, code int) string {
	t.Helper()
	require.Equal(t, code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.True(t, strings.HasPrefix(r.stderr, "pgidem: "), "stderr: %q", r.stderr)
	require.True(t, strings.HasSuffix(r.stderr, "\n"), "stderr: %q", r.stderr)
	require.Equal(t, 1, strings.Count(r.stderr, "\n"), "one line on stderr: %q", r.stderr)
	return strings.TrimSpace(r.stderr)
}

// fixture is a pgidem_record row inserted with plain SQL. Times are relative to the
// database's now() and far from any boundary, so no assertion depends on timing.
type fixture struct {
	namespace, key, status string
	attempts               int
	result, errJSON        *string
	// leaseIn is the lease left for in-progress records (negative: expired).
	leaseIn time.Duration
	// expiresIn is the TTL left (negative: expired).
	expiresIn time.Duration
	// age is how long ago the record was created.
	age time.Duration
}

func ptr(s string) *string { return &s }

func insert(t *testing.T, pool *pgxpool.Pool, table string, fixtures ...fixture) {
	t.Helper()
	for _, f := range fixtures {
		attempts := max(f.attempts, 1)
		_, err := pool.Exec(context.Background(), `
			INSERT INTO `+table+` (namespace, key, status, owner, attempts, result, error,
				lease_expires_at, expires_at, created_at, updated_at, completed_at)
			VALUES ($1, $2, $3, gen_random_uuid(), $4, $5::jsonb, $6::jsonb,
				CASE WHEN $3 = 'in_progress' THEN now() + make_interval(secs => $7) END,
				now() + make_interval(secs => $8),
				now() - make_interval(secs => $9), now() - make_interval(secs => $9),
				CASE WHEN $3 <> 'in_progress' THEN now() - make_interval(secs => $9) END)`,
			f.namespace, f.key, f.status, attempts, f.result, f.errJSON,
			f.leaseIn.Seconds(), f.expiresIn.Seconds(), f.age.Seconds())
		require.NoError(t, err, "insert %s/%s", f.namespace, f.key)
	}
}

// countRecords counts the rows of table (a quoted name).
func countRecords(t *testing.T, pool *pgxpool.Pool, table string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n))
	return n
}

// standardFixtures is a small incident: a double-run invoice, a live and a dead holder, an
// expired failure. Every time is half a minute past a whole minute, so the CLI's rounded
// durations ("1h0m", "expired 1h0m ago") hold for any run shorter than 30 seconds.
func standardFixtures() []fixture {
	const half = 30 * time.Second
	return []fixture{
		{namespace: "invoices", key: "order-9.invoice", status: "completed", attempts: 2,
			result: ptr(`{"invoice_id": "inv_1001", "amount_cents": 4200}`), expiresIn: 23*time.Hour + half, age: 2*time.Hour + half},
		{namespace: "invoices", key: "order-10.invoice", status: "in_progress",
			leaseIn: time.Hour + half, expiresIn: 24*time.Hour + half, age: time.Hour + half},
		{namespace: "invoices", key: "order-7.invoice", status: "in_progress",
			leaseIn: -time.Hour - half, expiresIn: 20*time.Hour + half, age: 4*time.Hour + half},
		{namespace: "mail", key: "order-9.receipt", status: "failed",
			errJSON: ptr(`{"message": "mailbox unavailable"}`), expiresIn: -time.Hour - half, age: 25*time.Hour + half},
		{namespace: "mail", key: "order-8.receipt", status: "completed",
			result: ptr(`null`), expiresIn: time.Hour + half, age: 3*time.Hour + half},
	}
}

// Ctrl-C (SIGINT) while connecting, during a sweep or during a forget is reported as
// "interrupted", never as a bare "context canceled" or a network failure: the message
// names what it interrupted and, for the commands that delete, what was deleted.
func TestInterrupt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("Connecting", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"stats"}, ""},
			{[]string{"migrate", "up"}, ""},
			{[]string{"records", "forget", "a", "b"}, "; nothing was deleted"},
			{[]string{"inbox", "forget", "a", "b"}, "; nothing was deleted"},
			{[]string{"sweep"}, "; nothing was deleted"},
		} {
			// A server that accepts connections and never answers; one per run, so no
			// connection of an earlier run is taken for this one's.
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			accepted := make(chan net.Conn, 16)
			go func() {
				for {
					conn, err := ln.Accept()
					if err != nil {
						close(accepted)
						return
					}
					accepted <- conn
				}
			}()
			address := ln.Addr().String()
			p := startCLI(t, "postgres://alice@"+address+"/app", tc.args...)
			<-accepted // the CLI is connecting (its signal handler is installed first thing)
			p.interrupt(t)
			r := p.wait(t)
			require.NoError(t, ln.Close())
			for conn := range accepted {
				conn.Close()
			}
			require.Equal(t, "pgidem: interrupted while connecting to Postgres at "+address+
				` (database "app", user "alice", from --database-url)`+tc.want, requireFail(t, r, 1), tc.args)
			require.Empty(t, r.stdout)
		}
	})

	// setup returns a database with an expired record and a transaction holding lock on it.
	setup := func(t *testing.T, lock string) (*testdb.DB, pgx.Tx) {
		t.Helper()
		db := testdb.New(t)
		insert(t, db.Pool, "pgidem_record",
			fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour})
		_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at) VALUES ('billing', 'm-1', now() + interval '1 day')`)
		require.NoError(t, err)
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		_, err = tx.Exec(ctx, lock)
		require.NoError(t, err)
		return db, tx
	}

	t.Run("Sweep", func(t *testing.T) {
		t.Parallel()
		db, tx := setup(t, "LOCK TABLE pgidem_record")
		p := startCLI(t, db.URL, "sweep")
		cliWaitingForLock(t, db)
		p.interrupt(t)
		r := p.wait(t)
		require.Equal(t, "pgidem: sweep: interrupted after deleting 0 expired records and 0 expired inbox rows "+
			"(the batch in flight, if any, was rolled back)", requireFail(t, r, 1))
		require.NoError(t, tx.Rollback(ctx))
		require.Equal(t, 1, countRecords(t, db.Pool, "pgidem_record"))
	})

	t.Run("RecordsForget", func(t *testing.T) {
		t.Parallel()
		db, tx := setup(t, "SELECT 1 FROM pgidem_record WHERE namespace = 'mail' AND key = 'old-1' FOR UPDATE")
		p := startCLI(t, db.URL, "records", "forget", "mail", "old-1")
		cliWaitingForLock(t, db)
		p.interrupt(t)
		r := p.wait(t)
		require.Equal(t, "pgidem: forget record: interrupted; nothing was deleted", requireFail(t, r, 1))
		require.Empty(t, r.stdout)
		// The server cancelled the delete: once the lock is free the record is still there.
		require.NoError(t, tx.Rollback(ctx))
		require.Equal(t, 1, countRecords(t, db.Pool, "pgidem_record"))
	})

	t.Run("InboxForget", func(t *testing.T) {
		t.Parallel()
		db, tx := setup(t, "LOCK TABLE pgidem_inbox")
		p := startCLI(t, db.URL, "inbox", "forget", "billing", "m-1")
		cliWaitingForLock(t, db)
		p.interrupt(t)
		r := p.wait(t)
		require.Equal(t, "pgidem: forget inbox row: interrupted; nothing was deleted", requireFail(t, r, 1))
		require.NoError(t, tx.Rollback(ctx))
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM pgidem_inbox").Scan(&n))
		require.Equal(t, 1, n)
	})

	t.Run("List", func(t *testing.T) {
		t.Parallel()
		db, _ := setup(t, "LOCK TABLE pgidem_record")
		p := startCLI(t, db.URL, "records", "list")
		cliWaitingForLock(t, db)
		p.interrupt(t)
		require.Equal(t, "pgidem: list records: interrupted", requireFail(t, p.wait(t), 1))
	})
}

// When the server does not answer the cancel request of an interrupt (it hangs, or the
// network dropped it: here a proxy that stops forwarding), the CLI answers within about
// the 3 s grace instead of waiting up to 15 s more for pgconn to close the broken
// connection, a second Ctrl-C ends it at once, and sweep says the batch it cut off may or
// may not have been deleted (a COMMIT the server had received may complete).
func TestInterruptServerSilent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// setup returns a database with an expired record, a transaction holding lock on it
	// and a proxy to the database, with a URL through it.
	setup := func(t *testing.T, lock string) (*testdb.DB, pgx.Tx, *proxy, string) {
		t.Helper()
		db := testdb.New(t)
		insert(t, db.Pool, "pgidem_record",
			fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour})
		tx, err := db.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		_, err = tx.Exec(ctx, lock)
		require.NoError(t, err)
		p, url := startProxy(t, db.URL)
		return db, tx, p, url
	}
	const forgetLock = "SELECT 1 FROM pgidem_record WHERE namespace = 'mail' AND key = 'old-1' FOR UPDATE"

	t.Run("RecordsForget", func(t *testing.T) {
		t.Parallel()
		db, tx, proxy, url := setup(t, forgetLock)
		p := startCLI(t, url, "records", "forget", "mail", "old-1")
		cliWaitingForLock(t, db)
		proxy.freeze()
		p.interrupt(t)
		r := p.wait(t)
		// (How soon it answers — the grace and a bounded close, not 15 s more for the broken
		// connection — is not asserted: tests here assert no durations. SecondSignal below
		// checks that the user can always end it at once.)
		require.Equal(t, `pgidem: forget record: interrupted before the server answered, so the delete may or may not have been applied `+
			`(it is one statement, which commits on its own once it has run); check with: pgidem records show -- mail old-1`, requireFail(t, r, 1))
		// Indeed: the server never got the cancel request, and deletes the record once the
		// lock is free.
		require.NoError(t, tx.Rollback(ctx))
		require.Eventually(t, func() bool { return countRecords(t, db.Pool, "pgidem_record") == 0 }, time.Minute, 10*time.Millisecond)
	})

	t.Run("SecondSignal", func(t *testing.T) {
		t.Parallel()
		db, _, proxy, url := setup(t, forgetLock)
		p := startCLI(t, url, "records", "forget", "mail", "old-1")
		cliWaitingForLock(t, db)
		proxy.freeze()
		p.interrupt(t)
		// Within the grace, while the first one is still being handled, a second Ctrl-C
		// ends the process.
		require.Equal(t, syscall.SIGINT, p.signalUntilExit(t, os.Interrupt, 2*time.Second), p.stderr.String())
	})

	t.Run("SweepDuringCommit", func(t *testing.T) {
		t.Parallel()
		// The sweep's COMMIT runs a deferred trigger that waits for a lock the test holds,
		// so the interrupt comes while the server is committing the batch.
		db, tx, proxy, url := setup(t, "SELECT pg_advisory_xact_lock(4242)")
		_, err := db.Pool.Exec(ctx, `
			CREATE FUNCTION wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS
				$$BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END$$;
			CREATE CONSTRAINT TRIGGER wait_at_commit AFTER DELETE ON pgidem_record
				DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION wait_at_commit()`)
		require.NoError(t, err)
		p := startCLI(t, url, "sweep")
		cliWaitingForLock(t, db)
		proxy.freeze()
		p.interrupt(t)
		r := p.wait(t)
		require.Equal(t, "pgidem: sweep: interrupted after deleting 0 expired records and 0 expired inbox rows; "+
			"the server did not confirm that the batch in flight, if any, was cancelled, so it may or may not have been deleted too "+
			"(sweeping again is harmless)", requireFail(t, r, 1))
		// Indeed: the COMMIT completes once the lock is free.
		require.NoError(t, tx.Rollback(ctx))
		require.Eventually(t, func() bool { return countRecords(t, db.Pool, "pgidem_record") == 0 }, time.Minute, 10*time.Millisecond)
	})
}
