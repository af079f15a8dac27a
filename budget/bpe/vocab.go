// Package bpe counts the tokens of a text as OpenAI's public tokenizers
// (o200k_base, cl100k_base) encode it, without allocating: the split of the
// text into pieces by the vocabulary's pattern, written out by hand, and
// byte-pair merges by rank over a compact table of the vocabulary.
//
// A count is what the tokenizer makes of the text as one string. A model
// may bill a text it streamed at another count (a tokenization that is not
// the canonical one, framing tokens around a tool call): what the count is
// trusted for is the caller's decision (llmbudget: only for a model whose
// answers have shown their bill within it, and never again once one has
// not).
package bpe

import (
	"fmt"
	"hash/maphash"
	"sync"
	"sync/atomic"

	"github.com/tiktoken-go/tokenizer/codec"
)

// Vocabulary is one of the public tokenizers.
type Vocabulary uint8

const (
	// O200k is o200k_base: GPT-4o, GPT-4.1, GPT-5, the o-series.
	O200k Vocabulary = iota + 1
	// Cl100k is cl100k_base: GPT-4, GPT-3.5 Turbo, text-embedding-3.
	Cl100k
)

// Names are the vocabularies' names, as tiktoken spells them.
var names = [...]string{O200k: "o200k_base", Cl100k: "cl100k_base"}

func (v Vocabulary) String() string {
	if int(v) < len(names) && names[v] != "" {
		return names[v]
	}
	return fmt.Sprintf("Vocabulary(%d)", v)
}

// ParseVocabulary is the vocabulary named name ("o200k_base",
// "cl100k_base").
func ParseVocabulary(name string) (Vocabulary, bool) {
	for v, n := range names {
		if n != "" && n == name {
			return Vocabulary(v), true
		}
	}
	return 0, false
}

// Counter counts tokens of one vocabulary. Its methods are safe for
// concurrent use; a Count allocates nothing.
type Counter struct {
	vocab Vocabulary
	// data holds every token's bytes, by rank: token r is
	// data[start[r]:start[r+1]].
	data  []byte
	start []uint32
	// slots is an open-addressing table of ranks+1 by the hash of their
	// bytes (0: empty), len a power of two at least twice the tokens.
	slots []uint32
	mask  uint64
	seed  maphash.Seed
}

var (
	loadOnce  [len(names)]sync.Once
	loaded    [len(names)]atomic.Pointer[Counter]
	startOnce [len(names)]sync.Once
)

// Load returns the counter of v, building it on the first call (tens of
// milliseconds, and a few MB of heap: MemoryBytes).
func Load(v Vocabulary) *Counter {
	if v == 0 || int(v) >= len(names) {
		return nil
	}
	loadOnce[v].Do(func() { loaded[v].Store(build(v)) })
	return loaded[v].Load()
}

// Loaded returns the counter of v once it is built, and nil until then:
// its first call starts the building on a goroutine of its own, so that no
// caller waits for it.
func Loaded(v Vocabulary) *Counter {
	if v == 0 || int(v) >= len(names) {
		return nil
	}
	if c := loaded[v].Load(); c != nil {
		return c
	}
	startOnce[v].Do(func() { go Load(v) })
	return nil
}

// build reads the vocabulary's tokens out of tiktoken-go's codec (by
// decoding each rank) into a compact table. The codec's own map stays in
// its package; the Codec, with its reverse table, is dropped.
func build(v Vocabulary) *Counter {
	var c *codec.Codec
	switch v {
	case O200k:
		c = codec.NewO200kBase()
	case Cl100k:
		c = codec.NewCl100kBase()
	}
	t := &Counter{vocab: v, seed: maphash.MakeSeed()}
	id := make([]uint, 1)
	for r := uint(0); ; r++ {
		id[0] = r
		tok, err := c.Decode(id)
		if err != nil {
			// The ranks are dense up to the special tokens: a gap ends
			// them (o200k has none below 199,998; cl100k none below
			// 100,256).
			break
		}
		t.start = append(t.start, uint32(len(t.data)))
		t.data = append(t.data, tok...)
	}
	n := len(t.start)
	t.start = append(t.start, uint32(len(t.data)))
	size := 1
	for size < 2*n {
		size <<= 1
	}
	t.slots, t.mask = make([]uint32, size), uint64(size-1)
	for r := range n {
		i := maphash.Bytes(t.seed, t.token(uint32(r))) & t.mask
		for t.slots[i] != 0 {
			i = (i + 1) & t.mask
		}
		t.slots[i] = uint32(r) + 1
	}
	// Shrink what append left over.
	t.data = append([]byte(nil), t.data...)
	t.start = append([]uint32(nil), t.start...)
	return t
}

// Vocabulary is the vocabulary t counts by.
func (t *Counter) Vocabulary() Vocabulary { return t.vocab }

// Tokens is the size of the vocabulary, special tokens aside.
func (t *Counter) Tokens() int { return len(t.start) - 1 }

// MemoryBytes is the heap t holds.
func (t *Counter) MemoryBytes() int { return cap(t.data) + 4*cap(t.start) + 4*cap(t.slots) }

func (t *Counter) token(r uint32) []byte { return t.data[t.start[r]:t.start[r+1]] }

// rank is the rank of the token b, if b is one.
func (t *Counter) rank(b []byte) (uint32, bool) {
	i := maphash.Bytes(t.seed, b) & t.mask
	for {
		s := t.slots[i]
		if s == 0 {
			return 0, false
		}
		if r := s - 1; string(t.token(r)) == string(b) {
			return r, true
		}
		i = (i + 1) & t.mask
	}
}
