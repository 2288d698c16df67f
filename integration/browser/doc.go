// Package browser tests `idemq ui` in a real browser: headless Chromium,
// driven over the DevTools protocol by chromedp, against real Postgres and
// RabbitMQ and a real consumer. It is a module of its own so that chromedp
// stays out of the library's and the binary's go.mod.
//
// The browser is IDEMQ_CHROMIUM, else chromium (Debian's package, which
// `make test` installs where it is missing, see deploy/local/ensure-chromium.sh)
// on PATH. Without one the test fails, saying so; it never skips.
//
// The test saves its screenshots as docs/img/ui-*.png (docs/ui.md shows
// them); IDEMQ_UI_SCREENSHOTS names another directory.
package browser
