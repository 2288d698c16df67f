package consumer

// Mode is one way a consumer runs: how its handlers run (one delivery per
// transaction, a group with a savepoint per handler, an optimistic group
// without, a BatchHandler) and how its keys are held (in the group's
// transaction, or as separate leases others can see). The tests, the crash
// kit (consumertest) and `idemq bench` run the consumer in each of Modes;
// Apply is the one mapping from a mode to a Config.
type Mode string

// The modes. Each but the default holds its keys in the group's
// transaction; the -separate ones reserve them with a statement of their
// own (Config.SeparateReservations).
const (
	// ModeGroup: group commit, each handler under a savepoint of its own
	// (the default).
	ModeGroup Mode = "group"
	// ModeGroupSeparate: ModeGroup with separate reservations.
	ModeGroupSeparate Mode = "group-separate"
	// ModeSingle: one delivery per transaction (Group.Size 1).
	ModeSingle Mode = "single"
	// ModeSingleSeparate: ModeSingle with a separate reservation.
	ModeSingleSeparate Mode = "single-separate"
	// ModeOptimistic: group commit without savepoints (Group.Optimistic).
	ModeOptimistic Mode = "optimistic"
	// ModeOptimisticSeparate: ModeOptimistic with separate reservations.
	ModeOptimisticSeparate Mode = "optimistic-separate"
	// ModeBatch: a BatchHandler (NewBatch) handles the group in one call.
	ModeBatch Mode = "batch"
	// ModeBatchSeparate: ModeBatch with separate reservations.
	ModeBatchSeparate Mode = "batch-separate"
)

// Modes returns every mode, in the order above.
func Modes() []Mode {
	return []Mode{ModeGroup, ModeGroupSeparate, ModeSingle, ModeSingleSeparate,
		ModeOptimistic, ModeOptimisticSeparate, ModeBatch, ModeBatchSeparate}
}

// Base returns the mode without its separate reservations: ModeGroup,
// ModeSingle, ModeOptimistic or ModeBatch.
func (m Mode) Base() Mode {
	switch m {
	case ModeGroupSeparate:
		return ModeGroup
	case ModeSingleSeparate:
		return ModeSingle
	case ModeOptimisticSeparate:
		return ModeOptimistic
	case ModeBatchSeparate:
		return ModeBatch
	}
	return m
}

// Valid reports whether m is one of Modes.
func (m Mode) Valid() bool {
	for _, x := range Modes() {
		if m == x {
			return true
		}
	}
	return false
}

// Batch reports whether the mode runs a BatchHandler (made by NewBatch).
func (m Mode) Batch() bool { return m.Base() == ModeBatch }

// Optimistic reports whether the mode runs optimistic groups.
func (m Mode) Optimistic() bool { return m.Base() == ModeOptimistic }

// Single reports whether the mode runs one delivery per transaction.
func (m Mode) Single() bool { return m.Base() == ModeSingle }

// Separate reports whether the mode reserves its keys with a statement of
// their own, as leases others can see (with a heartbeat, and a lease to
// lose).
func (m Mode) Separate() bool { return m != m.Base() }

// Apply sets the fields of c that make the mode: Group.Size 1 for the
// single modes (a Group.Size of 1 is left to the default otherwise),
// Group.Optimistic, SeparateReservations. The batch modes need NewBatch as
// well.
func (m Mode) Apply(c *Config) {
	switch {
	case m.Single():
		c.Group.Size = 1
	case c.Group.Size == 1:
		c.Group.Size = 0
	}
	c.Group.Optimistic = m.Optimistic()
	c.SeparateReservations = m.Separate()
}

// ModeOf returns the mode cfg makes, with a BatchHandler (batch) or a
// Handler: the inverse of Apply.
func ModeOf(cfg *Config, batch bool) Mode {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	m := ModeGroup
	switch {
	case batch:
		m = ModeBatch
	case c.Group.Optimistic:
		m = ModeOptimistic
	case c.Group.Size == 1:
		m = ModeSingle
	}
	if c.SeparateReservations {
		m += "-separate"
	}
	return m
}

// Mode returns the mode the consumer runs in.
func (c *Consumer) Mode() Mode { return ModeOf(&c.cfg, c.batchHandler != nil) }
