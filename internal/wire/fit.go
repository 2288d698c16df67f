package wire

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/fieldtable"
)

// optional are dropped, in this order, from a copy that does not fit in
// one frame: first what only helps an operator read it.
var optional = []string{HeaderFirstSeen, HeaderOriginalExchange, HeaderOriginalRoutingKey, HeaderTracestate, HeaderTraceparent}

// Fit makes msg's header frame fit frameMax: it drops the optional headers
// (first seen, origin, trace context), then cuts x-idemq-error. It reports
// whether msg fits. Sign the copy again afterwards: a dropped header was
// signed.
func Fit(msg *amqp.Publishing, frameMax int) bool {
	if fits(msg, frameMax) {
		return true
	}
	for _, h := range optional {
		delete(msg.Headers, h)
		if fits(msg, frameMax) {
			return true
		}
	}
	text, _ := String(msg.Headers[HeaderError])
	for n := len(text) / 2; text != ""; n /= 2 {
		text = Truncate(text, n)
		if n == 0 {
			text = ""
		}
		msg.Headers[HeaderError] = text
		if fits(msg, frameMax) {
			return true
		}
	}
	return false
}

// TooLarge turns msg, a copy that does not fit frameMax even after Fit, into
// a dead letter with reason and attempt that does: it keeps the body and
// properties, drops the optional headers, then the largest of the others
// (idemq's reason, attempt, tenant and signature excepted), and names the
// dropped ones in x-idemq-error.
func TooLarge(msg *amqp.Publishing, frameMax int, reason string, attempt int) {
	for k, v := range DeadLetterHeaders(reason, nil, attempt) {
		msg.Headers[k] = v
	}
	msg.Headers[HeaderError] = ""
	for _, h := range optional {
		delete(msg.Headers, h)
	}
	dropped := dropUntilFits(msg, frameMax)
	msg.Headers[HeaderError] = Truncate(fmt.Sprintf("headers too large for frame_max %d; dropped: %s",
		frameMax, strings.Join(dropped, ", ")), MaxErrorLen)
	if !fits(msg, frameMax) {
		delete(msg.Headers, HeaderError)
	}
}

// dropUntilFits drops msg's largest headers, idemq's reason and attempt
// headers excepted, until it fits frameMax; it returns the dropped names.
func dropUntilFits(msg *amqp.Publishing, frameMax int) []string {
	type sized struct {
		name string
		size int
	}
	var hs []sized
	for k, v := range msg.Headers {
		switch k {
		case HeaderReason, HeaderAttempt, HeaderAttempts, HeaderError, HeaderTenant, HeaderSignature:
			continue
		}
		n, _ := confirm.HeaderFrameSize(amqp.Publishing{Headers: amqp.Table{k: v}})
		hs = append(hs, sized{k, n})
	}
	slices.SortFunc(hs, func(a, b sized) int { return cmp.Or(b.size-a.size, strings.Compare(a.name, b.name)) })
	var dropped []string
	for _, h := range hs {
		if fits(msg, frameMax) {
			break
		}
		delete(msg.Headers, h.name)
		dropped = append(dropped, h.name)
	}
	return dropped
}

func fits(msg *amqp.Publishing, frameMax int) bool {
	return confirm.FitsFrame(*msg, frameMax) == nil
}

// DeathReserve is the room to leave in a retry copy's header frame for
// the headers the broker adds when it dead-letters the copy (x-death and
// x-first-death-*/x-last-death-*): from its tier back to the work queue
// when the TTL ends, and from the work queue to the dead-letter exchange
// dlx at the delivery limit. The broker adds them whatever the frame size,
// and a client cannot read a header frame over frame_max (amqp091-go closes
// the connection), so a copy that fills the frame would kill its consumer's
// connection on every delivery. The reserve is computed for the worst case:
// one x-death entry for every queue of queues (the work queue, then its
// tiers), with the longest reason and the largest count.
func DeathReserve(dlx string, queues []string) int {
	deaths := make([]any, 0, len(queues))
	for _, q := range queues {
		deaths = append(deaths, amqp.Table{
			"count": int64(1 << 62), "reason": ReasonDeliveryLimit, "queue": q, "time": time.Unix(1<<40, 0),
			"exchange": dlx, "routing-keys": []any{q}, "original-expiration": "4294967295",
		})
	}
	h := amqp.Table{HeaderDeath: deaths}
	for _, prefix := range []string{FirstDeathPrefix, LastDeathPrefix} {
		h[prefix+"exchange"] = dlx
		h[prefix+"queue"] = queues[len(queues)-1]
		h[prefix+"reason"] = ReasonDeliveryLimit
	}
	n, err := fieldtable.Size(h)
	if err != nil {
		return 0
	}
	return n
}
