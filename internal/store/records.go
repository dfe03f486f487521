package store

import "context"

// ReadRecord reads the record of (namespace, key) in db. It returns pgx.ErrNoRows when
// there is none ([IsNoRows]) and the driver's error otherwise; the caller wraps it.
func (s *Statements) ReadRecord(ctx context.Context, db RowQuerier, namespace, key string) (*Row, error) {
	var r Row
	if err := db.QueryRow(ctx, s.Lookup, namespace, key).Scan(r.ScanTargets(false)...); err != nil {
		return nil, err
	}
	return &r, nil
}

// ForgetRecord deletes the record of (namespace, key) in one statement, unless force is
// false and the record is in progress under a live lease within its TTL. It returns the
// record as the statement saw it and whether it was deleted: a record not deleted is live,
// or was made live (or replaced) by a concurrent renewal or takeover after the
// statement's snapshot. It returns pgx.ErrNoRows when there is no record, and the
// driver's error otherwise (a serialization failure under REPEATABLE READ sessions:
// [IsSerializationFailure]).
func (s *Statements) ForgetRecord(ctx context.Context, db Executor, namespace, key string, force bool) (r *Row, deleted bool, err error) {
	r = &Row{}
	if err := db.QueryRow(ctx, s.Forget, namespace, key, force).Scan(append(r.ScanTargets(false), &deleted)...); err != nil {
		return nil, false, err
	}
	return r, deleted, nil
}
