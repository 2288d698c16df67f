package idemhttp

import (
	"crypto/sha256"
	"fmt"
	"net/http"

	"github.com/idemq/idemq/dedup"
)

// RequestFingerprint is the default fingerprint: SHA-256 over the method,
// the path with its query (the request target: "/payments?currency=EUR")
// and the body bytes, each length-prefixed, so that the same key sent to
// another route, or with another body, is a reused key (422).
func RequestFingerprint(r *http.Request, body []byte) (dedup.Fingerprint, error) {
	h := sha256.New()
	target := r.URL.RequestURI()
	fmt.Fprintf(h, "%d:%s;%d:%s;%d:", len(r.Method), r.Method, len(target), target, len(body))
	h.Write(body)
	var fp dedup.Fingerprint
	h.Sum(fp[:0])
	return fp, nil
}

// FieldsFingerprint returns a fingerprint over the method, the path with
// its query and the named fields of a JSON object body, canonicalised as
// dedup.JSONFieldsFingerprint does (sorted keys, no spaces; a dotted name
// reaches into nested objects), so that a changed comment or metadata field
// does not turn a legal retry into a 422. A body that is not a JSON object
// answers 400.
func FieldsFingerprint(fields ...string) func(r *http.Request, body []byte) (dedup.Fingerprint, error) {
	fp := dedup.JSONFieldsFingerprint(fields...)
	return func(r *http.Request, body []byte) (dedup.Fingerprint, error) {
		sum, err := fp(body)
		if err != nil {
			return dedup.Fingerprint{}, err
		}
		return RequestFingerprint(r, sum[:])
	}
}
