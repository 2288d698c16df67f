package demo

import (
	"bytes"
	"strings"
	"testing"
)

func TestReportCheck(t *testing.T) {
	good := Report{
		Queue: "q.demo", UniqueKeys: 10, Processed: 8, Rejected: 1, DeadLetteredKeys: 1, Effects: 8,
		DeadLetters:         map[string]int{"permanent_error": 2},
		ExpectedDeadLetters: map[string]int{"permanent_error": 2},
	}
	good.check()
	var out bytes.Buffer
	good.print(&out)
	if !good.OK() || !strings.HasSuffix(out.String(), "\nOK: effects applied == unique keys processed, 0 doubled, 0 lost\n") {
		t.Fatalf("good run not OK: %v\n%s", good.Failures, out.String())
	}

	for name, spoil := range map[string]func(*Report){
		"doubled":     func(r *Report) { r.Effects++; r.DoubledKeys++ },
		"lost":        func(r *Report) { r.LostKeys++; r.DeadLetteredKeys-- },
		"stray":       func(r *Report) { r.Effects++; r.StrayEffects++ },
		"in progress": func(r *Report) { r.InProgress++ },
		"unsettled":   func(r *Report) { r.Unsettled++ },
		"dead letter": func(r *Report) { r.DeadLetters = map[string]int{"permanent_error": 1} },
		"unexpected":  func(r *Report) { r.UnexpectedCompletions++ },
	} {
		bad := good
		bad.Failures = nil
		spoil(&bad)
		bad.check()
		out.Reset()
		bad.print(&out)
		if bad.OK() || !strings.Contains(out.String(), "\nFAILED: ") {
			t.Errorf("%s: not detected:\n%s", name, out.String())
		}
	}
}
