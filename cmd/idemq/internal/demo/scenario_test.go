package demo

import (
	"slices"
	"testing"
)

func TestPlan(t *testing.T) {
	p := buildPlan(3000, 42)
	if q := buildPlan(3000, 42); !slices.EqualFunc(p.Messages, q.Messages, func(a, b message) bool {
		return a.Key == b.Key && string(a.Body) == string(b.Body) && a.Kind == b.Kind
	}) {
		t.Fatal("same seed, different plans")
	}
	dups := p.Kinds[kindDuplicate] + p.Kinds[kindBurst] - len(p.Bursts)
	if share := float64(dups) / float64(p.Total); share < 0.25 || share > 0.35 {
		t.Errorf("duplicates are %.0f%% of %d messages, want about 30%%", share*100, p.Total)
	}
	if len(p.Bursts) != 10 || p.Kinds[kindBurst] != 10*burstSize {
		t.Errorf("bursts: %d keys, %d copies", len(p.Bursts), p.Kinds[kindBurst])
	}
	for k, want := range map[kind]int{kindReuse: 30, kindPoison: 30, kindNoKey: 5, kindBadKey: 5, kindPayment: 3000 - 10} {
		if p.Kinds[k] != want {
			t.Errorf("%s: %d, want %d", k, p.Kinds[k], want)
		}
	}

	first := map[string]int{}
	flakyKeys, rejected := 0, 0
	for i, m := range p.Messages {
		switch m.Kind {
		case kindPayment, kindBurst:
			first[m.Key] = i
			if !validKey(m.Key) {
				t.Errorf("payment key %q invalid", m.Key)
			}
			pay, err := parsePayment(m.Body)
			if err != nil {
				t.Errorf("payment %s: %v", m.Key, err)
			}
			if pay.Amount > balanceLimit {
				rejected++
			}
			if flaky(m.Key) {
				flakyKeys++
			}
		case kindDuplicate, kindReuse:
			if j, ok := first[m.Key]; !ok || j >= i {
				t.Errorf("%s of %s published before the original", m.Kind, m.Key)
			}
		case kindPoison:
			if _, err := parsePayment(m.Body); err == nil {
				t.Errorf("poison %s parses", m.Body)
			}
		case kindNoKey:
			if m.Key != "" {
				t.Errorf("no-key message with key %q", m.Key)
			}
		case kindBadKey:
			if validKey(m.Key) || !m.InHeader {
				t.Errorf("invalid key %q accepted or not in the header", m.Key)
			}
		}
	}
	if flakyKeys < 90 || flakyKeys > 210 {
		t.Errorf("%d flaky keys of 3000, want about 5%%", flakyKeys)
	}
	if rejected < 150 || rejected > 350 {
		t.Errorf("%d payments above the balance of 3000, want about 8%%", rejected)
	}
}
