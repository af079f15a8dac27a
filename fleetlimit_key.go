package fleetguard

import (
	"net"
	"net/http"
	"net/textproto"
	"os"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"golang.org/x/net/http/httpguts"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// A zone key is compiled once, at Provision. The forms a rate-limit key
// usually takes are read straight off the request, without Caddy's replacer
// (which scans the template, boxes the value in an interface and copies it
// into a new string on every request). Each reads exactly what Caddy v2.11's
// HTTP replacer (modules/caddyhttp/replacer.go) renders for the same
// placeholder, keyform_test.go checks that against the real replacer:
//
//	a literal (no brace)               the literal
//	{http.request.header.NAME}         the field's values joined with ","; "" if absent
//	{http.request.remote.host}         the host of r.RemoteAddr (the immediate peer; "" before a
//	                                   completed TLS handshake, RemoteAddr itself if it has no port)
//	{http.request.cookie.NAME}         the first valid cookie whose name equals NAME ignoring case
//	{http.request.uri.query.NAME}      the parameter's decoded values joined with ","
//	{http.vars.NAME}                   the variable, e.g. {http.vars.client_ip} (Caddyfile {client_ip})
//
// The Caddyfile shorthands {header.NAME}, {cookie.NAME}, {query.NAME},
// {remote_host} and {client_ip} arrive here expanded to these. Anything else
// (several placeholders, text around one, another placeholder, an escaped
// brace) goes through the replacer. The one way the two could
// differ: the replacer consults values set with repl.Set before its HTTP
// provider, so a handler that Set one of these names would be seen by it and
// not here; none of Caddy's does (a later provider, such as map's, is
// consulted after the HTTP one, which already answers these names).
type keyForm uint8

const (
	keyByReplacer keyForm = iota
	keyLiteral
	keyHeader
	keyRemoteHost
	keyCookie
	keyQuery
	keyVar
)

// keyResolver is a compiled zone key.
type keyResolver struct {
	form keyForm
	// arg is the key itself for keyLiteral, the canonical field name for
	// keyHeader, the cookie, parameter or variable name otherwise.
	arg string
	// template is the configured key, for the replacer wherever the form
	// declines (keyByReplacer always).
	template string
}

const (
	headerPrefix = "http.request.header."
	cookiePrefix = "http.request.cookie."
	queryPrefix  = "http.request.uri.query."
	varsPrefix   = "http.vars."
)

// The standard library's caps on cookies and query parameters per request,
// past which it parses none (net/http defaultCookieMaxNum, net/url
// defaultMaxParams). A request over a cap, or a process whose GODEBUG moves
// one, is left to the replacer, which applies the library's own rule.
const (
	maxCookies     = 3000
	maxQueryParams = 10000
)

// compileKey compiles a zone's key template.
func compileKey(template string) keyResolver {
	k := keyResolver{form: keyByReplacer, template: template}
	if !strings.ContainsAny(template, "{}") {
		k.form, k.arg = keyLiteral, template
		return k
	}
	if len(template) < 2 || template[0] != '{' || template[len(template)-1] != '}' {
		return k
	}
	name := template[1 : len(template)-1]
	if strings.ContainsAny(name, "{}\\") {
		return k
	}
	godebug := os.Getenv("GODEBUG")
	switch {
	case name == "http.request.remote.host":
		k.form = keyRemoteHost
	case strings.HasPrefix(name, headerPrefix):
		k.form, k.arg = keyHeader, textproto.CanonicalMIMEHeaderKey(name[len(headerPrefix):])
	case strings.HasPrefix(name, cookiePrefix) && !strings.Contains(godebug, "httpcookiemaxnum"):
		k.form, k.arg = keyCookie, name[len(cookiePrefix):]
	case strings.HasPrefix(name, queryPrefix) && !strings.Contains(godebug, "urlmaxqueryparams"):
		k.form, k.arg = keyQuery, name[len(queryPrefix):]
	case strings.HasPrefix(name, varsPrefix):
		k.form, k.arg = keyVar, name[len(varsPrefix):]
	}
	return k
}

// hash returns the digest of r's key. It allocates only where the key has to
// be assembled and is longer than a stack buffer, or goes through the
// replacer.
func (k *keyResolver) hash(r *http.Request) keyhash.Hash {
	var scratch [128]byte
	key, built := k.resolve(r, scratch[:0])
	if built != nil {
		return keyhash.OfBytes(built)
	}
	return keyhash.Of(key)
}

// resolve returns r's key, either as a string that aliases the request, the
// config or a Caddy variable (built nil), or, where the key had to be
// assembled (a header given several times, an escaped query value), as bytes
// appended to scratch.
func (k *keyResolver) resolve(r *http.Request, scratch []byte) (key string, built []byte) {
	switch k.form {
	case keyLiteral:
		return k.arg, nil
	case keyHeader:
		return joinValues(r.Header[k.arg], scratch)
	case keyRemoteHost:
		return remoteHost(r), nil
	case keyCookie:
		if v, ok := cookieValue(r.Header["Cookie"], k.arg); ok {
			return v, nil
		}
	case keyQuery:
		if key, built, ok := queryValue(r.URL.RawQuery, k.arg, scratch); ok {
			return key, built
		}
	case keyVar:
		return caddy.ToString(caddyhttp.GetVar(r.Context(), k.arg)), nil
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	return repl.ReplaceAll(k.template, ""), nil
}

// joinValues is strings.Join(vals, ","), assembling into scratch only when
// there are several.
func joinValues(vals []string, scratch []byte) (string, []byte) {
	switch len(vals) {
	case 0:
		return "", nil
	case 1:
		return vals[0], nil
	}
	for i, v := range vals {
		if i > 0 {
			scratch = append(scratch, ',')
		}
		scratch = append(scratch, v...)
	}
	return "", scratch
}

// remoteHost is {http.request.remote.host}: the peer's host, nothing before
// the TLS handshake completed (QUIC early data can spoof it), the address
// itself when it has no port (a Unix socket).
func remoteHost(r *http.Request) string {
	if r.TLS != nil && !r.TLS.HandshakeComplete {
		return ""
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// cookieValue is {http.request.cookie.NAME}: the value of the first cookie,
// in r.Cookies() order, whose name equals name ignoring case. It parses as
// net/http's readCookies does (a part without a token name or with an invalid
// value is no cookie; one pair of surrounding quotes is stripped) but without
// building the list. ok is false past the library's cookie cap.
func cookieValue(lines []string, name string) (value string, ok bool) {
	count := 0
	for _, line := range lines {
		count += strings.Count(line, ";") + 1
	}
	if count > maxCookies {
		return "", false
	}
	for _, line := range lines {
		line = textproto.TrimString(line)
		var part string
		for len(line) > 0 {
			part, line, _ = strings.Cut(line, ";")
			part = textproto.TrimString(part)
			if part == "" {
				continue
			}
			n, v, _ := strings.Cut(part, "=")
			n = textproto.TrimString(n)
			if !httpguts.ValidHeaderFieldName(n) || !strings.EqualFold(n, name) {
				continue
			}
			if v, valid := cookieValueOf(v); valid {
				return v, true
			}
		}
	}
	return "", true
}

// cookieValueOf is net/http's parseCookieValue with quotes allowed.
func cookieValueOf(raw string) (string, bool) {
	if len(raw) > 1 && raw[0] == '"' && raw[len(raw)-1] == '"' {
		raw = raw[1 : len(raw)-1]
	}
	for i := 0; i < len(raw); i++ {
		if b := raw[i]; b < 0x20 || b >= 0x7f || b == '"' || b == ';' || b == '\\' {
			return "", false
		}
	}
	return raw, true
}

// queryValue is {http.request.uri.query.NAME}: the values of the parameters
// named name, decoded, joined with ",", where url.ParseQuery keeps a pair
// (one with a semicolon or a malformed escape in its name or value is
// dropped). A single value without escapes is returned as a substring of the
// query; otherwise the key is assembled into scratch. ok is false past the
// library's parameter cap.
func queryValue(query, name string, scratch []byte) (key string, built []byte, ok bool) {
	if strings.Count(query, "&")+1 > maxQueryParams {
		return "", nil, false
	}
	var first string
	found := 0
	for query != "" {
		var pair string
		pair, query, _ = strings.Cut(query, "&")
		if pair == "" || strings.Contains(pair, ";") {
			continue
		}
		k, v, _ := strings.Cut(pair, "=")
		if !validEscapes(k) || !validEscapes(v) || !unescapesTo(k, name) {
			continue
		}
		found++
		switch found {
		case 1:
			first = v
			continue
		case 2:
			built = appendUnescaped(scratch, first)
		}
		built = appendUnescaped(append(built, ','), v)
	}
	switch {
	case found == 1 && strings.ContainsAny(first, "%+"):
		return "", appendUnescaped(scratch, first), true
	case found == 1:
		return first, nil, true
	}
	return "", built, true
}

// validEscapes reports whether every % in s starts a two-digit hex escape,
// as url.QueryUnescape requires.
func validEscapes(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == '%' {
			if i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2]) {
				return false
			}
			i += 2
		}
	}
	return true
}

// unescapesTo reports whether url.QueryUnescape(s) == want; s has valid
// escapes.
func unescapesTo(s, want string) bool {
	j := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '%':
			c = unhex(s[i+1])<<4 | unhex(s[i+2])
			i += 2
		case '+':
			c = ' '
		}
		if j >= len(want) || want[j] != c {
			return false
		}
		j++
	}
	return j == len(want)
}

// appendUnescaped appends url.QueryUnescape(s) to dst; s has valid escapes.
// Its loop is unescapesTo's again: a shared per-byte decoder is not inlined
// (cost 97, budget 80), and these loops read every byte of a key.
func appendUnescaped(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '%':
			c = unhex(s[i+1])<<4 | unhex(s[i+2])
			i += 2
		case '+':
			c = ' '
		}
		dst = append(dst, c)
	}
	return dst
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case '0' <= c && c <= '9':
		return c - '0'
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10
	}
	return c - 'A' + 10
}
