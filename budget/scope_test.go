package budget

import (
	"strings"
	"testing"
	"time"
)

func TestScopeIDHidesTheValue(t *testing.T) {
	tests := []struct {
		scope Scope
		dims  Dims
		want  string // the start of the id
	}{
		{Global, Dims{Principal: "Bearer sk-secret"}, "global"},
		{PerKey, Dims{Principal: "Bearer sk-secret"}, "key-"},
		{PerTeam, Dims{Team: "sk-secret-team"}, "team-"},
		{PerModel, Dims{Model: "gpt-4o"}, "model-"},
	}
	for _, tt := range tests {
		b := Budget{Name: "b", Scope: tt.scope, Unit: Tokens, Limit: 1, Window: time.Hour}
		id := ScopeID(&b, tt.dims)
		if !strings.HasPrefix(id, tt.want) || strings.Contains(id, "secret") || strings.Contains(id, "gpt") {
			t.Errorf("scope %s: id %q, want %q… without the raw value", tt.scope, id, tt.want)
		}
		if tt.scope != Global && len(id) != len(tt.want)+32 {
			t.Errorf("scope %s: id %q, want the scope and 32 hex digits", tt.scope, id)
		}
	}
}

func TestHashedScopeIDRefusesWhatIsNotADigest(t *testing.T) {
	tests := []struct {
		scope  Scope
		digest string
	}{
		{Global, strings.Repeat("a", 32)},
		{PerKey, strings.Repeat("a", 31)},
		{PerKey, strings.Repeat("A", 32)},
		{PerKey, strings.Repeat("g", 32)},
		{PerKey, "Bearer sk-secret"},
	}
	for _, tt := range tests {
		if id, err := HashedScopeID(tt.scope, tt.digest); err == nil {
			t.Errorf("HashedScopeID(%s, %q) = %q, want an error", tt.scope, tt.digest, id)
		}
	}
}
