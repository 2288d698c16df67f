package consumer

import (
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/header"
)

// Headers idemq reads and writes on the copies it publishes (named once, in
// internal/header). The attempt, the tenant, the first-seen time and the
// original exchange and routing key are trusted only on a copy whose
// HeaderSignature verifies under Config.HeaderKeys; on any other delivery
// every x-idemq-* header is removed before the handler sees it.
const (
	HeaderAttempt          = header.Attempt
	HeaderReason           = header.Reason
	HeaderError            = header.Error
	HeaderAttempts         = header.Attempts
	HeaderFirstSeen        = header.FirstSeen
	HeaderOriginalExchange = header.OriginalExchange
	HeaderOriginalRouting  = header.OriginalRoutingKey
	// HeaderTenant carries the tenant resolved on the first attempt, so that
	// later attempts claim the key in the same scope (copies carry no user_id).
	HeaderTenant = header.Tenant
	// HeaderSignature is the HMAC that proves idemq wrote the headers above.
	HeaderSignature = header.Signature
)

const (
	// maxErrorLen bounds x-idemq-error.
	maxErrorLen = 1024
	// maxTenantLen bounds a tenant, like a key.
	maxTenantLen = 255
)

// headerString reads a header written as a string or as bytes.
func headerString(h amqp.Table, name string) (string, bool) {
	switch v := h[name].(type) {
	case string:
		return v, true
	case []byte:
		return string(v), true
	}
	return "", false
}

// ExtractKey returns the delivery's idempotency key: from keyFunc when set;
// else the message_id property; else the header keyHeader (string or bytes).
// A key header that is present but not a string (an AMQP integer, a table,
// a void value) is an error wrapping dedup.ErrKeyInvalid; validate the key
// itself with dedup.ValidateKey.
func ExtractKey(d *amqp.Delivery, keyFunc KeyFunc, keyHeader string) (string, error) {
	if keyFunc != nil {
		return keyFunc(d), nil
	}
	if d.MessageId != "" {
		return d.MessageId, nil
	}
	v, present := d.Headers[keyHeader]
	if !present {
		return "", nil
	}
	k, ok := headerString(d.Headers, keyHeader)
	if !ok {
		return "", fmt.Errorf("%w: key header %s is a %T, not a string", dedup.ErrKeyInvalid, keyHeader, v)
	}
	return k, nil
}

// ExtractTenant returns the delivery's tenant: the user_id property when
// fromUserID, else the tenant header ("" when absent). A tenant that is not a
// string, is longer than 255 bytes, is not UTF-8 or holds control characters
// is an error. (The consumer reads it only from deliveries that are not
// idemq's own verified copies: those carry the tenant in HeaderTenant.)
func ExtractTenant(d *amqp.Delivery, tenantHeader string, fromUserID bool) (string, error) {
	var tenant string
	if fromUserID {
		tenant = d.UserId
	} else if v, present := d.Headers[tenantHeader]; present {
		s, ok := headerString(d.Headers, tenantHeader)
		if !ok {
			return "", fmt.Errorf("tenant header %s is a %T, not a string", tenantHeader, v)
		}
		tenant = s
	}
	return tenant, checkTenant(tenant)
}

// checkTenant refuses a tenant longer than 255 bytes, not UTF-8 or holding
// control characters.
func checkTenant(tenant string) error {
	if len(tenant) > maxTenantLen {
		return fmt.Errorf("tenant is %d bytes, longer than %d", len(tenant), maxTenantLen)
	}
	if !utf8.ValidString(tenant) {
		return fmt.Errorf("tenant is not valid UTF-8")
	}
	if strings.ContainsFunc(tenant, unicode.IsControl) {
		return fmt.Errorf("tenant holds control characters")
	}
	return nil
}

// ParseAttempt reads the attempt number from x-idemq-attempt, as any AMQP
// integer, a float or a decimal string. Absent, unreadable or non-positive
// values count as the first attempt. The consumer reads it only from its own
// verified copies; any other delivery is a first attempt.
func ParseAttempt(h amqp.Table) int {
	n := int64(1)
	switch v := h[HeaderAttempt].(type) {
	case int8:
		n = int64(v)
	case int16:
		n = int64(v)
	case int32:
		n = int64(v)
	case int64:
		n = v
	case int:
		n = int64(v)
	case uint8:
		n = int64(v)
	case uint16:
		n = int64(v)
	case uint32:
		n = int64(v)
	case float32:
		n = int64(v)
	case float64:
		n = int64(v)
	case string:
		if p, err := strconv.ParseInt(strings.TrimSpace(v), 10, 32); err == nil {
			n = p
		}
	case []byte:
		if p, err := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 32); err == nil {
			n = p
		}
	}
	if n < 1 || n > 1<<30 {
		return 1
	}
	return int(n)
}

// copyOf builds the publishing that replaces d: its body, properties and all
// its headers kept, plus extra headers, signed with keys. The original
// exchange, routing key and first-seen time are set on the first copy and
// kept on later ones. The copy carries no user_id: RabbitMQ refuses a
// user_id other than the publishing connection's user, and the worker's is
// not the publisher's (the tenant taken from it travels in HeaderTenant).
func copyOf(d *amqp.Delivery, now time.Time, extra amqp.Table, keys header.Keys) amqp.Publishing {
	h := make(amqp.Table, len(d.Headers)+len(extra)+4)
	maps.Copy(h, d.Headers)
	if _, ok := h[HeaderOriginalExchange]; !ok {
		h[HeaderOriginalExchange] = d.Exchange
		h[HeaderOriginalRouting] = d.RoutingKey
	}
	if _, ok := h[HeaderFirstSeen]; !ok {
		h[HeaderFirstSeen] = now.UTC().Format(time.RFC3339Nano)
	}
	maps.Copy(h, extra)
	keys.Sign(h, d.MessageId, d.Body, now)
	return amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// RetryHeaders are the headers of a retry copy for attempt next.
func RetryHeaders(next int) amqp.Table {
	return amqp.Table{HeaderAttempt: int32(next)}
}

// DeadLetterHeaders are the headers of a dead-lettered copy: the reason, the
// error text and the attempts made; its x-idemq-attempt is 1, a replay's
// first attempt.
func DeadLetterHeaders(reason string, err error, attempts int) amqp.Table {
	text := reason
	if err != nil {
		text = err.Error()
	}
	return amqp.Table{
		HeaderReason:   reason,
		HeaderError:    truncate(text, maxErrorLen),
		HeaderAttempts: int32(attempts),
		// The attempt a replay (idemq dlq replay) starts at: signed with
		// the copy, so that the replay keeps the signature without a key.
		HeaderAttempt: int32(1),
	}
}

// truncate cuts s to at most n bytes without splitting a UTF-8 sequence and
// replaces invalid bytes, so that the header is always a valid string.
func truncate(s string, n int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// headerCarrier adapts amqp.Table to OpenTelemetry's TextMapCarrier.
type headerCarrier amqp.Table

func (c headerCarrier) Get(key string) string {
	s, _ := headerString(amqp.Table(c), key)
	return s
}

func (c headerCarrier) Set(key, value string) { c[key] = value }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
