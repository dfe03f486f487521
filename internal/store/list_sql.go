package store

// listStatements holds the statements operators' tools use to list and inspect records
// and inbox rows.
type listStatements struct{}

func newListStatements(schema string) listStatements {
	_ = schema
	return listStatements{}
}
