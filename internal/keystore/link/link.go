// Package link carries the runtime's side of the key store from package
// dedup, which sets Keys when it is initialised, to package keystore, which
// types it. It imports neither, so that both can import it.
package link

// Keys returns the runtime's protocol of a *dedup.Store (a value of type
// keystore.Keys). Package dedup sets it in its init; nothing else does.
var Keys func(store any) any
