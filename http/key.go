package pgidemhttp

import (
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// parseKey reads the value of one Idempotency-Key field.
//
// The draft defines the field as a Structured Field Item whose value is a String (RFC 8941,
// section 3.3.3). That is printable ASCII between double quotes, with \" and \\ as the
// only escapes. Parameters may follow; they carry nothing for idempotency and are
// ignored. Many clients send the key without quotes (the older, Stripe-style header), so a
// value that does not start with a double quote is accepted as the key itself when it is
// printable ASCII without spaces, quotes, backslashes, commas or semicolons. Either way
// the key must not be empty.
func parseKey(field string) (string, error) {
	v := strings.Trim(field, " \t") // optional whitespace around a field value (RFC 9110, 5.5)
	if v == "" {
		return "", errors.New("the Idempotency-Key field is empty")
	}
	if v[0] != '"' {
		for i := 0; i < len(v); i++ {
			if c := v[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\\' || c == ',' || c == ';' {
				return "", fmt.Errorf("the Idempotency-Key value holds %s at byte %d; send printable ASCII, as a quoted string (RFC 8941)", describeByte(c), i)
			}
		}
		return v, nil
	}
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			if i+1 == len(v) || (v[i+1] != '"' && v[i+1] != '\\') {
				return "", fmt.Errorf("the Idempotency-Key string has an invalid escape at byte %d: only \\\" and \\\\ are allowed", i)
			}
			i++
			b.WriteByte(v[i])
		case c == '"':
			if err := checkParams(v[i+1:]); err != nil {
				return "", err
			}
			if b.Len() == 0 {
				return "", errors.New("the Idempotency-Key string is empty")
			}
			return b.String(), nil
		case c < ' ' || c >= 0x7f:
			return "", fmt.Errorf("the Idempotency-Key string holds %s at byte %d; a structured field string is printable ASCII", describeByte(c), i)
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("the Idempotency-Key string has no closing double quote")
}

// checkParams accepts what may follow an Item's closing quote: nothing but optional
// whitespace, or parameters. Parameters are ";" *SP key [ "=" bare-item ] (RFC 8941,
// section 3.1.2), with keys of lower-case letters, digits, "_", "-", "." and "*". Their
// values are checked for shape only and not interpreted.
func checkParams(rest string) error {
	bad := errors.New("the Idempotency-Key field holds more than one value or text after the closing double quote")
	for rest != "" && rest[0] == ';' {
		rest = strings.TrimLeft(rest[1:], " ")
		n := 0
		for n < len(rest) && (isLower(rest[n]) || rest[n] == '*' || (n > 0 && (isDigit(rest[n]) || strings.IndexByte("_-.", rest[n]) >= 0))) {
			n++
		}
		if n == 0 {
			return errors.New("the Idempotency-Key field has a parameter without a valid name")
		}
		rest = rest[n:]
		if rest == "" || rest[0] != '=' {
			continue
		}
		rest = rest[1:]
		if rest != "" && rest[0] == '"' {
			end := 1
			for ; end < len(rest) && rest[end] != '"'; end++ {
				if rest[end] == '\\' {
					end++
				}
			}
			if end >= len(rest) {
				return errors.New("the Idempotency-Key field has a parameter string without a closing double quote")
			}
			rest = rest[end+1:]
			continue
		}
		// An integer, decimal, token, byte sequence or boolean: the characters they use.
		n = 0
		for n < len(rest) && rest[n] > ' ' && rest[n] < 0x7f && strings.IndexByte(`",;()<>@[\]{}`, rest[n]) < 0 {
			n++
		}
		if n == 0 {
			return errors.New("the Idempotency-Key field has a parameter without a value after '='")
		}
		rest = rest[n:]
	}
	if strings.TrimLeft(rest, " \t") != "" {
		return bad
	}
	return nil
}

func isLower(c byte) bool { return c >= 'a' && c <= 'z' }
func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// describeByte names a byte for an error message.
func describeByte(c byte) string {
	if c >= ' ' && c < 0x7f {
		return strconv.QuoteRune(rune(c))
	}
	return fmt.Sprintf("byte 0x%02x", c)
}

// recordKeyPrefixLen is the length of a record key's principal part: 22 characters of
// digest and a colon.
const recordKeyPrefixLen = 23

// RecordKey returns the key a [Middleware] stores a request's record under, in the
// namespace of its [Config.Namespace]: a digest of the caller's principal, a colon, and
// the Idempotency-Key, e.g. "hJh8GBdyoSfsMEPkPNfIgQ:8e03978e-40d5-43e8-bc93-6894a57f9324".
// The digest (the first 16 bytes of the principal's SHA-256, base64url without padding)
// has a fixed length, so a principal of any length or content leaves the same room for
// the key, and no two principals' keys can meet. The principal itself (an e-mail address,
// a token subject) is not written to the record, only this unsalted digest, which a
// dictionary of likely principals can reverse. Use it to find a request's record with
// [pgidem.Coordinator.Lookup] or in SQL.
func RecordKey(principal, key string) string {
	sum := sha256.Sum256([]byte(principal))
	return digestKey(sum[:], key)
}

// digestKey joins the first 16 bytes of a SHA-256 sum, base64url without padding (22
// characters), and key with a colon: recordKeyPrefixLen bytes before the key.
func digestKey(sum []byte, key string) string {
	return base64.RawURLEncoding.EncodeToString(sum[:16]) + ":" + key
}
