package protocol

import (
	"hash/maphash"
	"sync/atomic"
)

// Order chooses the statement a Do call starts with (pgidem.Config.Order documents each).
type Order int

const (
	// OrderAdaptive starts each call with the indexed read or with the reserving insert,
	// whichever the recent calls of its namespace favour (orderStats).
	OrderAdaptive Order = iota
	// OrderReadFirst starts every call with the indexed read.
	OrderReadFirst
	// OrderReserveFirst starts every call with the reserving insert.
	OrderReserveFirst
)

// String returns "adaptive", "read-first" or "reserve-first".
func (o Order) String() string {
	switch o {
	case OrderReadFirst:
		return "read-first"
	case OrderReserveFirst:
		return "reserve-first"
	default:
		return "adaptive"
	}
}

const (
	// orderSlots is how many namespace estimates an engine keeps; namespaces share a slot
	// by hash, so the memory is fixed however many namespaces there are.
	orderSlots = 64
	// orderOne is a share of 1 in the estimates' fixed point.
	orderOne = 1 << 16
	// orderDecayShift sets the weight of the newest call in an estimate: 1/32, a memory of
	// about 32 calls.
	orderDecayShift = 5
	// readFirstShare is the share of calls finding a record above which calls read first.
	// Per call, reading first costs a read on a fresh key, and reserving first costs
	// about 0.7 of a read extra on an existing record (the reserving statement reads it
	// after its conflict) and saves a round trip: the break-even is near 0.6, and reserving
	// also lets concurrent fresh keys share a round. 0.7 keeps a half-and-half load,
	// whose estimate wanders by about 0.06, on the reserving side.
	readFirstShare = orderOne * 7 / 10
)

// orderStats estimates, per namespace, the recent share of calls that found a record
// (replays, in-progress or expired records): an exponentially weighted average over
// the calls' first statements. Updates race benignly: one lost update only delays the
// estimate. Safe for concurrent use.
type orderStats struct {
	seed  maphash.Seed
	share [orderSlots]atomic.Int32
}

func newOrderStats() *orderStats { return &orderStats{seed: maphash.MakeSeed()} }

func (s *orderStats) slot(namespace string) *atomic.Int32 {
	return &s.share[maphash.String(s.seed, namespace)%orderSlots]
}

// reserveFirst reports whether a call of namespace should start with the reserving insert.
func (s *orderStats) reserveFirst(namespace string) bool {
	return s.slot(namespace).Load() <= readFirstShare
}

// observe adds one call of namespace whose first statement found a record (found) or not.
func (s *orderStats) observe(namespace string, found bool) {
	slot := s.slot(namespace)
	old := slot.Load()
	target := int32(0)
	if found {
		target = orderOne
	}
	if next := old + (target-old)>>orderDecayShift; next != old {
		slot.Store(next)
	}
}
