package bpe

import (
	"unicode"
	"unicode/utf8"
)

// The pieces a vocabulary's pattern splits a text into before the merges,
// by hand: a piece is matched where the last one ended, by the first
// alternative of the pattern that matches there, each with the greedy
// backtracking of the regular expression engines tiktoken runs (regexp2 in
// tiktoken-go, whose \s is unicode.IsSpace). TestCountsAsTiktoken holds
// them to tiktoken-go's counts.
//
// o200k_base:
//
//	[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//	|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//	|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
//
// cl100k_base:
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
//	| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+

// class is what a rune is to the patterns, a bit set.
type class uint16

const (
	cLu class = 1 << iota
	cLl
	cLt
	cLm
	cLo
	cM
	cN
	cSpace
	cCRLF // \r or \n

	cLetter = cLu | cLl | cLt | cLm | cLo
	// cUpper and cLower are o200k's two letter classes.
	cUpper = cLu | cLt | cLm | cLo | cM
	cLower = cLl | cLm | cLo | cM
)

var asciiClass = func() (t [utf8.RuneSelf]class) {
	for r := range rune(utf8.RuneSelf) {
		t[r] = classOf(r)
	}
	return t
}()

func classOf(r rune) class {
	var c class
	switch {
	case unicode.Is(unicode.Lu, r):
		c |= cLu
	case unicode.Is(unicode.Ll, r):
		c |= cLl
	case unicode.Is(unicode.Lt, r):
		c |= cLt
	case unicode.Is(unicode.Lm, r):
		c |= cLm
	case unicode.Is(unicode.Lo, r):
		c |= cLo
	case unicode.Is(unicode.M, r):
		c |= cM
	case unicode.Is(unicode.N, r):
		c |= cN
	}
	if unicode.IsSpace(r) {
		c |= cSpace
	}
	if r == '\r' || r == '\n' {
		c |= cCRLF
	}
	return c
}

// at is the class of the rune at s[i] and its width (s is valid UTF-8).
func at(s []byte, i int) (class, int) {
	if b := s[i]; b < utf8.RuneSelf {
		return asciiClass[b], 1
	}
	r, w := utf8.DecodeRune(s[i:])
	return classOf(r), w
}

// prefix reports whether a rune of class c may start a piece before its
// letters: [^\r\n\p{L}\p{N}].
func prefix(c class) bool { return c&(cCRLF|cLetter|cN) == 0 }

// symbol is [^\s\p{L}\p{N}].
func symbol(c class) bool { return c&(cSpace|cLetter|cN) == 0 }

// run is the end of the run of runes of a class in want from i.
func run(s []byte, i int, want class) int {
	for i < len(s) {
		c, w := at(s, i)
		if c&want == 0 {
			break
		}
		i += w
	}
	return i
}

// contraction is the length of (?i:'s|'t|'re|'ve|'m|'ll|'d) at s[i:], or 0.
func contraction(s []byte, i int) int {
	if i+1 >= len(s) || s[i] != '\'' {
		return 0
	}
	switch s[i+1] | 0x20 {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if i+2 < len(s) && s[i+2]|0x20 == 'e' {
			return 3
		}
	case 'l':
		if i+2 < len(s) && s[i+2]|0x20 == 'l' {
			return 3
		}
	}
	if i+2 < len(s) && s[i+1] == 0xc5 && s[i+2] == 0xbf { // ſ, which folds to s
		return 3
	}
	return 0
}

// o200kWord is the end of [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+
// (lowerRequired) or [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*
// from j, and the contraction after it; -1 where it does not match.
func o200kWord(s []byte, j int, lowerRequired bool) int {
	// The upper run, greedy; the lower run after it, or, backtracking,
	// from the last rune of the upper run that is lower too.
	e, lastLower := j, -1
	for e < len(s) {
		c, w := at(s, e)
		if c&cUpper == 0 {
			break
		}
		e += w
		if c&cLower != 0 {
			lastLower = e
		}
	}
	end := -1
	switch l := run(s, e, cLower); {
	case l > e:
		end = l
	case lowerRequired && lastLower >= 0:
		end = lastLower
	case !lowerRequired && e > j:
		end = e
	}
	if end < 0 {
		return -1
	}
	return end + contraction(s, end)
}

// spaces is the end of the piece of white space from i (\s*[\r\n]+,
// \s+(?!\S), \s+), its rune at i a space. Of \s*[\r\n]+ over a run
// with several line ends, tiktoken-go's regexp2 backtracks to the first
// (the reference engines, to the last): the finer split is kept, which
// counts no fewer tokens.
func spaces(s []byte, i int) int {
	e, firstCRLF, last := i, -1, i
	for e < len(s) {
		c, w := at(s, e)
		if c&cSpace == 0 {
			break
		}
		if c&cCRLF != 0 && firstCRLF < 0 {
			firstCRLF = e
		}
		last = e
		e += w
	}
	switch {
	case firstCRLF >= 0:
		for firstCRLF < len(s) && (s[firstCRLF] == '\r' || s[firstCRLF] == '\n') {
			firstCRLF++
		}
		return firstCRLF
	case e == len(s) || last == i:
		return e
	}
	return last // the last space stays for the piece after it
}

// o200kPiece is the end of the piece that starts at s[i].
func o200kPiece(s []byte, i int) int {
	c, w := at(s, i)
	if prefix(c) && i+w < len(s) {
		if e := o200kWord(s, i+w, true); e >= 0 {
			return e
		}
	}
	if e := o200kWord(s, i, true); e >= 0 {
		return e
	}
	if prefix(c) && i+w < len(s) {
		if e := o200kWord(s, i+w, false); e >= 0 {
			return e
		}
	}
	if e := o200kWord(s, i, false); e >= 0 {
		return e
	}
	if c&cN != 0 {
		return digits(s, i)
	}
	if e := symbols(s, i, c, true); e >= 0 {
		return e
	}
	if c&cSpace != 0 {
		return spaces(s, i)
	}
	return i + w // (every rune is one of the above)
}

// cl100kPiece is the end of the piece that starts at s[i].
func cl100kPiece(s []byte, i int) int {
	if n := contraction(s, i); n > 0 {
		return i + n
	}
	c, w := at(s, i)
	if prefix(c) && i+w < len(s) {
		if e := run(s, i+w, cLetter); e > i+w {
			return e
		}
	}
	if c&cLetter != 0 {
		return run(s, i, cLetter)
	}
	if c&cN != 0 {
		return digits(s, i)
	}
	if e := symbols(s, i, c, false); e >= 0 {
		return e
	}
	if c&cSpace != 0 {
		return spaces(s, i)
	}
	return i + w
}

// digits is the end of \p{N}{1,3} from i.
func digits(s []byte, i int) int {
	for n := 0; n < 3 && i < len(s); n++ {
		c, w := at(s, i)
		if c&cN == 0 {
			break
		}
		i += w
	}
	return i
}

// symbols is the end of ' ?[^\s\p{L}\p{N}]+' and the line ends after it
// ([\r\n/]* with slash, else [\r\n]*) from i, whose rune is of class c; -1
// where it does not match.
func symbols(s []byte, i int, c class, slash bool) int {
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		if c1, _ := at(s, i+1); symbol(c1) {
			j = i + 1
		}
	} else if !symbol(c) {
		return -1
	}
	for j < len(s) {
		c, w := at(s, j)
		if !symbol(c) {
			break
		}
		j += w
	}
	if j == i || s[i] == ' ' && j == i+1 {
		return -1
	}
	for j < len(s) && (s[j] == '\r' || s[j] == '\n' || slash && s[j] == '/') {
		j++
	}
	return j
}
