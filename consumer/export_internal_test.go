package consumer

// DeathReserve exposes, to the package's tests, the room a retry copy
// leaves for the broker's dead-lettering headers.
func DeathReserve(cfg *Config) int { return deathReserve(NewTopology(cfg.TopologyConfig())) }
