package demo

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strings"

	"github.com/idemq/idemq/dedup"
)

// payment is the body of a payment message.
type payment struct {
	Account  string `json:"account"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	// Network is the card network; "discover" is down for the whole run.
	Network string `json:"network"`
}

// The scenario's business rules.
const (
	// balanceLimit: a larger amount is rejected with insufficient funds.
	balanceLimit = 9000
	// downNetwork fails on every attempt: its payments end in the DLQ.
	downNetwork = "discover"
	// flakyPercent of keys fail on their first attempt.
	flakyPercent = 5
	// burstSize copies of one key are published at once.
	burstSize = 20
)

var networks = []string{"visa", "mastercard", "amex"}

// parsePayment decodes and checks a body; an error means poison.
func parsePayment(body []byte) (payment, error) {
	var p payment
	if err := json.Unmarshal(body, &p); err != nil {
		return p, fmt.Errorf("decode payment: %w", err)
	}
	var missing []string
	if p.Account == "" {
		missing = append(missing, "account")
	}
	if p.Amount <= 0 {
		missing = append(missing, "positive amount")
	}
	if p.Currency == "" {
		missing = append(missing, "currency")
	}
	if p.Network == "" {
		missing = append(missing, "network")
	}
	if len(missing) > 0 {
		return p, fmt.Errorf("payment lacks %s", strings.Join(missing, ", "))
	}
	return p, nil
}

// flaky reports whether the key's first attempt hits the injected
// infrastructure failure: about flakyPercent of keys, decided from a hash of
// the key so that every worker agrees.
func flaky(key string) bool {
	h := fnv.New32a()
	h.Write([]byte(key))
	return h.Sum32()%100 < flakyPercent
}

// kind is what one publication is, in the scenario.
type kind string

const (
	kindPayment   kind = "payment"     // first publication of a unique payment
	kindBurst     kind = "burst"       // one of burstSize copies published at once
	kindDuplicate kind = "duplicate"   // a later redelivery of a payment
	kindReuse     kind = "reuse"       // same key, another amount
	kindPoison    kind = "poison"      // not JSON, or an incomplete payment
	kindNoKey     kind = "no_key"      // neither message_id nor header
	kindBadKey    kind = "invalid_key" // control character or longer than 255 bytes
)

// message is one item of the publication plan.
type message struct {
	Kind kind
	// Key is the idempotency key as the consumer reads it ("" for none).
	Key string
	// InHeader sends the key in the Idempotency-Key header, not message_id.
	InHeader bool
	Body     []byte
	// Copies > 1 publishes that many copies at once, from as many goroutines.
	Copies int

	slot float64
}

// plan is the whole publication schedule of a run.
type plan struct {
	Messages []message
	// Total counts publications, burst copies included.
	Total int
	// Kinds counts publications by kind.
	Kinds map[kind]int
	// Bursts are the keys published in bursts.
	Bursts []string
}

// buildPlan lays out n unique payments and the trouble around them. The same
// n and seed always give the same plan.
func buildPlan(n int, seed int64) plan {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x1de3_de30))
	var base []message
	pay := func(key string, p payment) message {
		body, _ := json.Marshal(p)
		return message{Kind: kindPayment, Key: key, Body: body, Copies: 1}
	}
	randomPayment := func() payment {
		return payment{
			Account:  fmt.Sprintf("acct-%04d", rng.IntN(500)),
			Amount:   1 + rng.Int64N(9800), // about 8% above balanceLimit
			Currency: "EUR",
			Network:  networks[rng.IntN(len(networks))],
		}
	}

	down := max(1, n/1000)   // payments on the network that is down
	bursts := max(1, n/300)  // keys published burstSize times at once
	reuses := max(1, n/100)  // keys reused for another amount
	poison := max(2, n/100)  // undecodable or incomplete bodies
	noKeys := max(2, n/600)  // no key at all
	badKeys := max(2, n/600) // invalid keys
	dupShare, dupTwice := 0.38, 0.1

	payments := make([]payment, n)
	for i := range n {
		payments[i] = randomPayment()
		if i < down {
			payments[i].Network = downNetwork
		}
		m := pay(fmt.Sprintf("pay-%05d", i+1), payments[i])
		if i >= down && i < down+bursts {
			m.Kind, m.Copies = kindBurst, burstSize
		}
		base = append(base, m)
	}
	for i := range poison {
		body := fmt.Sprintf(`{"account":"acct-%04d","amount":%d,`, rng.IntN(500), 1+rng.IntN(9000)) // cut short
		if i%2 == 1 {
			body = fmt.Sprintf(`{"amount":%d,"currency":"EUR","network":"visa"}`, 1+rng.IntN(9000)) // no account
		}
		base = append(base, message{Kind: kindPoison, Key: fmt.Sprintf("pay-poison-%04d", i+1), Body: []byte(body), Copies: 1})
	}
	for range noKeys {
		m := pay("", randomPayment())
		m.Kind = kindNoKey
		base = append(base, m)
	}
	for i := range badKeys {
		key := fmt.Sprintf("pay-\x07bell-%d", i+1)
		if i%2 == 1 {
			key = "pay-" + strings.Repeat("long", 75) // 304 bytes
		}
		m := pay(key, randomPayment())
		m.Kind, m.InHeader = kindBadKey, true
		base = append(base, m)
	}
	rng.Shuffle(len(base), func(i, j int) { base[i], base[j] = base[j], base[i] })
	for i := range base {
		base[i].slot = float64(i)
	}

	// Later publications of the payments: redeliveries and reuses, placed
	// after their original, some close behind it (while it is in flight),
	// most far behind (after it completed).
	extra := []message{}
	byKey := map[string]int{}
	for i, m := range base {
		if m.Kind == kindPayment || m.Kind == kindBurst {
			byKey[m.Key] = i
		}
	}
	behind := func(orig float64) float64 {
		if rng.IntN(10) < 3 {
			return orig + 1 + float64(rng.IntN(10)) + rng.Float64()
		}
		return orig + 10 + float64(rng.IntN(600)) + rng.Float64()
	}
	for i := down + bursts; i < n; i++ {
		key := fmt.Sprintf("pay-%05d", i+1)
		orig := base[byKey[key]]
		if rng.Float64() < dupShare {
			copies := 1
			if rng.Float64() < dupTwice {
				copies = 2
			}
			for range copies {
				extra = append(extra, message{Kind: kindDuplicate, Key: key, Body: orig.Body, Copies: 1, slot: behind(orig.slot)})
			}
		}
	}
	reuseKeys := rng.Perm(n - down - bursts)[:min(reuses, n-down-bursts)]
	for _, k := range reuseKeys {
		i := down + bursts + k
		key := fmt.Sprintf("pay-%05d", i+1)
		p := payments[i]
		p.Amount += 1 + rng.Int64N(100)
		body, _ := json.Marshal(p)
		extra = append(extra, message{Kind: kindReuse, Key: key, Body: body, Copies: 1,
			slot: base[byKey[key]].slot + 200 + float64(rng.IntN(400)) + rng.Float64()})
	}

	all := append(base, extra...)
	slices.SortStableFunc(all, func(a, b message) int { return cmp.Compare(a.slot, b.slot) })
	pl := plan{Messages: all, Kinds: map[kind]int{}}
	for _, m := range all {
		pl.Total += m.Copies
		pl.Kinds[m.Kind] += m.Copies
		if m.Kind == kindBurst {
			pl.Bursts = append(pl.Bursts, m.Key)
		}
	}
	return pl
}

// validKey reports whether the consumer accepts key.
func validKey(key string) bool { return dedup.ValidateKey(key) == nil }

// errInjected marks the scenario's injected infrastructure failures.
var errInjected = errors.New("injected")
