package pgidem_test

import "testing"

// crashChild runs the child half of the crash test when the test binary is re-executed for
// it, and reports whether it did.
func crashChild(m *testing.M) bool { return false }
