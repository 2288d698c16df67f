package dedup

import "github.com/idemq/idemq/internal/keystore/link"

// keys is the store seen by the runtime: the reservations made in a
// caller's transaction and the batch forms, which are the consumer's
// protocol rather than what a user of the store calls. Its methods are
// reached through package internal/keystore (keystore.Of), for the
// packages of this module; they are documented there.
type keys Store

func init() {
	link.Keys = func(s any) any { return (*keys)(s.(*Store)) }
}

// store is the store k is.
func (k *keys) store() *Store { return (*Store)(k) }
