package fieldtable_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// amqp091-go itself is the reference: these helpers run it against an
// in-memory broker that speaks just enough AMQP 0-9-1 to open a connection
// and a channel, so that a test can hand it table bytes to read and catch
// the table bytes it writes.

// amqpReads returns the table amqp091-go reads from enc, an encoded table
// sent as the server properties of connection.start, or the error it fails
// the handshake with.
func amqpReads(t *testing.T, enc []byte) (amqp.Table, error) {
	t.Helper()
	var conn *amqp.Connection
	err := withFakeBroker(t, enc, func(c *amqp.Connection) error {
		conn = c
		return nil
	}, nil)
	if err != nil {
		return nil, err
	}
	return conn.Properties, nil
}

// amqpWrites returns the bytes amqp091-go writes for tab as the headers of
// a publishing, length prefix included.
func amqpWrites(t *testing.T, tab amqp.Table) []byte {
	t.Helper()
	var got []byte
	err := withFakeBroker(t, []byte{0, 0, 0, 0}, func(c *amqp.Connection) error {
		ch, err := c.Channel()
		if err != nil {
			return fmt.Errorf("channel: %w", err)
		}
		return ch.PublishWithContext(context.Background(), "", "q", false, false, amqp.Publishing{Headers: tab})
	}, func(b *fakeBroker) error {
		if _, err := b.expectMethod(20, 10); err != nil { // channel.open
			return err
		}
		if err := b.writeMethod(1, 20, 11, longstr("")); err != nil { // channel.open-ok
			return err
		}
		if _, err := b.expectMethod(60, 40); err != nil { // basic.publish
			return err
		}
		typ, _, payload, err := b.readFrame()
		if err != nil {
			return err
		}
		// class, weight, body size, property flags, then the headers
		// table: the only property set.
		if typ != 2 || len(payload) < 14 || binary.BigEndian.Uint16(payload[12:]) != 0x2000 {
			return fmt.Errorf("want a content header with headers only, got frame type %d: %q", typ, payload)
		}
		got = payload[14:]
		return nil
	})
	if err != nil {
		t.Fatalf("amqp091-go publishing %#v: %v", tab, err)
	}
	return got
}

// withFakeBroker opens an amqp091-go connection to an in-memory broker that
// sends serverProps (raw table bytes) in connection.start, runs client on
// the open connection and, at the same time, more of the broker's side when
// server is not nil, then closes the connection. It returns the first error
// of either side; a handshake amqp091-go fails is the client's error.
func withFakeBroker(t *testing.T, serverProps []byte, client func(*amqp.Connection) error, server func(*fakeBroker) error) error {
	t.Helper()
	cconn, sconn := net.Pipe()
	defer sconn.Close()
	_ = sconn.SetDeadline(time.Now().Add(10 * time.Second))
	b := &fakeBroker{conn: sconn}
	served := make(chan error, 1)
	go func() { served <- b.serve(serverProps, server) }()

	conn, err := amqp.Open(cconn, amqp.Config{
		SASL:  []amqp.Authentication{&amqp.PlainAuth{Username: "guest", Password: "guest"}},
		Vhost: "/",
	})
	if err != nil {
		_ = sconn.Close()
		<-served
		return fmt.Errorf("open: %w", err)
	}
	err = client(conn)
	if cerr := conn.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("close: %w", cerr)
	}
	if serr := <-served; err == nil && serr != nil {
		err = fmt.Errorf("broker: %w", serr)
	}
	return err
}

// fakeBroker is the server end of one connection.
type fakeBroker struct{ conn net.Conn }

// serve runs the handshake, then more (when not nil), then answers the
// client's connection.close.
func (b *fakeBroker) serve(serverProps []byte, more func(*fakeBroker) error) error {
	header := make([]byte, 8)
	if _, err := io.ReadFull(b.conn, header); err != nil {
		return err
	}
	if string(header) != "AMQP\x00\x00\x09\x01" {
		return fmt.Errorf("protocol header %q", header)
	}
	start := append([]byte{0, 9}, serverProps...)
	start = append(start, longstr("PLAIN")...)
	start = append(start, longstr("en_US")...)
	if err := b.writeMethod(0, 10, 10, start); err != nil { // connection.start
		return err
	}
	if _, err := b.expectMethod(10, 11); err != nil { // start-ok
		return err
	}
	tune := binary.BigEndian.AppendUint16(nil, 0)          // channel-max
	tune = binary.BigEndian.AppendUint32(tune, 131072)     // frame-max
	tune = binary.BigEndian.AppendUint16(tune, 0)          // heartbeat
	if err := b.writeMethod(0, 10, 30, tune); err != nil { // connection.tune
		return err
	}
	if _, err := b.expectMethod(10, 31); err != nil { // tune-ok
		return err
	}
	if _, err := b.expectMethod(10, 40); err != nil { // connection.open
		return err
	}
	if err := b.writeMethod(0, 10, 41, []byte{0}); err != nil { // open-ok
		return err
	}
	if more != nil {
		if err := more(b); err != nil {
			return err
		}
	}
	if _, err := b.expectMethod(10, 50); err != nil { // connection.close
		return err
	}
	return b.writeMethod(0, 10, 51, nil) // close-ok
}

func (b *fakeBroker) readFrame() (typ byte, channel uint16, payload []byte, err error) {
	head := make([]byte, 7)
	if _, err := io.ReadFull(b.conn, head); err != nil {
		return 0, 0, nil, err
	}
	payload = make([]byte, binary.BigEndian.Uint32(head[3:])+1)
	if _, err := io.ReadFull(b.conn, payload); err != nil {
		return 0, 0, nil, err
	}
	if payload[len(payload)-1] != 0xCE {
		return 0, 0, nil, errors.New("no frame end")
	}
	return head[0], binary.BigEndian.Uint16(head[1:]), payload[:len(payload)-1], nil
}

// expectMethod reads the next frame, which must be the given method, and
// returns its arguments.
func (b *fakeBroker) expectMethod(class, method uint16) ([]byte, error) {
	typ, _, payload, err := b.readFrame()
	if err != nil {
		return nil, err
	}
	if typ != 1 || len(payload) < 4 || binary.BigEndian.Uint16(payload) != class || binary.BigEndian.Uint16(payload[2:]) != method {
		return nil, fmt.Errorf("want method %d.%d, got frame type %d: %q", class, method, typ, payload)
	}
	return payload[4:], nil
}

func (b *fakeBroker) writeMethod(channel, class, method uint16, args []byte) error {
	frame := []byte{1}
	frame = binary.BigEndian.AppendUint16(frame, channel)
	frame = binary.BigEndian.AppendUint32(frame, uint32(4+len(args)))
	frame = binary.BigEndian.AppendUint16(frame, class)
	frame = binary.BigEndian.AppendUint16(frame, method)
	frame = append(frame, args...)
	_, err := b.conn.Write(append(frame, 0xCE))
	return err
}

func longstr(s string) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(s))), s...)
}
