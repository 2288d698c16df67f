package amqpdial

import (
	"context"
	"errors"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/internal/testamqp"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// dead is an address nothing listens on: the connect is refused at once.
const dead = "amqp://guest:s3cret@127.0.0.1:1/"

func TestParse(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   []string
		want []string
	}{
		{[]string{"amqp://guest:guest@127.0.0.1:5672/"}, []string{"amqp://guest:guest@127.0.0.1:5672/"}},
		{[]string{"amqp://a:1@n1:5672/, amqps://a:1@n2:5671/vh"}, []string{"amqp://a:1@n1:5672/", "amqps://a:1@n2:5671/vh"}},
		{[]string{"amqp://n1/", "amqp://n2/,amqp://n3/"}, []string{"amqp://n1/", "amqp://n2/", "amqp://n3/"}},
		// A comma inside a URL (a password) stays in it.
		{[]string{"amqp://u:p,w@n1/,AMQP://n2/"}, []string{"amqp://u:p,w@n1/", "AMQP://n2/"}},
		{[]string{"amqp://n1/?heartbeat=5,amqp://n2/"}, []string{"amqp://n1/?heartbeat=5", "amqp://n2/"}},
	} {
		got, err := Parse(tc.in...)
		if err != nil {
			t.Fatalf("Parse(%q): %v", tc.in, err)
		}
		if !slices.Equal(got.URLs(), tc.want) {
			t.Errorf("Parse(%q) = %q; want %q", tc.in, got.URLs(), tc.want)
		}
	}
}

func TestParseRefusesABadURLAnywhere(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"",
		"amqp://guest:s3cret@n1/,http://guest:s3cret@n2/",
		"http://guest:s3cret@n1/,amqp://guest:s3cret@n2/",
		"amqp://guest:s3cret@n1/,,amqp://guest:s3cret@n2/",
		"amqp://guest:s3cret@n1/,",
		"amqp://guest:s3cret@n1:notaport/",
		"amqp://idemq:s3cret/@:pw@[::1",
		"amqp://guest:guest@n1/,amqp://idemq:s3cret/@:pw@n2/",
	} {
		_, err := Parse(in)
		if err == nil {
			t.Errorf("Parse(%q): nil error", in)
			continue
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Parse(%q): the error carries the password: %v", in, err)
		}
	}
	_, err := Parse("amqp://guest:s3cret@n1/,http://guest:s3cret@n2/")
	if want := "broker URL http://xxxxx@n2/ (2 of 2)"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("error %v; want it to contain %q", err, want)
	}
}

func TestAddrsString(t *testing.T) {
	t.Parallel()
	a, err := Parse("amqp://guest:s3cret@n1:5672/,amqp://guest:s3cret@n2:5672/")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := a.String(), "amqp://xxxxx@n1:5672/,amqp://xxxxx@n2:5672/"; got != want {
		t.Errorf("String() = %q; want %q", got, want)
	}
}

// TestDialSkipsADeadAddress: with a dead address and the test broker, in
// either order, Dial opens a connection to the broker, named as asked.
func TestDialSkipsADeadAddress(t *testing.T) {
	t.Parallel()
	addrs, err := Parse(dead + "," + testamqp.URL())
	if err != nil {
		t.Fatal(err)
	}
	for _, order := range [][]int{{0, 1}, {1, 0}} {
		d := Dialer{Addrs: addrs, Name: "idemq-test-amqpdial", Timeout: 5 * time.Second,
			shuffle: func(int) []int { return order }}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		conn, err := d.Dial(ctx)
		cancel()
		if err != nil {
			t.Fatalf("order %v: %v", order, err)
		}
		if conn.IsClosed() {
			t.Errorf("order %v: the connection is closed", order)
		}
		_ = conn.Close()
	}
}

// TestDialErrorNamesEveryAddress: a pass where nothing answers names each
// address, redacted, and still wraps the network errors.
func TestDialErrorNamesEveryAddress(t *testing.T) {
	t.Parallel()
	addrs, err := Parse(dead + ",amqp://guest:s3cret@127.0.0.1:2/")
	if err != nil {
		t.Fatal(err)
	}
	d := Dialer{Addrs: addrs, Timeout: 2 * time.Second}
	_, err = d.Dial(context.Background())
	var de *Error
	if !errors.As(err, &de) || len(de.Attempts) != 2 {
		t.Fatalf("Dial: %v; want an *Error with two attempts", err)
	}
	msg := err.Error()
	if strings.Contains(msg, "s3cret") {
		t.Errorf("the error carries the password: %s", msg)
	}
	for _, want := range []string{"amqp://xxxxx@127.0.0.1:1/", "amqp://xxxxx@127.0.0.1:2/", "connection refused"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q; want it to name %q", msg, want)
		}
	}
	var opErr *net.OpError
	if !errors.As(err, &opErr) {
		t.Errorf("error %v does not wrap the *net.OpError", err)
	}
}

// TestDialStopsAtARefusal: the broker's refusal of the credentials ends the
// pass (the next node of a cluster would refuse them too), and it is
// recognisable as such.
func TestDialStopsAtARefusal(t *testing.T) {
	t.Parallel()
	_, userURL := testamqp.AddUser(t, "amqpdial")
	wrong, err := url.Parse(userURL)
	if err != nil {
		t.Fatal(err)
	}
	wrong.User = url.UserPassword(wrong.User.Username(), "not-the-password")
	addrs, err := Parse(wrong.String() + "," + dead)
	if err != nil {
		t.Fatal(err)
	}
	d := Dialer{Addrs: addrs, Timeout: 5 * time.Second, shuffle: func(int) []int { return []int{0, 1} }}
	_, err = d.Dial(context.Background())
	var de *Error
	if !errors.As(err, &de) || len(de.Attempts) != 1 || !Refused(err) || !errors.Is(err, amqp.ErrCredentials) {
		t.Fatalf("Dial: %v; want one attempt, refused (ErrCredentials)", err)
	}
	if strings.Contains(err.Error(), "not-the-password") {
		t.Errorf("the error carries the password: %v", err)
	}
}

// TestDialShuffles: over repeated passes, each of two addresses is tried
// first some of the time.
func TestDialShuffles(t *testing.T) {
	t.Parallel()
	var (
		mu    sync.Mutex
		first []string
	)
	// Two listeners that accept and hang up at once: every pass tries both,
	// and each records when it was reached.
	urls := make([]string, 2)
	var (
		wg  sync.WaitGroup
		lns []net.Listener
	)
	t.Cleanup(func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
		wg.Wait()
	})
	for i := range urls {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		addr := ln.Addr().String()
		urls[i] = "amqp://guest:guest@" + addr + "/"
		wg.Go(func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				first = append(first, addr)
				mu.Unlock()
				_ = c.Close()
			}
		})
	}
	addrs, err := Parse(strings.Join(urls, ","))
	if err != nil {
		t.Fatal(err)
	}
	d := Dialer{Addrs: addrs, Timeout: 2 * time.Second}
	seen := map[string]bool{}
	for range 40 {
		mu.Lock()
		first = first[:0]
		mu.Unlock()
		if _, err := d.Dial(context.Background()); err == nil {
			t.Fatal("Dial to listeners that hang up succeeded")
		}
		mu.Lock()
		if len(first) > 0 {
			seen[first[0]] = true
		}
		mu.Unlock()
		if len(seen) == 2 {
			return
		}
	}
	t.Fatalf("in 40 passes only %v was tried first", seen)
}
