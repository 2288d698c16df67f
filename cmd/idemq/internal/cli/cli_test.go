package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestCause(t *testing.T) {
	refused := fmt.Errorf("failed to connect: %w", &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED})
	for _, tc := range []struct {
		err  error
		want string
	}{
		{refused, "connection refused"},
		{fmt.Errorf("ping: %w", context.DeadlineExceeded), "no answer within 5s"},
		{errors.Join(refused, errors.New("second host")), "connection refused"},
		{errors.New("dial amqp://u:secret@h:1/: boom"), "dial amqp://xxxxx@h:1/: boom"},
	} {
		if got := cause(tc.err, 5*time.Second); got != tc.want {
			t.Errorf("cause(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

func TestMainExitCodes(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"version"}, ExitOK},
		{[]string{"dlq"}, ExitOK},
		{[]string{"nope"}, ExitUsage},
		{[]string{"gc", "--retention", "0s"}, ExitUsage},
		{[]string{"version", "--log-format", "xml"}, ExitUsage},
		{[]string{"migrate", "--postgres-url", "postgres://u:secret@127.0.0.1:1/x", "--connect-timeout", "2s"}, ExitFailure},
	} {
		var stdout, stderr bytes.Buffer
		if code := Main(context.Background(), tc.args, &stdout, &stderr); code != tc.code {
			t.Errorf("%v: exit %d, want %d\n%s%s", tc.args, code, tc.code, stdout.String(), stderr.String())
		}
		if strings.Contains(stderr.String(), "secret") {
			t.Errorf("%v: secret leaked: %s", tc.args, stderr.String())
		}
	}
}
