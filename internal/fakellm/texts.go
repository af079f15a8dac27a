package fakellm

import (
	"encoding/base64"
	"fmt"
	"math/rand/v2"
	"strings"
)

// Texts are answers of every density, size bytes each (whole characters):
// o200k counts English at about 0.23 tokens a byte, Go code at 0.3, tool-call
// JSON at 0.4, a CSV of numbers at 0.6, random base64 at 0.68, and CJK at
// about a token a character. They are the same on every call.
func Texts(size int) map[string]string {
	rng := rand.New(rand.NewPCG(1, 2))
	var csv, b64 strings.Builder
	for csv.Len() < size {
		fmt.Fprintf(&csv, "2026-%02d-%02d,%d.%02d,%d,-0.%04d\n", rng.IntN(12)+1, rng.IntN(28)+1, rng.IntN(100000), rng.IntN(100), rng.IntN(1000), rng.IntN(10000))
	}
	raw := make([]byte, size*3/4)
	for i := range raw {
		raw[i] = byte(rng.Uint32())
	}
	b64.WriteString(base64.StdEncoding.EncodeToString(raw))
	repeat := func(s string) string {
		r := strings.Repeat(s, size/len(s)+1)[:size]
		return strings.ToValidUTF8(r, "")
	}
	return map[string]string{
		"english": repeat("The river runs north through eleven countries before it reaches the sea, and its delta feeds millions. "),
		"csv":     csv.String()[:size],
		"code":    repeat("func (s *server) handle(w http.ResponseWriter, r *http.Request) {\n\tif err := s.check(r); err != nil {\n\t\thttp.Error(w, err.Error(), 400)\n\t}\n}\n"),
		"cjk":     repeat("日本語のテキストは一文字ずつ数えられる。中文的文本也是如此。한국어도 마찬가지다。"),
		"base64":  b64.String(),
		"json":    repeat(`{"city":"Paris","days":[1,2,3],"units":"metric","limit":25,"coords":[48.8566,2.3522]}`),
	}
}
