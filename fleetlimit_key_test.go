package fleetguard

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// keyRequest describes one request of the differential tests.
type keyRequest struct {
	name   string
	remote string
	tls    *tls.ConnectionState
	header http.Header // set as is: keys are not canonicalised
	query  string      // RawQuery as the client sent it
	vars   map[string]any
}

// prepared builds the request as Caddy's server hands it to a handler: its
// own HTTP replacer, the vars table with client_ip, the original request.
func (kr keyRequest) prepared() (*http.Request, *caddy.Replacer) {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = kr.remote
	r.TLS = kr.tls
	r.Header = kr.header
	if r.Header == nil {
		r.Header = http.Header{}
	}
	r.URL.RawQuery = kr.query
	repl := caddy.NewReplacer()
	r = caddyhttp.PrepareRequest(r, repl, nil, &caddyhttp.Server{})
	for k, v := range kr.vars {
		caddyhttp.SetVar(r.Context(), k, v)
	}
	return r, repl
}

var keyRequests = []keyRequest{
	{name: "bare", remote: "192.0.2.1:1234"},
	{name: "one header", remote: "192.0.2.1:1234", header: http.Header{"X-Api-Key": {"sk-live-0123"}}},
	{name: "header several times", remote: "192.0.2.1:1234", header: http.Header{"X-Api-Key": {"a", "b", "c"}}},
	{name: "header empty", remote: "192.0.2.1:1234", header: http.Header{"X-Api-Key": {""}}},
	{name: "header empty twice", remote: "192.0.2.1:1234", header: http.Header{"X-Api-Key": {"", ""}}},
	{name: "header with comma and spaces", remote: "192.0.2.1:1234", header: http.Header{"X-Api-Key": {" a, b ", "c"}}},
	{name: "header long, several", remote: "192.0.2.1:1234", header: http.Header{"X-Api-Key": {strings.Repeat("k", 200), strings.Repeat("q", 100)}}},
	{name: "header under a non-canonical key", remote: "192.0.2.1:1234", header: http.Header{"x-api-key": {"lower"}}},
	{name: "IPv6 peer", remote: "[2001:db8::1]:443"},
	{name: "IPv6 peer with zone", remote: "[fe80::1%eth0]:8080"},
	{name: "peer without port", remote: "192.0.2.7"},
	{name: "unix socket peer", remote: "@"},
	{name: "no peer", remote: ""},
	{name: "TLS handshake incomplete", remote: "192.0.2.1:1234", tls: &tls.ConnectionState{}},
	{name: "TLS handshake complete", remote: "192.0.2.1:1234", tls: &tls.ConnectionState{HandshakeComplete: true}},
	{name: "cookie", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session=abc"}}},
	{name: "cookie among others", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"a=1; session=\"quoted\"; b=2"}}},
	{name: "cookie name in another case", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"SESSION=upper; session=lower"}}},
	{name: "cookie invalid value first", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session=a\\b; session=ok"}}},
	{name: "cookie over two lines", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"a=1", " session=second ; x=y"}}},
	{name: "cookie quoted empty", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {`session=""`}}},
	{name: "cookie lone quote", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {`session="`}}},
	{name: "cookie without value", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session"}}},
	{name: "cookie spaced", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"  session = v w ;;"}}},
	{name: "cookie with bad name", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"se ssion=1; séssion=2; session=3"}}},
	{name: "cookie value not ASCII", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session=caf\xc3\xa9; session=ok"}}},
	{name: "cookie with equals in value", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session=a=b"}}},
	{name: "cookies over the cap", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session=1" + strings.Repeat(";x=1", maxCookies)}}},
	{name: "cookies at the cap", remote: "192.0.2.1:1234", header: http.Header{"Cookie": {"session=1" + strings.Repeat(";x=1", maxCookies-1)}}},
	{name: "query", remote: "192.0.2.1:1234", query: "k=v"},
	{name: "query several", remote: "192.0.2.1:1234", query: "k=a&x=1&k=b&k="},
	{name: "query escaped", remote: "192.0.2.1:1234", query: "k=a%20b+c%2B"},
	{name: "query plus", remote: "192.0.2.1:1234", query: "k=a+b"},
	{name: "query escaped twice", remote: "192.0.2.1:1234", query: "k=%41&k=b+"},
	{name: "query bad escape dropped", remote: "192.0.2.1:1234", query: "k=%zz&k=ok&k=%4&k=%"},
	{name: "query semicolon dropped", remote: "192.0.2.1:1234", query: "k=1;x=2&k=3"},
	{name: "query escaped name", remote: "192.0.2.1:1234", query: "%6B=enc&k%=bad&%6b%=bad"},
	{name: "query name in another case", remote: "192.0.2.1:1234", query: "K=upper"},
	{name: "query without value", remote: "192.0.2.1:1234", query: "k&&k="},
	{name: "query empty name", remote: "192.0.2.1:1234", query: "=v&k=w"},
	{name: "query UTF-8", remote: "192.0.2.1:1234", query: "k=%e2%82%ac&k=\xe2\x82\xac"},
	{name: "query plus name", remote: "192.0.2.1:1234", query: "a+b=plus&a%20b=space"},
	{name: "query over the cap", remote: "192.0.2.1:1234", query: "k=v" + strings.Repeat("&x=1", maxQueryParams)},
	{name: "query at the cap", remote: "192.0.2.1:1234", query: "k=v" + strings.Repeat("&x=1", maxQueryParams-1)},
	{name: "vars", remote: "[2001:db8::2]:9", vars: map[string]any{"tenant": "acme", "n": 42, "nothing": nil}},
}

// Keys compiled to a fast form, with the form they must compile to: a test
// that passed because a form silently fell back to the replacer would show
// nothing.
var fastKeys = []struct {
	template string
	form     keyForm
}{
	{"static-key", keyLiteral},
	{"", keyLiteral},
	{"{http.request.header.X-API-Key}", keyHeader},
	{"{http.request.header.x-api-key}", keyHeader},
	{"{http.request.header.Cookie}", keyHeader},
	{"{http.request.header.}", keyHeader},
	{"{http.request.remote.host}", keyRemoteHost},
	{"{http.request.cookie.session}", keyCookie},
	{"{http.request.cookie.SESSION}", keyCookie},
	{"{http.request.cookie.}", keyCookie},
	{"{http.request.uri.query.k}", keyQuery},
	{"{http.request.uri.query.}", keyQuery},
	{"{http.request.uri.query.a b}", keyQuery},
	{"{http.request.uri.query.a+b}", keyQuery},
	{"{http.vars.client_ip}", keyVar},
	{"{http.vars.tenant}", keyVar},
	{"{http.vars.n}", keyVar},
	{"{http.vars.nothing}", keyVar},
	{"{http.vars.absent}", keyVar},
}

// Keys left to the replacer; resolving them must still give its answer.
var replacerKeys = []string{
	"{http.request.remote.host}:{http.request.header.X-API-Key}",
	"user-{http.request.header.X-API-Key}",
	"{http.request.method}",
	"{http.request.remote.host/24}",
	"{http.request.remote.ip}",
	"\\{http.request.header.X-API-Key\\}",
	"{http.request.header.X-API-Key\\}",
	"{unclosed",
	"closed}",
	"{}",
	"{{http.request.header.X-API-Key}}",
}

// TestKeyFormsMatchTheReplacer resolves every key on every request both ways:
// the compiled form and Caddy's replacer, as the handler did before.
func TestKeyFormsMatchTheReplacer(t *testing.T) {
	type key struct {
		template string
		form     keyForm
	}
	keys := make([]key, 0, len(fastKeys)+len(replacerKeys))
	for _, k := range fastKeys {
		keys = append(keys, key(k))
	}
	for _, k := range replacerKeys {
		keys = append(keys, key{k, keyByReplacer})
	}
	for _, k := range keys {
		resolver := compileKey(k.template)
		if resolver.form != k.form {
			t.Errorf("%q compiles to form %d, want %d", k.template, resolver.form, k.form)
			continue
		}
		for _, kr := range keyRequests {
			r, repl := kr.prepared()
			want := repl.ReplaceAll(k.template, "")
			if got := resolvedKey(&resolver, r); got != want {
				t.Errorf("%q on %s: fast %q, replacer %q", k.template, kr.name, got, want)
			}
			if resolver.hash(r) != keyhash.Of(want) {
				t.Errorf("%q on %s: digest differs from the replacer's key's", k.template, kr.name)
			}
		}
	}
}

// resolvedKey is the key resolve yields, as a string.
func resolvedKey(k *keyResolver, r *http.Request) string {
	key, built := k.resolve(r, nil)
	if built != nil {
		return string(built)
	}
	return key
}

// TestKeyFormsDoNotAllocate covers the usual requests: one header value, a
// cookie, an unescaped query value, the peer, client_ip.
func TestKeyFormsDoNotAllocate(t *testing.T) {
	kr := keyRequest{
		remote: "[2001:db8::1]:443",
		header: http.Header{"X-Api-Key": {"sk-live-0123456789abcdef"}, "Cookie": {"theme=dark; session=s3cr3t"}},
		query:  "page=2&k=tenant-7",
	}
	r, _ := kr.prepared()
	for _, k := range fastKeys {
		resolver := compileKey(k.template)
		if n := testing.AllocsPerRun(100, func() { _ = resolver.hash(r) }); n != 0 {
			t.Errorf("%q allocates %v times per request, want 0", k.template, n)
		}
	}
}

// FuzzKeyFormsMatchTheReplacer varies the inputs the fast forms parse.
func FuzzKeyFormsMatchTheReplacer(f *testing.F) {
	for _, kr := range keyRequests {
		if len(kr.query) > 200 {
			continue
		}
		f.Add(kr.remote, strings.Join(kr.header["X-Api-Key"], "\n"), strings.Join(kr.header["Cookie"], "\n"), kr.query)
	}
	resolvers := make([]keyResolver, len(fastKeys))
	for i, k := range fastKeys {
		resolvers[i] = compileKey(k.template)
	}
	f.Fuzz(func(t *testing.T, remote, apiKeys, cookies, query string) {
		kr := keyRequest{remote: remote, query: query, header: http.Header{}}
		if apiKeys != "" {
			kr.header["X-Api-Key"] = strings.Split(apiKeys, "\n")
		}
		if cookies != "" {
			kr.header["Cookie"] = strings.Split(cookies, "\n")
		}
		r, repl := kr.prepared()
		for i := range resolvers {
			want := repl.ReplaceAll(fastKeys[i].template, "")
			if got := resolvedKey(&resolvers[i], r); got != want {
				t.Fatalf("%q: fast %q, replacer %q", fastKeys[i].template, got, want)
			}
		}
	})
}

// BenchmarkKeyForms is the key alone per form, against the replacer it
// replaces.
func BenchmarkKeyForms(b *testing.B) {
	kr := keyRequest{
		remote: "[2001:db8::1]:443",
		header: http.Header{"X-Api-Key": {"sk-live-0123456789abcdef"}, "Cookie": {"theme=dark; session=s3cr3t"}},
		query:  "page=2&k=tenant-7",
	}
	r, repl := kr.prepared()
	for _, template := range []string{
		"{http.request.header.X-API-Key}", "{http.request.remote.host}", "{http.request.cookie.session}",
		"{http.request.uri.query.k}", "{http.vars.client_ip}",
	} {
		resolver := compileKey(template)
		b.Run(strings.TrimPrefix(strings.Trim(template, "{}"), "http.")+"/fast", func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				_ = resolver.hash(r)
			}
		})
		b.Run(strings.TrimPrefix(strings.Trim(template, "{}"), "http.")+"/replacer", func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				_ = keyhash.Of(repl.ReplaceAll(template, ""))
			}
		})
	}
}

// TestKeyShorthandsThroughCaddy runs Caddyfile keys written with the
// shorthands through a real Caddy: each expands to a form read without the
// replacer, and requests are counted under the key they carry.
func TestKeyShorthandsThroughCaddy(t *testing.T) {
	port := freePort(t)
	caddyfile := testCaddyfile{Port: port, FleetLimit: []string{
		"zone by_query {\n key {query.tenant}\n events 1\n window 1m\n }",
		"zone by_cookie {\n key {cookie.session}\n events 1\n window 1m\n }",
	}}.String()
	cfg, _, err := adaptCaddyfile(strings.ReplaceAll(caddyfile, "{ADMIN}", "localhost:0"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"key":"{http.request.uri.query.tenant}"`, `"key":"{http.request.cookie.session}"`} {
		if !strings.Contains(string(cfg), want) {
			t.Fatalf("adapted config lacks %s:\n%s", want, cfg)
		}
	}
	for _, template := range []string{"{http.request.uri.query.tenant}", "{http.request.cookie.session}", "{http.request.header.X-API-Key}", "{http.request.remote.host}", "{http.vars.client_ip}"} {
		if compileKey(template).form == keyByReplacer {
			t.Fatalf("%s goes through the replacer", template)
		}
	}
	startCaddy(t, caddyfile)
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	for i, c := range []struct {
		query, cookie string
		want          int
	}{
		{"tenant=a", "session=1", http.StatusOK},
		{"tenant=a", "session=2", http.StatusTooManyRequests}, // tenant a spent
		{"tenant=b", "SESSION=1", http.StatusTooManyRequests}, // session 1 spent: cookie names match ignoring case; a denial spends nothing
		{"tenant=%62", "session=3", http.StatusOK},            // %62 decodes to b, not yet spent
		{"tenant=b", "session=4", http.StatusTooManyRequests}, // now it is
		{"tenant=c", "session=5", http.StatusOK},
	} {
		resp, _ := get(t, url+"?"+c.query, "Cookie: "+c.cookie)
		if resp.StatusCode != c.want {
			t.Fatalf("request %d (%s, %s): %d, want %d", i, c.query, c.cookie, resp.StatusCode, c.want)
		}
	}
}
