"""The swarm-peer daemon and what it runs beside its stage: DHT bootstrap, planning, status."""
