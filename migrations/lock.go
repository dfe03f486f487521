package migrations

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3/lock"
)

const (
	// LockTable is the table holding pgidem's migration lock: goose's table lock
	// (lock.NewPostgresTableLocker), one row with id [LockID], created in the current schema
	// by the first migration run and kept, like [VersionTable]. The lock is a row, not a
	// session: it works through a transaction-pooling proxy such as PgBouncer, which hands
	// each statement's transaction to any server connection.
	LockTable = "pgidem_goose_lock"

	// LockLease is how long the migration lock outlives its holder: the holder renews it
	// every [LockHeartbeat]; a run that dies (or whose release fails) leaves a row that
	// the next run takes over once the lease has run out.
	LockLease = 30 * time.Second

	// LockHeartbeat is how often a run holding the migration lock renews its lease.
	LockHeartbeat = 5 * time.Second

	// lockReleaseAttempts bounds the retries of a failing release, one a second, within
	// the caller's deadline.
	lockReleaseAttempts = 30
)

// ErrLockHeld is matched by the error of a migration run that gave up waiting for
// pgidem's migration lock: another run held it until the caller's context ended (the
// error matches its ctx.Err() too) or for [LockRetryAttempts] × [LockRetryPeriodSeconds].
var ErrLockHeld = errors.New("pgidem: migrations: the migration lock is held by another run")

// newTableLocker returns goose's table locker on [LockTable] and [LockID]. Its retries
// (waiting for the lock, releasing it) stop once ctx is done: the caller's deadline bounds
// them, although goose releases the lock with a context detached from ctx's cancellation.
func newTableLocker(ctx context.Context) (lock.Locker, error) {
	locker, err := lock.NewPostgresTableLocker(
		lock.WithTableName(LockTable),
		lock.WithTableLockID(LockID),
		lock.WithTableLeaseDuration(LockLease),
		lock.WithTableHeartbeatInterval(LockHeartbeat),
		lock.WithTableLockTimeout(LockRetryPeriodSeconds*time.Second, LockRetryAttempts),
		lock.WithTableUnlockTimeout(time.Second, lockReleaseAttempts),
		lock.WithTableRetryPolicy(func(error) bool { return ctx.Err() == nil }),
	)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: table locker: %w", err)
	}
	return locker, nil
}

// locked takes pgidem's migration lock through db, runs fn, and releases the lock. ctx
// bounds the wait for the lock (the error then matches [ErrLockHeld] and ctx.Err()), fn,
// and the retries of the release; a release that fails leaves the lock to expire after
// [LockLease]. fn's error and the release's are both returned.
func locked(ctx context.Context, db *sql.DB, fn func(context.Context) error) error {
	locker, err := newTableLocker(ctx)
	if err != nil {
		return err
	}
	if err := locker.Lock(ctx, db); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("%w (lock id %d in table %s): gave up when the context ended: %w", ErrLockHeld, LockID, LockTable, ctxErr)
		}
		return fmt.Errorf("%w (lock id %d in table %s) or could not be taken: %w", ErrLockHeld, LockID, LockTable, err)
	}
	err = fn(ctx)
	if uerr := locker.Unlock(ctx, db); uerr != nil {
		uerr = fmt.Errorf("pgidem: migrations: release the migration lock (it expires by itself within %s): %w", LockLease, uerr)
		return errors.Join(err, uerr)
	}
	return err
}

// LockHolder reports who holds pgidem's migration lock in db's current schema: the holder
// goose names (host, process id and a random suffix) and since when. held is false when
// nobody holds it: the row is free, its lease ran out, or no run ever took it. It takes
// no lock and creates nothing. Cancelling ctx stops its query. Safe for concurrent use.
func LockHolder(ctx context.Context, db *sql.DB) (holder string, since time.Time, held bool, err error) {
	var exists bool
	err = db.QueryRowContext(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{LockTable}.Sanitize()).Scan(&exists)
	if err != nil || !exists {
		return "", time.Time{}, false, wrapHolderErr(err)
	}
	err = db.QueryRowContext(ctx, "SELECT locked_by, locked_at FROM "+pgx.Identifier{LockTable}.Sanitize()+
		" WHERE lock_id = $1 AND locked AND lease_expires_at > now()", LockID).Scan(&holder, &since)
	if errors.Is(err, sql.ErrNoRows) {
		return "", time.Time{}, false, nil
	}
	if err != nil {
		return "", time.Time{}, false, wrapHolderErr(err)
	}
	return holder, since, true, nil
}

func wrapHolderErr(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("pgidem: migrations: read %s: %w", LockTable, err)
}
