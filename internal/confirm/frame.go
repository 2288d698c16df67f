package confirm

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/fieldtable"
)

// FitsFrame reports, as ErrTooLarge, a message whose content header frame
// (its properties, headers included) would not fit in one frame of
// frameMax bytes. The body is split over frames of any number; the
// properties are not, and a header frame over frame_max makes the broker
// close the whole connection (FRAME_ERROR). frameMax 0 means no limit.
func FitsFrame(msg amqp.Publishing, frameMax int) error {
	if frameMax <= 0 {
		return nil
	}
	size, err := HeaderFrameSize(msg)
	if err != nil {
		return err
	}
	if size > frameMax {
		return fmt.Errorf("%w: header frame of %d bytes, frame_max %d", ErrTooLarge, size, frameMax)
	}
	return nil
}

// HeaderFrameSize is the size in bytes of the content header frame that
// carries msg's properties: frame header (7) and end (1), class, weight,
// body size and property flags (14), then each property set.
func HeaderFrameSize(msg amqp.Publishing) (int, error) {
	n := 7 + 1 + 14
	short := func(s string) error {
		if s == "" {
			return nil
		}
		if len(s) > 255 {
			return fmt.Errorf("%w: a short string property is %d bytes, longer than 255", ErrTooLarge, len(s))
		}
		n += 1 + len(s)
		return nil
	}
	for _, s := range []string{msg.ContentType, msg.ContentEncoding, msg.CorrelationId, msg.ReplyTo,
		msg.Expiration, msg.MessageId, msg.Type, msg.UserId, msg.AppId} {
		if err := short(s); err != nil {
			return 0, err
		}
	}
	if len(msg.Headers) > 0 {
		t, err := fieldtable.Size(msg.Headers)
		if err != nil {
			return 0, fmt.Errorf("headers: %w", err)
		}
		n += t
	}
	if msg.DeliveryMode != 0 {
		n++
	}
	if msg.Priority != 0 {
		n++
	}
	if !msg.Timestamp.IsZero() {
		n += 8
	}
	return n, nil
}
