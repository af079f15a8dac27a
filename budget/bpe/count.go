package bpe

import "unicode/utf8"

// MaxMergeBytes bounds the piece that is merged: a longer piece (a run of
// letters with no space, longer than any word) is counted a token a byte,
// which no tokenizer of bytes exceeds.
const MaxMergeBytes = 256

// Count is the number of tokens of text, as the vocabulary encodes it in
// one string. Text that is not valid UTF-8 is counted a token a byte.
func (t *Counter) Count(text []byte) int64 {
	if !utf8.Valid(text) {
		return int64(len(text))
	}
	piece := o200kPiece
	if t.vocab == Cl100k {
		piece = cl100kPiece
	}
	var n int64
	for i := 0; i < len(text); {
		e := piece(text, i)
		n += t.merged(text[i:e])
		i = e
	}
	return n
}

// merged is the number of tokens byte-pair merging makes of piece: each
// step merges the adjacent pair whose merge is the token of the lowest
// rank (the leftmost of equals), until no pair is a token.
func (t *Counter) merged(piece []byte) int64 {
	if _, ok := t.rank(piece); ok {
		return 1
	}
	if len(piece) > MaxMergeBytes {
		return int64(len(piece))
	}
	const none = ^uint32(0)
	// at[k] is where part k starts; ranks[k] the rank of parts k and k+1
	// merged.
	var at [MaxMergeBytes + 1]uint16
	var ranks [MaxMergeBytes]uint32
	parts := len(piece)
	for k := range parts + 1 {
		at[k] = uint16(k)
	}
	pair := func(k int) uint32 {
		if k+2 > parts {
			return none
		}
		if r, ok := t.rank(piece[at[k]:at[k+2]]); ok {
			return r
		}
		return none
	}
	for k := range parts - 1 {
		ranks[k] = pair(k)
	}
	for parts > 1 {
		best, k := none, -1
		for j, r := range ranks[:parts-1] {
			if r < best {
				best, k = r, j
			}
		}
		if k < 0 {
			break
		}
		copy(at[k+1:parts], at[k+2:parts+1])
		copy(ranks[k+1:parts-1], ranks[k+2:parts])
		parts--
		ranks[k] = pair(k)
		if k > 0 {
			ranks[k-1] = pair(k - 1)
		}
	}
	return int64(parts)
}
