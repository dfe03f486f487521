package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"
	"time"
)

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("pgidem: write json: %w", err)
	}
	return nil
}

// table writes aligned columns.
type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)}
	t.row(header...)
	return t
}

// row writes one row; tabs and newlines in cells are replaced so they cannot break the
// layout.
func (t *table) row(cells ...string) {
	clean := make([]string, len(cells))
	for i, c := range cells {
		clean[i] = strings.NewReplacer("\t", " ", "\n", " ", "\r", " ").Replace(c)
	}
	fmt.Fprintln(t.tw, strings.Join(clean, "\t"))
}

func (t *table) flush() error {
	if err := t.tw.Flush(); err != nil {
		return fmt.Errorf("pgidem: write output: %w", err)
	}
	return nil
}

// humanDuration formats a non-negative number of seconds with its two most significant
// units: 42s, 5m3s, 4h5m, 3d4h.
func humanDuration(seconds float64) string {
	s := int64(math.Round(math.Abs(seconds)))
	days, s := s/86400, s%86400
	hours, s := s/3600, s%3600
	minutes, s := s/60, s%60
	switch {
	case days > 0:
		return fmt.Sprintf("%dd%dh", days, hours)
	case hours > 0:
		return fmt.Sprintf("%dh%dm", hours, minutes)
	case minutes > 0:
		return fmt.Sprintf("%dm%ds", minutes, s)
	default:
		return fmt.Sprintf("%ds", s)
	}
}

// remaining formats a time left: "in 5m3s", or "expired 2m ago" when negative.
func remaining(seconds float64) string {
	if seconds <= 0 {
		return "expired " + humanDuration(seconds) + " ago"
	}
	return "in " + humanDuration(seconds)
}

// timestamp formats a time in UTC.
func timestamp(t time.Time) string {
	return t.UTC().Format(time.RFC3339)
}
