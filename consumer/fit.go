package consumer

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/confirm"
	"github.com/idemq/idemq/internal/fieldtable"
	"github.com/idemq/idemq/internal/header"
)

// optionalHeaders are dropped, in this order, from a copy that does not fit
// in one frame: first what only helps an operator read it.
var optionalHeaders = []string{HeaderFirstSeen, HeaderOriginalExchange, HeaderOriginalRouting, "tracestate", "traceparent"}

// trimToFit makes msg's header frame fit frameMax: it drops the optional
// headers, then cuts x-idemq-error. It reports whether msg fits.
func trimToFit(msg *amqp.Publishing, frameMax int) bool {
	if fits(msg, frameMax) {
		return true
	}
	for _, h := range optionalHeaders {
		delete(msg.Headers, h)
		if fits(msg, frameMax) {
			return true
		}
	}
	text, _ := msg.Headers[HeaderError].(string)
	for n := len(text) / 2; text != ""; n /= 2 {
		text = truncate(text, n)
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
		case HeaderReason, HeaderAttempt, HeaderAttempts, HeaderError, HeaderTenant, header.Signature:
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

// tooLargeCopy turns msg into the dead letter of a delivery whose copy does
// not fit frameMax (ReasonHeadersTooLarge).
func tooLargeCopy(msg *amqp.Publishing, frameMax, attempt int) {
	for k, v := range DeadLetterHeaders(ReasonHeadersTooLarge, nil, attempt) {
		msg.Headers[k] = v
	}
	msg.Headers[HeaderError] = ""
	for _, h := range optionalHeaders {
		delete(msg.Headers, h)
	}
	dropped := dropUntilFits(msg, frameMax)
	msg.Headers[HeaderError] = truncate(fmt.Sprintf("headers too large for frame_max %d; dropped: %s",
		frameMax, strings.Join(dropped, ", ")), maxErrorLen)
	if !fits(msg, frameMax) {
		delete(msg.Headers, HeaderError)
	}
}

// deathReserve is the room to leave in a retry copy's header frame for
// the headers the broker adds when it dead-letters the copy (x-death and
// x-first-death-*/x-last-death-*): from its tier back to Q when the TTL
// ends, and from Q to Q.dlx at the delivery limit. The broker adds them
// whatever the frame size, and a client cannot read a header frame over
// frame_max (amqp091-go closes the connection), so a copy that fills the
// frame would kill its consumer's connection on every delivery. The reserve
// is computed for the worst case: one x-death entry for every tier and for
// Q, with the longest reason and the largest count.
func deathReserve(t Topology) int {
	queues := []string{t.Queue}
	for _, d := range t.Delays {
		queues = append(queues, t.TierName(d))
	}
	deaths := make([]any, 0, len(queues))
	for _, q := range queues {
		deaths = append(deaths, amqp.Table{
			"count": int64(1 << 62), "reason": ReasonDeliveryLimit, "queue": q, "time": time.Unix(1<<40, 0),
			"exchange": t.DLX, "routing-keys": []any{q}, "original-expiration": "4294967295",
		})
	}
	h := amqp.Table{"x-death": deaths}
	for _, kind := range []string{"first", "last"} {
		h["x-"+kind+"-death-exchange"] = t.DLX
		h["x-"+kind+"-death-queue"] = queues[len(queues)-1]
		h["x-"+kind+"-death-reason"] = ReasonDeliveryLimit
	}
	n, err := fieldtable.Size(h)
	if err != nil {
		return 0
	}
	return n
}
