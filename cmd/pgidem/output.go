package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"al.essio.dev/pkg/shellescape"
)

// printJSON writes v as indented JSON. <, > and & are written as they are, not escaped for
// HTML (\u003c …): the output is read by people and scripts, never embedded in a page.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		var me *json.MarshalerError
		var ue *json.UnsupportedValueError
		var te *json.UnsupportedTypeError
		if errors.As(err, &me) || errors.As(err, &ue) || errors.As(err, &te) {
			return fmt.Errorf("pgidem: encode json: %w", err)
		}
		return writeError(err)
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
		return writeError(err)
	}
	return nil
}

// quoteName formats a namespace, key, consumer or message id for a table cell: as it is when
// that reads unambiguously, else quoted in Go syntax (strconv.Quote), so that white space
// (a trailing space, two spaces), quotes and non-printing characters show. Quoted are: a
// name with white space, a quote character, a character that does not print, or invalid
// UTF-8, and the empty name and "-" (which tables print for no value). An unquoted name
// therefore never starts with '"'. --json output always has the exact text.
func quoteName(s string) string {
	if s == "" || s == "-" || !utf8.ValidString(s) ||
		strings.IndexFunc(s, func(r rune) bool { return unicode.IsSpace(r) || r == '"' || r == '\'' || !unicode.IsPrint(r) }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

// commandLine returns a pgidem command line a user can paste into a POSIX shell. Each
// argument is quoted as the shell needs it (shellescape's single quotes). "--" comes
// before the positional arguments, so that a key starting with '-' is not taken for a
// flag. An
// argument with a character that does not print, or invalid UTF-8, is written in bash's
// and zsh's $'…' form, whose escapes are Go's, so that it shows and pastes exactly.
func commandLine(flagsAndCommand []string, positional ...string) string {
	words := []string{"pgidem"}
	for _, arg := range flagsAndCommand {
		words = append(words, shellArg(arg))
	}
	if len(positional) > 0 {
		words = append(words, "--")
		for _, arg := range positional {
			words = append(words, shellArg(arg))
		}
	}
	return strings.Join(words, " ")
}

func shellArg(s string) string {
	if !utf8.ValidString(s) || strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) && r != ' ' }) >= 0 {
		q := strconv.Quote(s)
		return "$'" + strings.ReplaceAll(q[1:len(q)-1], "'", `\'`) + "'"
	}
	return shellescape.Quote(s)
}

// count formats n with the singular or plural noun: "1 record", "2 records", "0 records".
func count[N int | int64](n N, singular, plural string) string {
	if n == 1 {
		return "1 " + singular
	}
	return fmt.Sprintf("%d %s", n, plural)
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
