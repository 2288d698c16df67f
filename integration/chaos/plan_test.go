package chaos

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/wire"
	"github.com/idemq/idemq/outbox"
)

// What an operation is meant to be, and so how it must end.
const (
	kindOK         = "ok"          // processed: one ledger row, one forwarded message
	kindReject     = "reject"      // a business rejection: completed, no effect
	kindPoison     = "poison"      // valid JSON the handler refuses: DLQ permanent_error
	kindPoisonJSON = "poison_json" // a body that is not JSON: DLQ permanent_error
	// kindTwin is processed and forwarded twice, with one explicit
	// message_id, in one transaction: to the output queue and to the twin
	// queue. Both rows share the message_id and (most often) a relay batch;
	// both must arrive.
	kindTwin = "twin"
	// kindTwinVoid is processed and forwarded twice with one message_id: to
	// the output queue and to a routing key no queue is bound to. The broker
	// returns the second row on every try: it must stay pending (then be
	// parked), never be marked published, while its twin in the same batch
	// is marked and arrives.
	kindTwinVoid = "twin_void"
	// kindNearFrameMax has a header frame nearFrameMaxMargin bytes under
	// frame_max and fails its first attempt: its retry copy does not fit
	// until trimmed (idemq drops its optional headers, down to the large
	// tracestate), and it is then processed at its second attempt.
	kindNearFrameMax = "near_frame_max"
	// kindAtFrameMax has a header frame at frame_max (less the room a
	// redelivery's x-delivery-count needs) and always fails: no copy of it
	// fits, whatever is trimmed, so it must end in the DLQ as
	// headers_too_large.
	kindAtFrameMax = "at_frame_max"
)

// The sizes of the frame_max kinds.
const (
	// nearFrameMaxMargin is how far under frame_max a near_frame_max
	// message's header frame is: its retry copy (the message's headers plus
	// x-idemq-attempt) is over the budget the consumer leaves a retry copy
	// (frame_max less the room for the broker's x-death headers, over a
	// kilobyte for the soak's tiers) and fits once trimTraceState bytes of
	// tracestate are dropped.
	nearFrameMaxMargin = 300
	trimTraceState     = 8192
	// atFrameMaxMargin is how far under frame_max an at_frame_max
	// message's header frame is: the x-delivery-count header (26 bytes)
	// that a quorum queue adds to a redelivered message must still fit, or
	// the redelivery could not be read at all (amqp091-go closes the
	// connection over a frame larger than frame_max).
	atFrameMaxMargin = 64
)

// The routing keys the soak's handler forwards to, on the output exchange.
const (
	routeForwarded = "forwarded" // bound to the output queue
	routeTwin      = "twin"      // bound to the twin queue
	routeVoid      = "twin.void" // bound to no queue: unroutable
)

// twinMessageID is the explicit message_id both rows of a twin op share.
func twinMessageID(op int) string { return fmt.Sprintf("chaos-twin-%07d", op) }

// twinRoute is where a twin op's second row goes ("" for the other kinds).
func twinRoute(kind string) string {
	switch kind {
	case kindTwin:
		return routeTwin
	case kindTwinVoid:
		return routeVoid
	}
	return ""
}

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
	// HeaderPad is the length of the x-chaos-pad header and TraceState of
	// the tracestate header (0: none): they size the header frame of the
	// frame_max kinds.
	HeaderPad, TraceState int
	// OrderingKey and Sequence are an ordered plan's (ordered_test.go):
	// the entity the op belongs to and its place among the entity's ops,
	// published as x-ordering-key and x-sequence.
	OrderingKey string
	Sequence    int
}

// processed reports whether the op must end processed: completed ok, one
// ledger row, forwarded.
func (o op) processed() bool {
	switch o.Kind {
	case kindOK, kindTwin, kindTwinVoid, kindNearFrameMax:
		return true
	}
	return false
}

// deadLetterReason is the reason the op must end in the DLQ with ("": it
// must not).
func (o op) deadLetterReason() string {
	switch o.Kind {
	case kindPoison, kindPoisonJSON:
		return consumer.ReasonPermanentError
	case kindAtFrameMax:
		return consumer.ReasonHeadersTooLarge
	}
	return ""
}

// forwardedID is the message_id the op's forwarded messages carry: the one
// the outbox derives from the claim, or the twins' explicit one.
func (o op) forwardedID(consumerName string) string {
	if twinRoute(o.Kind) != "" {
		return twinMessageID(o.Index)
	}
	return outbox.MessageID(dedup.Scope{Consumer: consumerName, Tenant: o.Tenant, Key: o.Key}, "", 1)
}

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
	// FrameMax is the negotiated frame_max the frame_max kinds are sized for.
	FrameMax int
}

// completedWant is how many keys must end completed (processed or rejected).
func (p *plan) completedWant() int {
	n := p.ByKind[kindReject]
	for _, k := range []string{kindOK, kindTwin, kindTwinVoid, kindNearFrameMax} {
		n += p.ByKind[k]
	}
	return n
}

// processedWant is how many ops must end processed (forwarded to the output queue).
func (p *plan) processedWant() int { return p.completedWant() - p.ByKind[kindReject] }

// deadLetterWant is how many ops must end in the DLQ.
func (p *plan) deadLetterWant() int {
	return p.ByKind[kindPoison] + p.ByKind[kindPoisonJSON] + p.ByKind[kindAtFrameMax]
}

// buildPlan lays out about n messages: 30% duplicates (some in bursts of 20
// concurrent copies), 1% poison, 2% business rejections, 5% of ops failing
// with an infrastructure error on their first attempt or two; 0.5% twins
// (half of them with an unroutable twin), and 0.05% each of messages near
// and at frameMax (the negotiated frame_max), sized for it.
func buildPlan(n int, seed uint64, frameMax int) plan {
	rng := rand.New(rand.NewPCG(seed, 0xc4a05))
	dups := n * 30 / 100
	unique := n - dups
	bursts := max(3, n/1000)
	poison := max(5, n/100)
	// The special kinds follow the poison ops: [poison, special).
	specials := []struct {
		kind  string
		count int
	}{
		{kindAtFrameMax, max(2, n/2000)},
		{kindNearFrameMax, max(2, n/2000)},
		{kindTwin, max(3, n/400)},
		{kindTwinVoid, max(3, n/400)},
	}
	specialKind := make([]string, 0, 64)
	for _, sp := range specials {
		for range sp.count {
			specialKind = append(specialKind, sp.kind)
		}
	}
	special := poison + len(specialKind)
	p := plan{ByKind: map[string]int{}, FrameMax: frameMax}
	for i := range unique {
		o := op{Index: i, Tenant: tenants[rng.IntN(len(tenants))], Key: fmt.Sprintf("op-%07d", i), Kind: kindOK}
		switch {
		case i < poison:
			o.Kind = kindPoison
			if i%2 == 1 {
				o.Kind = kindPoisonJSON
			}
		case i < special:
			o.Kind = specialKind[i-poison]
		case rng.IntN(100) < 2:
			o.Kind = kindReject
		}
		switch {
		case o.Kind == kindNearFrameMax:
			o.FailFirst = 1 // its one retry copy is the one to trim
		case o.Kind != kindAtFrameMax && o.deadLetterReason() == "" && rng.IntN(100) < 5:
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
		o := &p.Ops[i]
		o.Body = body(rng, *o)
		p.ByKind[o.Kind]++
		// Sized last: the key and the tenant count in the header frame.
		switch o.Kind {
		case kindNearFrameMax:
			o.TraceState = trimTraceState
			o.padTo(frameMax - nearFrameMaxMargin)
		case kindAtFrameMax:
			o.padTo(frameMax - atFrameMaxMargin)
		}
	}
	// Burst ops are published only as bursts, after the poison and the
	// special ones.
	eligible := rng.Perm(unique - special)
	for _, k := range eligible[:bursts] {
		p.Ops[special+k].Burst = true
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

// padTo sets HeaderPad so that the header frame of o's messages is size
// bytes (confirm.HeaderFrameSize: what the broker and the consumer count).
// Every other property of the message is set already.
func (o *op) padTo(size int) {
	o.HeaderPad = 1
	n, err := o.headerFrameSize()
	if err != nil {
		panic(err)
	}
	// One more byte of a string header value is one more byte of the frame.
	o.HeaderPad += size - n
	if o.HeaderPad < 1 {
		panic(fmt.Sprintf("op %d: header frame %d bytes without padding, more than %d", o.Index, n, size))
	}
}

func (o op) headerFrameSize() (int, error) { return confirm.HeaderFrameSize(o.message()) }

func body(rng *rand.Rand, o op) []byte {
	if o.Kind == kindPoisonJSON {
		return []byte(fmt.Sprintf("\xff\xfe{op=%d, not JSON", o.Index))
	}
	b, _ := json.Marshal(payload{
		Op: o.Index, Tenant: o.Tenant, Key: o.Key, Kind: o.Kind, FailFirst: o.FailFirst,
		Amount: 1 + rng.Int64N(100000), Pad: strings.Repeat("p", rng.IntN(400)),
		OrderingKey: o.OrderingKey, Sequence: o.Sequence,
	})
	return b
}

// TestPlanNeverReusesAScope checks the plan itself: every operation has a
// (tenant, key) scope of its own, so a key reuse in a soak is idemq's doing.
func TestPlanNeverReusesAScope(t *testing.T) {
	t.Parallel()
	for seed := range uint64(200) {
		p := buildPlan(3000, seed, testFrameMax)
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

// testFrameMax is RabbitMQ's and amqp091-go's default frame_max.
const testFrameMax = 131072

// TestPlanSizesFrameMaxKinds checks the plan itself: the header frames of
// the frame_max kinds are exactly as far under frame_max as they are meant
// to be, and the other kinds are far from it.
func TestPlanSizesFrameMaxKinds(t *testing.T) {
	t.Parallel()
	for seed := range uint64(20) {
		p := buildPlan(3000, seed, testFrameMax)
		for _, o := range p.Ops {
			n, err := o.headerFrameSize()
			if err != nil {
				t.Fatalf("seed %d, op %d: %v", seed, o.Index, err)
			}
			want := map[string]int{kindNearFrameMax: testFrameMax - nearFrameMaxMargin, kindAtFrameMax: testFrameMax - atFrameMaxMargin}[o.Kind]
			switch {
			case want != 0 && n != want:
				t.Fatalf("seed %d, op %d (%s): header frame %d bytes, want %d", seed, o.Index, o.Kind, n, want)
			case want == 0 && n > 1024:
				t.Fatalf("seed %d, op %d (%s): header frame %d bytes", seed, o.Index, o.Kind, n)
			}
		}
		for _, k := range []string{kindNearFrameMax, kindAtFrameMax, kindTwin, kindTwinVoid} {
			if p.ByKind[k] == 0 {
				t.Fatalf("seed %d: no %s op", seed, k)
			}
		}
	}
}

// TestPlanTrimWindow checks that a near_frame_max op's retry copy needs
// trimming and fits once trimmed, for the soak's topology: over the retry
// budget with the small optional headers dropped, under it with the
// tracestate dropped too. The budget leaves room for the broker's x-death
// headers; the bounds used here are far from its actual size (about 1.7
// kB for the soak's tiers), on either side.
func TestPlanTrimWindow(t *testing.T) {
	t.Parallel()
	p := buildPlan(3000, 1, testFrameMax)
	for _, o := range p.Ops {
		if o.Kind != kindNearFrameMax {
			continue
		}
		msg := o.message()
		maps.Copy(msg.Headers, wire.RetryHeaders(2))
		untrimmed, _ := confirm.HeaderFrameSize(msg)
		delete(msg.Headers, "tracestate")
		trimmed, _ := confirm.HeaderFrameSize(msg)
		// Over any budget that leaves x-death more than 300 bytes; under
		// any that leaves it less than 8 kB.
		if untrimmed <= testFrameMax-300 || trimmed > testFrameMax-8*1024 {
			t.Fatalf("op %d: retry copy %d bytes, %d without tracestate", o.Index, untrimmed, trimmed)
		}
	}
}
