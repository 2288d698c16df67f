package bench

import (
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// The report of wrk 4.1 (Debian's) with --latency and wrkScript, against
// a server answering some 409s, some 503s and some replays.
const wrkReport = `Running 2s test @ http://127.0.0.1:42835/messages
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     7.64ms   16.13ms 121.26ms   92.06%
    Req/Sec     4.76k     1.70k    7.77k    63.16%
  Latency Distribution
     50%    2.60ms
     75%    4.12ms
     90%   17.94ms
     99%   99.69ms
  18474 requests in 2.04s, 1.50MB read
  Non-2xx or 3xx responses: 3012
Requests/sec:   9039.55
Transfer/sec:    749.12KB
idemq-bench: conflicts 1212 others 1800 replayed 2481
`

func TestParseWrk(t *testing.T) {
	got, err := parseWrk([]byte(wrkReport))
	if err != nil {
		t.Fatal(err)
	}
	want := wrkResult{Requests: 18474, Elapsed: 2040 * time.Millisecond, Rate: 9039.55,
		P50: 2600 * time.Microsecond, P99: 99690 * time.Microsecond,
		Non2xx: 3012, Conflicts: 1212, Others: 1800, Replayed: 2481}
	if got != want {
		t.Errorf("parseWrk:\n got %+v\nwant %+v", got, want)
	}
}

// Microseconds and seconds, socket errors, and no line of non-2xx answers
// (wrk prints it only when there are some).
func TestParseWrkUnitsAndSocketErrors(t *testing.T) {
	report := `Running 1s test @ http://127.0.0.1:1/messages
  2 threads and 32 connections
  Latency Distribution
     50%  812.00us
     75%    1.00ms
     90%    1.20s
     99%    2.50s
  1234 requests in 1.00s, 100.00KB read
  Socket errors: connect 1, read 2, write 3, timeout 4
Requests/sec:   1233.10
Transfer/sec:    100.00KB
idemq-bench: conflicts 0 others 0 replayed 0
`
	got, err := parseWrk([]byte(report))
	if err != nil {
		t.Fatal(err)
	}
	if got.P50 != 812*time.Microsecond || got.P99 != 2500*time.Millisecond || got.SocketErrors != 10 || got.Non2xx != 0 || got.Requests != 1234 {
		t.Errorf("parseWrk: %+v", got)
	}
}

func TestParseWrkRefusesAPartialReport(t *testing.T) {
	for name, report := range map[string]string{
		"no rate":    strings.Replace(wrkReport, "Requests/sec:   9039.55\n", "", 1),
		"no counts":  strings.Replace(wrkReport, "idemq-bench: conflicts 1212 others 1800 replayed 2481\n", "", 1),
		"no latency": strings.Replace(wrkReport, "     50%    2.60ms\n", "", 1),
		"bad count":  strings.Replace(wrkReport, "Non-2xx or 3xx responses: 3012", "Non-2xx or 3xx responses: many", 1),
	} {
		if _, err := parseWrk([]byte(report)); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

func TestSelectRows(t *testing.T) {
	scs := httpScenarios()
	names := func(re string) []string {
		var out []string
		for _, sc := range selectRows(scs, regexp.MustCompile(re), func(sc scenario) bool { return sc.bare }) {
			out = append(out, sc.name)
		}
		return out
	}
	if got := names("^idemq gateway$"); !slices.Equal(got, []string{"http bare publish: POST → publish with confirms", "idemq gateway"}) {
		t.Errorf("gateway: %q", got)
	}
	if got := names("http|gateway"); len(got) != len(scs) {
		t.Errorf("all: %q", got)
	}
	if got := names("bare"); got != nil {
		t.Errorf("bare rows alone: %q, want none", got)
	}
}
