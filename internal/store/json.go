package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf16"
	"unicode/utf8"
)

// MaxJSONDepth is the deepest nesting of arrays and objects encoding/json decodes; a deeper
// value would be stored and then fail every replay.
const MaxJSONDepth = 10000

var (
	errNUL       = errors.New("contains a NUL character (\\u0000), which jsonb cannot store")
	errSurrogate = errors.New("contains an unpaired UTF-16 surrogate escape, which jsonb refuses")
)

// CheckJSON reports why b cannot be stored in a jsonb column and read back as it was: not
// JSON, larger than maxBytes, not valid UTF-8 (JSON allows it inside strings), a \u0000
// escape, an unpaired surrogate escape, a number outside numeric's range, or nesting
// deeper than [MaxJSONDepth]. Each would otherwise fail the statement, or store a value a
// replay cannot decode. replacement reports a \ufffd escape, which encoding/json also
// writes for invalid UTF-8 (the caller decides which it was). Results and inbox payloads
// are checked alike.
func CheckJSON(b []byte, maxBytes int) (replacement bool, err error) {
	if len(b) > maxBytes {
		return false, fmt.Errorf("is %d bytes of JSON, more than Config.MaxValueBytes (%d)", len(b), maxBytes)
	}
	if !json.Valid(b) {
		return false, errors.New("is not valid JSON")
	}
	if !utf8.Valid(b) {
		return false, errors.New("is not valid UTF-8")
	}
	depth := 0
	for i := 0; i < len(b); {
		n := 1
		switch c := b[i]; {
		case c == '"':
			var fffd bool
			if n, fffd, err = checkString(b[i:]); err != nil {
				return false, err
			}
			replacement = replacement || fffd
		case c == '-' || '0' <= c && c <= '9':
			var fits bool
			if n, fits = numericFits(b[i:]); !fits {
				return false, errors.New("contains a number outside Postgres's numeric range")
			}
		case c == '[' || c == '{':
			if depth++; depth > MaxJSONDepth {
				return false, fmt.Errorf("nests arrays and objects deeper than %d, which a replay cannot decode", MaxJSONDepth)
			}
		case c == ']' || c == '}':
			depth--
		}
		i += n
	}
	return replacement, nil
}

// Postgres numeric limits, in decimal digits (src/include/utils/numeric.h): the weight of
// the leading digit (NUMERIC_WEIGHT_MAX base-10000 digits) and the digits after the
// decimal point (NUMERIC_DSCALE_MAX), and the exponent bound of numeric input (INT_MAX/2).
const (
	numericMaxWeight   = 4*0x7FFF + 3 // 131071: up to 131072 digits before the point
	numericMaxScale    = 0x3FFF       // 16383
	numericMaxExponent = 1<<30 - 1    // INT_MAX/2, exclusive
)

// checkString checks the escapes of the JSON string at the start of b (valid JSON) and
// returns its length and whether it holds a \ufffd escape.
func checkString(b []byte) (n int, fffd bool, err error) {
	for i := 1; i < len(b); i++ {
		switch b[i] {
		case '"':
			return i + 1, fffd, nil
		case '\\':
			if b[i+1] != 'u' {
				i++ // skip the escaped character
				continue
			}
			unit := hex16(b[i+2 : i+6])
			i += 5
			switch {
			case unit == 0:
				return 0, false, errNUL
			case unit == 0xFFFD:
				fffd = true
			case utf16.IsSurrogate(unit) && unit < 0xDC00: // high: a low one must follow
				if i+6 < len(b) && b[i+1] == '\\' && b[i+2] == 'u' {
					if low := hex16(b[i+3 : i+7]); 0xDC00 <= low && low <= 0xDFFF {
						i += 6
						continue
					}
				}
				return 0, false, errSurrogate
			case utf16.IsSurrogate(unit):
				return 0, false, errSurrogate
			}
		}
	}
	return len(b), fffd, nil
}

// hex16 decodes the four hexadecimal digits of a \u escape (checked by json.Valid).
func hex16(h []byte) rune {
	var v rune
	for _, c := range h {
		switch {
		case c <= '9':
			c -= '0'
		case c >= 'a':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		v = v<<4 | rune(c)
	}
	return v
}

// numericFits returns the length of the JSON number at the start of b (valid JSON) and
// whether Postgres's numeric input accepts it.
func numericFits(b []byte) (int, bool) {
	i := 0
	if b[i] == '-' {
		i++
	}
	digits := func() (start, end int) {
		start = i
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
		return start, i
	}
	intStart, intEnd := digits()
	fracStart, fracEnd := i, i
	if i < len(b) && b[i] == '.' {
		i++
		fracStart, fracEnd = digits()
	}
	var exp int64
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		negative := b[i] == '-'
		if b[i] == '+' || b[i] == '-' {
			i++
		}
		expStart, expEnd := digits()
		for _, c := range b[expStart:expEnd] {
			exp = min(exp*10+int64(c-'0'), numericMaxExponent) // saturate: no overflow
		}
		if negative {
			exp = -exp
		}
	}
	if exp >= numericMaxExponent || exp <= -numericMaxExponent {
		return i, false
	}
	if scale := int64(fracEnd-fracStart) - exp; scale > numericMaxScale {
		return i, false
	}
	// The weight of the leading non-zero digit; zero has none.
	mantissa := [2][]byte{b[intStart:intEnd], b[fracStart:fracEnd]}
	leading := int64(intEnd - intStart - 1)
	for _, part := range mantissa {
		for _, c := range part {
			if c != '0' {
				return i, leading+exp <= numericMaxWeight
			}
			leading--
		}
	}
	return i, true
}
