"""Local swarms of processes (and `swarm demo` on one), network-namespace and docker compose testbeds."""
