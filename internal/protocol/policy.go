package protocol

import "time"

// LeaseMin is the shortest lease a call may use.
const LeaseMin = 100 * time.Millisecond

// InFlightPolicy says what a call does when the key's record is in progress under another
// holder with a live lease.
type InFlightPolicy int

const (
	// InFlightDefault (the zero value) means: use the coordinator's policy
	// ([Config.InFlight]), which itself defaults to [InFlightWait].
	InFlightDefault InFlightPolicy = iota
	// InFlightWait polls the record (backoff with jitter) until it completes (replay), is
	// released (reserve again) or its lease expires (takeover), bounded by the context and
	// the wait timeout, after which the call returns an [*InProgressError].
	InFlightWait
	// InFlightRaise returns an [*InProgressError] at once, with a retry-after hint taken
	// from the holder's lease.
	InFlightRaise
)

// String returns "wait", "raise" or "default".
func (p InFlightPolicy) String() string {
	switch p {
	case InFlightWait:
		return "wait"
	case InFlightRaise:
		return "raise"
	default:
		return "default"
	}
}
