package consumer_test

import (
	"slices"
	"testing"

	"github.com/idemq/idemq/consumer"
)

func TestReasonsListEveryReasonOnce(t *testing.T) {
	t.Parallel()
	got := consumer.Reasons()
	for _, r := range []string{
		consumer.ReasonPermanentError, consumer.ReasonMaxAttemptsExceeded, consumer.ReasonKeyRequired,
		consumer.ReasonKeyInvalid, consumer.ReasonKeyReuse, consumer.ReasonHeadersTooLarge,
		"delivery_limit", "expired", "maxlen", "rejected", "unknown",
	} {
		if !slices.Contains(got, r) {
			t.Errorf("Reasons() lacks %q: %v", r, got)
		}
	}
	if sorted := slices.Sorted(slices.Values(got)); len(slices.Compact(sorted)) != len(got) {
		t.Errorf("Reasons() has duplicates: %v", got)
	}
	got[0] = "changed"
	if consumer.Reasons()[0] == "changed" {
		t.Error("Reasons() shares its slice with callers")
	}
}
