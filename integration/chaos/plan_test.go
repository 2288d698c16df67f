package chaos

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// What an operation is meant to be, and so how it must end.
const (
	kindOK         = "ok"          // processed: one ledger row, one forwarded message
	kindReject     = "reject"      // a business rejection: completed, no effect
	kindPoison     = "poison"      // valid JSON the handler refuses: DLQ permanent_error
	kindPoisonJSON = "poison_json" // a body that is not JSON: DLQ permanent_error
)

// burstSize copies of a burst key are published at once, from as many goroutines.
const burstSize = 20

// tenants of the soak: the default one and some with odd characters.
var tenants = []string{"", "acme", "Ümlaut Straße/ü", "t:with spaces#%&?=;"}

// op is one operation: one (tenant, key), published once or more.
type op struct {
	Index     int
	Tenant    string
	Key       string
	Kind      string
	InHeader  bool // the key travels in the Idempotency-Key header, not message_id
	FailFirst int
	Body      []byte
	Burst     bool
}

// poison reports whether the op must end in the DLQ.
func (o op) poison() bool { return o.Kind == kindPoison || o.Kind == kindPoisonJSON }

// publication is one entry of the publication order: copies > 1 is a burst.
type publication struct {
	Op     int
	Copies int
	slot   float64
}

// plan is the whole workload of one soak.
type plan struct {
	Ops  []op
	Pubs []publication
	// Total counts the messages to publish, burst copies included;
	// Duplicates those that repeat an op already published.
	Total, Duplicates int
	Bursts            int
	ByKind            map[string]int
	Flaky             int
	SharedKeys        int // key strings used by two tenants
	HeaderKeys        int
}

// buildPlan lays out about n messages: 30% duplicates (some in bursts of 20
// concurrent copies), 1% poison, 2% business rejections, 5% of ops failing
// with an infrastructure error on their first attempt or two.
func buildPlan(n int, seed uint64) plan {
	rng := rand.New(rand.NewPCG(seed, 0xc4a05))
	dups := n * 30 / 100
	unique := n - dups
	bursts := max(3, n/1000)
	poison := max(5, n/100)
	p := plan{ByKind: map[string]int{}}
	for i := range unique {
		o := op{Index: i, Tenant: tenants[rng.IntN(len(tenants))], Key: fmt.Sprintf("op-%07d", i), Kind: kindOK}
		switch {
		case i < poison:
			o.Kind = kindPoison
			if i%2 == 1 {
				o.Kind = kindPoisonJSON
			}
		case rng.IntN(100) < 2:
			o.Kind = kindReject
		}
		if !o.poison() && rng.IntN(100) < 5 {
			o.FailFirst = 1 + rng.IntN(2)
			p.Flaky++
		}
		if rng.IntN(10) == 0 {
			o.InHeader = true
			p.HeaderKeys++
		}
		p.Ops = append(p.Ops, o)
	}
	// Some key strings are used again by another tenant: another operation.
	// A scope (tenant, key) is never given to two operations: that would be
	// key reuse, which the plan does not intend here.
	scopes := make(map[[2]string]bool, unique)
	for _, o := range p.Ops {
		scopes[[2]string{o.Tenant, o.Key}] = true
	}
	for range max(2, unique/100) {
		a, b := rng.IntN(unique), rng.IntN(unique)
		if a == b || p.Ops[a].Tenant == p.Ops[b].Tenant || scopes[[2]string{p.Ops[b].Tenant, p.Ops[a].Key}] {
			continue
		}
		delete(scopes, [2]string{p.Ops[b].Tenant, p.Ops[b].Key})
		p.Ops[b].Key = p.Ops[a].Key
		scopes[[2]string{p.Ops[b].Tenant, p.Ops[b].Key}] = true
		p.SharedKeys++
	}
	for i := range p.Ops {
		p.Ops[i].Body = body(rng, p.Ops[i])
		p.ByKind[p.Ops[i].Kind]++
	}
	// Burst ops are published only as bursts, after the poison ones.
	eligible := rng.Perm(unique - poison)
	for _, k := range eligible[:bursts] {
		p.Ops[poison+k].Burst = true
	}
	p.Bursts = bursts
	order := rng.Perm(unique)
	slot := make([]float64, unique)
	for pos, i := range order {
		slot[i] = float64(pos)
		copies := 1
		if p.Ops[i].Burst {
			copies = burstSize
			p.Duplicates += burstSize - 1
		}
		p.Pubs = append(p.Pubs, publication{Op: i, Copies: copies, slot: float64(pos)})
	}
	// The other duplicates: some right behind their op (while it is in
	// flight), most far behind (after it completed).
	for p.Duplicates < dups {
		i := poison + rng.IntN(unique-poison)
		behind := 10 + float64(rng.IntN(max(1, unique/4)))
		if rng.IntN(10) < 3 {
			behind = 1 + float64(rng.IntN(10))
		}
		p.Pubs = append(p.Pubs, publication{Op: i, Copies: 1, slot: slot[i] + behind + rng.Float64()})
		p.Duplicates++
	}
	slices.SortStableFunc(p.Pubs, func(a, b publication) int { return cmp.Compare(a.slot, b.slot) })
	for _, pub := range p.Pubs {
		p.Total += pub.Copies
	}
	return p
}

func body(rng *rand.Rand, o op) []byte {
	if o.Kind == kindPoisonJSON {
		return []byte(fmt.Sprintf("\xff\xfe{op=%d, not JSON", o.Index))
	}
	b, _ := json.Marshal(payload{
		Op: o.Index, Tenant: o.Tenant, Key: o.Key, Kind: o.Kind, FailFirst: o.FailFirst,
		Amount: 1 + rng.Int64N(100000), Pad: strings.Repeat("p", rng.IntN(400)),
	})
	return b
}

// TestPlanNeverReusesAScope checks the plan itself: every operation has a
// (tenant, key) scope of its own, so a key reuse in a soak is idemq's doing.
func TestPlanNeverReusesAScope(t *testing.T) {
	t.Parallel()
	for seed := range uint64(200) {
		p := buildPlan(3000, seed)
		seen := map[[2]string]int{}
		for i, o := range p.Ops {
			scope := [2]string{o.Tenant, o.Key}
			if j, dup := seen[scope]; dup {
				t.Fatalf("seed %d: ops %d and %d share tenant %q and key %q", seed, j, i, o.Tenant, o.Key)
			}
			seen[scope] = i
		}
	}
}
