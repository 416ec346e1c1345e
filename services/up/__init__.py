"""``plexrl up``: the whole system on one machine, several runs learning at once."""
