//go:build race

package main_test

// raceEnabled builds the binary under test with -race when the tests run with it.
const raceEnabled = true
