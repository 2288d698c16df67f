package dedup

import (
	"encoding/json"
	"fmt"
)

// encodeHeaders is the response_headers column of a result's headers: a
// JSON object from name to values, or NULL for none.
func encodeHeaders(h map[string][]string) (*string, error) {
	if len(h) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("complete key: encode response headers: %w", err)
	}
	s := string(b)
	return &s, nil
}

// decodeHeaders reads the response_headers column into h (nil for NULL).
func decodeHeaders(b []byte, h *map[string][]string) error {
	if len(b) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, h); err != nil {
		return fmt.Errorf("read key: response headers: %w", err)
	}
	return nil
}
